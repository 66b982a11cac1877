"""The usual claims about RMSNorm (and, beside it, DyT and LayerNorm without β), each judged from
the study's numbers: reproduced / not reproduced / not measurable here, with the number that
decided it.

One judge function per claim (``CLAIMS``): it sees the arm's comparison with layernorm and the
study's context (``Context``: margin, baselines, null control, precision, sweep) and returns a
``Verdict``. A judge that decides by a statistical test gives that test's p-value; ``judge``
then adjusts every p-value of the study together (Holm's step-down method, holm) and a
verdict whose adjusted p-value is above α becomes "not measurable here" — so the more arms and
claims a study judges, the stronger each verdict's evidence must be. Whatever no test decided
(no interval, a gate that more seeds cannot open) is not in the family. Two rules hold for every
claim: no verdict from fewer than ``MIN_SEEDS`` seeds, and a row says whether more seeds could
still decide it (``open``: the runner's sequential seeds stop when no row is open).

* equal loss at equal tokens (every arm but the baseline and the control): the paired difference
  of final quality (mean of the final evaluations; a diverged seed scores ln V) in absolute nats.
  Reproduced when the whole 90 % interval lies within ±margin (TOST), not reproduced when it lies
  wholly beyond; "not measurable here" when either arm's mean final loss is not below the bigram
  baseline by the margin (a loss both reach by learning almost nothing is equal by construction).
  The null control's own difference (its data order and dropout differ) is quoted beside it: the
  noise floor of a study that shares nothing but the initialisation.
* 10–30 % higher training throughput: study/judging/speed.py — not measurable here when the Amdahl bound
  is below 1.10, too noisy to tell (no verdict) under load or with a null control outside its
  band, else the bootstrap interval's low end ≥ 1.10 reproduces, its high end < 1.10 refutes.
* better low-precision stability ("RMS ≥ σ"): from the --stability sweep (learning rates rising until
  divergence, in the training precision): one declared number decides — the largest stable rate
  (the held-out spike rate where that has no number) — by a t-interval and an exact sign-flip test
  across seeds (≥ 6 agreeing seeds: coarse outcomes tie), its p-value in the Holm family; an fp32
  study says not measurable here (stability.py). The kernel-accuracy table (precision.py) is a
  separate section and decides nothing here.
* the migration rule (γ = 1, linear warmup, η_RMS = η_LN × gradient-scale ratio): needs
  ``--lr-sweep`` with ≥ 5 log-spaced rates bracketing each best rate; reproduced when the rule's
  ratio lies inside the bootstrap interval of η*_RMS/η*_LN (fitted on the test split, window chosen
  on validation) and that interval spans at most ×2 (migration.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from normswap.stats.levels import ALPHA
from normswap.stats.multiple_comparisons import holm
from normswap.stats.t_intervals import fmt_t_interval
from normswap.study.judging import speed
from normswap.study.training import migration as migration_mod
from normswap.study.training import stability as stability_mod

REPRODUCED, NOT_REPRODUCED, NOT_MEASURABLE = "reproduced", "not reproduced", "not measurable here"
MIN_SEEDS = 2  # every claim's floor; the stability claim's coarse outcomes need more (stability.py)
RMS_ARMS = ("rmsnorm", "rmsnorm-exact", "rmsnorm-approx", "rmsnorm-no-warmup", "rmsnorm-keep-gamma")

EQUAL_LOSS = "equal loss at equal tokens"
THROUGHPUT = "10–30 % higher training throughput"
STABILITY = "better low-precision stability (RMS ≥ σ)"
MIGRATION = "migration rule: γ = 1, linear warmup, η_RMS = η_LN × gradient-scale ratio"


@dataclass
class Verdict:
    """One claim for one arm. ``reason``: a short code for why (rows sharing claim, verdict and reason
    say the same thing: the report may group them); ``p_value``: the deciding test's, when a test
    decided; ``open``: more seeds could still change a "not measurable here"."""

    verdict: str
    decided_by: str
    reason: str
    p_value: float | None = None
    open: bool = False
    details: dict = field(default_factory=dict)


@dataclass
class Context:
    """What every judge may read besides the arm's own comparison."""

    margin: float
    baselines: dict | None = None
    control: dict | None = None  # the layernorm-control comparison (noise floor, throughput control)
    null_control: dict | None = None
    precision: dict | None = None
    train_precision: str = "fp32"
    rules: dict = field(default_factory=dict)
    alpha: float = ALPHA
    loads: tuple = ()  # the machine's recorded load averages (study/judging/speed.py's gate)
    cpus: int | None = None
    stability_sweep: dict | None = None
    throughput_null: dict | None = None  # the speed verdicts' null control (the timing phase's, or the control's)


