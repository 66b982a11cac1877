"""The usual RMSNorm claims, each judged from the study's numbers: reproduced / not reproduced /
not measurable here, with the number that decided it.

* equal loss at equal tokens: the final held-out loss of the RMSNorm arm relative to LayerNorm's,
  paired by seed. Reproduced when the whole 95 % interval lies within ±EQUAL_LOSS_MARGIN (an
  equivalence test: "no measurable difference" alone is not evidence of equality); not reproduced
  when it lies wholly outside; otherwise (or with an arm that diverged) not measurable here.
* 10–30 % higher training throughput: study/speed.py — not measurable here when the Amdahl bound
  is below 1.10, too noisy to tell (no verdict) under load or with a null control outside its
  band, else the bootstrap interval's low end ≥ 1.10 reproduces, its high end < 1.10 refutes.
* better low-precision stability ("RMS ≥ σ"): from the --stability sweep (learning rates rising until
  divergence, in the training precision): reproduced when RMSNorm's largest stable rate, diverged
  runs or held-out spike rate is better with an interval across seeds, and none is worse; an fp32
  study says not measurable here (stability.py). The kernel-accuracy table (precision.py) is a
  separate section and decides nothing here.
* the migration rule (γ = 1, linear warmup, η_RMS = η_LN × gradient-scale ratio): needs
  ``--lr-sweep`` with ≥ 5 log-spaced rates bracketing each best rate; reproduced when the rule's
  ratio lies inside the bootstrap interval of η*_RMS/η*_LN (fitted on the test split, window chosen
  on validation) and that interval spans at most ×2 (migration.py).
"""

from __future__ import annotations

from normswap.study import migration as migration_mod
from normswap.study import speed, stats
from normswap.study import stability as stability_mod

EQUAL_LOSS_MARGIN = 0.01
REPRODUCED, NOT_REPRODUCED, NOT_MEASURABLE = "reproduced", "not reproduced", "not measurable here"


def _pct(x):
    return "n/a" if x is None else f"{x * 100:+.2f} %"


def equal_loss(cmp: dict) -> tuple[str, str]:
    iv = cmp["final_eval_loss_relative"]
    if cmp["diverged"]["arm"] or cmp["diverged"]["baseline"]:
        who = "the RMSNorm arm" if cmp["diverged"]["arm"] else "the LayerNorm arm"
        return NOT_MEASURABLE, f"{who} diverged in {max(cmp['diverged'].values())} seed(s)"
    if not iv or iv["low"] is None:
        return NOT_MEASURABLE, "needs ≥ 2 seeds for an interval"
    text = f"final held-out loss {stats.fmt(iv, '+.2%')} vs LayerNorm (margin ±{EQUAL_LOSS_MARGIN:.0%})"
    m = EQUAL_LOSS_MARGIN
    if -m <= iv["low"] and iv["high"] <= m:
        return REPRODUCED, text
    if iv["low"] > m or iv["high"] < -m:
        return NOT_REPRODUCED, text
    return NOT_MEASURABLE, text + ": the interval is wider than the margin"


def throughput(cmp: dict, control: dict | None, loads=(), cpus: int | None = None) -> tuple[str, str]:
    """study/speed.py's rule: the Amdahl bound, the load and null-control gates, the interval."""
    return speed.throughput_verdict(
        cmp.get("throughput_ratio_bootstrap"),
        (control or {}).get("throughput_ratio_bootstrap"),
        cmp.get("amdahl_bound"),
        list(loads),
        cpus,
    )


def stability(arm: str, sweep: dict | None, train_precision: str) -> tuple[str, str]:
    """Judged from the --stability sweep in the study's training precision (stability.py), never from
    the kernel-accuracy table."""
    if sweep is None:
        return stability_mod.judge(None, train_precision)
    return stability_mod.judge(
        sweep["comparisons"].get(arm), train_precision, sweep.get("norm_compute_dtypes", {}).get(arm)
    )


def migration(rule: dict | None) -> tuple[str, str]:
    """migration.py's rule: η* fitted per arm on the test split, window chosen on validation, bootstrap interval."""
    return migration_mod.judge(rule)


def judge(
    comparisons: dict,
    rules: dict,
    precision: dict | None,
    train_precision: str,
    control: str,
    *,
    loads=(),
    stability_sweep: dict | None = None,
    cpus: int | None = None,
) -> list[dict]:
    """One row per (claim, RMSNorm arm); ``loads``/``cpus``: the machine's recorded load (speed.py)."""
    rows = []
    ctl = comparisons.get(control)
    for arm, cmp in comparisons.items():
        if arm == control:
            continue
        for claim, (verdict, number) in (
            ("equal loss at equal tokens", equal_loss(cmp)),
            ("10–30 % higher training throughput", throughput(cmp, ctl, loads, cpus)),
            ("better low-precision stability (RMS ≥ σ)", stability(arm, stability_sweep, train_precision)),
            ("migration rule: γ = 1, linear warmup, η_RMS = η_LN × gradient-scale ratio", migration(rules.get(arm))),
        ):
            rows.append({"claim": claim, "arm": arm, "verdict": verdict, "decided_by": number})
    return rows


def null_control(ctl: dict | None) -> dict | None:
    """The layernorm-control arm's throughput ratio against layernorm, per seed and bootstrapped,
    and whether it is within the null band (study/speed.py control_gate: normswap's one rule)."""
    if not ctl or not ctl.get("throughput_ratio"):
        return None
    iv = ctl["throughput_ratio"]
    gate = speed.control_gate(ctl.get("throughput_ratio_bootstrap"))
    return {
        "band": gate["band"],
        "per_seed": iv["values"],
        "interval": iv,
        "bootstrap": gate["interval"],
        "per_seed_within": all(abs(v - 1) <= gate["band"] for v in iv["values"]),
        "interval_within": gate["within"],
    }