def _pct(x):
    return "n/a" if x is None else f"{x * 100:+.2f} %"


def _noise_floor(ctx: Context) -> str:
    ctl = (ctx.control or {}).get("final_eval_loss_difference")
    if not ctl:
        return ""
    return f"; noise floor (layernorm-control, own data order): {fmt_t_interval(ctl, '+.4f')} nats"


def _standard_errors(cmp: dict, margin: float) -> str:
    """Where the interval's width comes from: seed to seed, and the held-out blocks' sampling alone
    (the part more --eval-tokens shrinks); each against the margin it must resolve."""
    seed_se, block_se = cmp.get("seed_standard_error"), cmp.get("heldout_standard_error")
    if seed_se is None and block_se is None:
        return ""
    parts = []
    if seed_se is not None:
        parts.append(f"seed to seed {seed_se:.4f}" + (" (more seeds)" if seed_se >= margin / 2 else ""))
    if block_se is not None:
        parts.append(f"held-out sampling {block_se:.4f}" + (" (more --eval-tokens)" if block_se >= margin / 2 else ""))
    return f"; standard error {', '.join(parts)} nats against the margin's half {margin / 2:g}"


def equal_loss(cmp: dict, ctx: Context) -> Verdict:
    m = ctx.margin
    eq = cmp.get("final_eval_loss_equivalence")
    div = cmp["diverged"]
    diverged = ""
    if div["arm"] or div["baseline"]:
        diverged = (
            f"; diverged in {div['arm']} (arm) and {div['baseline']} (layernorm) of {len(cmp['seeds'])} seeds, "
            "each scored ln V"
        )
    if eq is None:
        return Verdict(
            NOT_MEASURABLE, f"needs ≥ {MIN_SEEDS} seeds for an interval" + diverged, "too-few-seeds", open=True
        )
    means = cmp.get("final_eval_loss_means") or {}
    bigram = (ctx.baselines or {}).get("bigram_loss")
    worst = max((v for v in means.values() if v is not None), default=None)
    if bigram is not None and (worst is None or worst > bigram - m):
        reached = "no arm finished" if worst is None else f"final held-out loss {worst:.4f} is"
        return Verdict(
            NOT_MEASURABLE,
            f"{reached} not below the count-bigram baseline {bigram:.4f} by the margin {m:g}: the models have "
            "learned too little for their equality to mean anything (train longer)" + diverged,
            "not-below-bigram",
        )
    iv = eq["interval"]
    text = (
        f"final held-out loss difference {fmt_t_interval(iv, '+.4f')} nats (margin ±{m:g}; "
        f"p(equivalent) {eq['p_equivalent']:.3g}, p(beyond margin) {eq['p_beyond']:.3g})"
        + diverged
        + _standard_errors(cmp, m)
        + _noise_floor(ctx)
    )
    if eq["finding"] == "equivalent":
        return Verdict(REPRODUCED, text, "within-margin", eq["p_equivalent"])
    if eq["finding"] == "beyond margin":
        return Verdict(NOT_REPRODUCED, text, "beyond-margin", eq["p_beyond"])
    return Verdict(
        NOT_MEASURABLE,
        text + ": the interval straddles the margin",
        "straddles-margin",
        min(eq["p_equivalent"], eq["p_beyond"]),
        open=True,
    )


def throughput(cmp: dict, ctx: Context) -> Verdict:
    """study/judging/speed.py's rule: the Amdahl bound, the load and null-control gates, the interval. Only a
    straddling interval or too few seeds is open: more seeds change neither the bound nor the load."""
    verdict, text = speed.throughput_verdict(
        cmp.get("throughput_ratio_bootstrap"),
        ctx.throughput_null or (ctx.control or {}).get("throughput_ratio_bootstrap"),
        cmp.get("amdahl_bound"),
        list(ctx.loads),
        ctx.cpus,
    )
    if verdict != NOT_MEASURABLE:
        return Verdict(verdict, text, "interval")
    for marker, reason in (
        ("cannot give", "amdahl-bound"),
        (speed.TOO_NOISY, "too-noisy"),
        ("no null control", "no-control"),
    ):
        if marker in text:
            return Verdict(verdict, text, reason)
    if "needs ≥ 2 seeds" in text:
        return Verdict(verdict, text, "too-few-seeds", open=True)
    return Verdict(verdict, text, "straddles-claim", open=True)


def stability(cmp: dict, ctx: Context, arm: str) -> Verdict:
    """Judged from the --stability sweep in the study's training precision (stability.py), never from
    the kernel-accuracy table."""
    sweep = ctx.stability_sweep
    if sweep is None:
        verdict, text, p = stability_mod.judge(None, ctx.train_precision)
    else:
        verdict, text, p = stability_mod.judge(
            sweep["comparisons"].get(arm), ctx.train_precision, sweep.get("norm_compute_dtypes", {}).get(arm)
        )
    more_seeds = verdict == NOT_MEASURABLE and any(w in text for w in ("needs ≥", "more seeds", "interval includes"))
    return Verdict(verdict, text, "stability-sweep", p, open=more_seeds)


def migration(cmp: dict, ctx: Context, arm: str) -> Verdict:
    """migration.py's rule: η* fitted per arm on the test split, window chosen on validation, bootstrap interval."""
    verdict, text = migration_mod.judge(ctx.rules.get(arm))
    return Verdict(verdict, text, "migration-fit", open=verdict == NOT_MEASURABLE and "seeds" in text)


@dataclass
class Claim:
    name: str
    judge: Callable[[dict, Context, str], Verdict]
    applies: Callable[[str], bool]


CLAIMS = [
    Claim(EQUAL_LOSS, lambda cmp, ctx, arm: equal_loss(cmp, ctx), lambda arm: True),
    Claim(THROUGHPUT, lambda cmp, ctx, arm: throughput(cmp, ctx), lambda arm: True),
    Claim(STABILITY, stability, lambda arm: arm in RMS_ARMS),
    Claim(MIGRATION, migration, lambda arm: arm in RMS_ARMS),
]


def _row(claim: str, arm: str, v: Verdict) -> dict:
    return {
        "claim": claim,
        "arm": arm,
        "verdict": v.verdict,
        "decided_by": v.decided_by,
        "reason": v.reason,
        "group": f"{claim} | {v.verdict} | {v.reason}",
        "p_value": v.p_value,
        "open": v.open,
    }


def judge(comparisons: dict, ctx: Context, control: str) -> list[dict]:
    """One row per (claim, arm the claim applies to), Holm-adjusted over the rows a test decided. The
    null control and the planted arms are not claims: they check the test (``instrument_check``)."""
    from normswap.study.config import PLANTED_LR

    rows = []
    for arm, cmp in comparisons.items():
        if arm == control or arm in PLANTED_LR:
            continue
        for claim in CLAIMS:
            if not claim.applies(arm):
                continue
            v = claim.judge(cmp, ctx, arm)
            if v.verdict != NOT_MEASURABLE and len(cmp.get("seeds") or []) < MIN_SEEDS:
                v = Verdict(
                    NOT_MEASURABLE,
                    f"one seed: no verdict from fewer than {MIN_SEEDS} ({v.decided_by})",
                    "too-few-seeds",
                    open=True,
                )
            rows.append(_row(claim.name, arm, v))
    adjust(rows, ctx.alpha)
    return rows


def adjust(rows: list[dict], alpha: float) -> None:
    """Holm over every row with a p-value: a decided verdict whose adjusted p-value exceeds α is
    "not measurable here" (and open: more seeds could decide it)."""
    adjusted = holm([r["p_value"] for r in rows], alpha)
    family = sum(1 for p in adjusted if p is not None)
    for r, p in zip(rows, adjusted):
        r["p_holm"] = p
        r["family_size"] = family if p is not None else None
        if p is None or r["verdict"] == NOT_MEASURABLE or p <= alpha:
            continue
        r["decided_by"] += f"; after Holm over {family} tests p = {p:.3g} > {alpha:g}"
        r["verdict"], r["reason"], r["open"] = NOT_MEASURABLE, "holm", True
        r["group"] = f"{r['claim']} | {r['verdict']} | holm"


def multiplicity(rows: list[dict], alpha: float = ALPHA) -> dict:
    family = sum(1 for r in rows if r.get("p_holm") is not None)
    return {
        "method": "Holm step-down over the claims decided by a test",
        "family_size": family,
        "alpha": alpha,
        "claims_judged": len(rows),
        "untested": len(rows) - family,
    }


def open_rows(rows: list[dict]) -> list[dict]:
    """Rows that more seeds could still decide."""
    return [r for r in rows if r["verdict"] == NOT_MEASURABLE and r.get("open")]


def null_control(ctl: dict | None) -> dict | None:
    """The layernorm-control arm against layernorm: its throughput ratio per seed and bootstrapped,
    within the null band or not (study/judging/speed.py control_gate: normswap's one rule), and its loss
    difference (own data order and dropout: the study's noise floor)."""
    if not ctl:
        return None
    out: dict = {}
    if ctl.get("throughput_ratio"):
        iv = ctl["throughput_ratio"]
        gate = speed.control_gate(ctl.get("throughput_ratio_bootstrap"))
        out.update(
            band=gate["band"],
            per_seed=iv["values"],
            interval=iv,
            bootstrap=gate["interval"],
            per_seed_within=all(abs(v - 1) <= gate["band"] for v in iv["values"]),
            interval_within=gate["within"],
        )
    loss = ctl.get("final_eval_loss_difference")
    if loss:
        values = loss["values"]
        out["loss"] = {
            "difference": loss,
            "equivalence": ctl.get("final_eval_loss_equivalence"),
            "noise_floor_nats": math.sqrt(sum(v * v for v in values) / len(values)) if values else None,
            "meaning": "final held-out loss of layernorm-control − layernorm per seed: the same model and "
            "initialisation, its own data order and dropout stream",
        }
    return out or None


# The equal-loss test's two outcomes, in the words of the instrument check (tost's findings).
FINDINGS = {"equivalent": "equivalent", "beyond margin": "different", "undecided": "undecided"}


def _finding(cmp: dict | None, ctx: Context) -> tuple[str, str]:
    """(equivalent / different / undecided / not measurable here, the text): the equal-loss test
    of one arm, with the bigram gate and the seeds floor every claim has."""
    if not cmp:
        return NOT_MEASURABLE, "not run"
    v = equal_loss(cmp, ctx)
    eq = cmp.get("final_eval_loss_equivalence")
    if v.reason in ("too-few-seeds", "not-below-bigram") or eq is None or len(cmp.get("seeds") or []) < MIN_SEEDS:
        return NOT_MEASURABLE, v.decided_by
    return FINDINGS[eq["finding"]], v.decided_by


def instrument_check(comparisons: dict, ctx: Context, control: str, planted: list[str]) -> dict | None:
    """Can this run's equal-loss test go both ways? The null control (layernorm against itself, own
    data order) must come out "equivalent" and every planted arm (a known handicap) "different":
    ``ok`` only when both happened in this same run. Not a claim: the bottom line's "how we know"."""
    rows = {}
    if control in comparisons:
        found, text = _finding(comparisons.get(control), ctx)
        rows[control] = {"role": "null control", "expected": "equivalent", "finding": found, "decided_by": text}
    for arm in planted:
        if arm in comparisons:
            found, text = _finding(comparisons.get(arm), ctx)
            rows[arm] = {"role": "planted difference", "expected": "different", "finding": found, "decided_by": text}
    if not rows:
        return None
    for r in rows.values():
        r["as_expected"] = r["finding"] == r["expected"]
    both = control in rows and any(r["role"] == "planted difference" for r in rows.values())
    return {"arms": rows, "ok": both and all(r["as_expected"] for r in rows.values()), "margin_nats": ctx.margin}
