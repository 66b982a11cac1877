"""Stability in training (``--stability``): learning rates rising until each arm diverges.

For every seed, every arm trains at η = ``--lr`` × RATE_FACTOR^k, k = 0, 1, … (log-spaced, up to
``--stability-rates`` rates), in the study's training precision, with the study's trainer (one
group per (seed, rate), arms interleaved; each unit stored in DIR as ``stability-<unit>`` so a
resumed study keeps it). An arm that diverged at a rate is not run at higher rates in that seed
(divergence is taken to be monotone in the rate: said in results.json).

A run **diverged** when its loss went non-finite, or its final held-out loss is no lower than at
step 0 (it never learned), or it ends more than DIVERGED_RISE above the lowest held-out loss it
reached (it learned, then blew up). Measured per run, outside the timed steps:

* **held-out spikes**: evaluations (EVALS per run) whose held-out loss rose by more than
  HELDOUT_JUMP relative to the previous evaluation — a held-out jump of 22 % counts, whatever the
  training loss's median did; the spike rate is spikes ÷ evaluation intervals;
* **activation RMS and kurtosis** of the residual stream after each block (forward hooks on the
  family's layer list, on PROBE_ROWS fixed held-out rows, in the training precision, model in eval
  mode, between steps), at step 0 and at every evaluation; growth = last ÷ first. Kurtosis is per
  token over the hidden features (E(x − μ)⁴ / σ⁴, 3 for a Gaussian), averaged over tokens.

Per arm (``stability[arm]``): ``largest_stable_lr`` (contract: the largest rate stable in every
seed), per seed, the divergence rate, the held-out spike rate, activation growth. Against
layernorm, paired by seed: the difference in largest stable rate (in sweep steps, log2 when the
factor is 2), in diverged runs and in held-out spike rate; ``judge`` turns those into the claim's
verdict (an fp32 study never reproduces low-precision stability).

One number decides, declared before the sweep runs (``DECIDING``): the largest stable rate; the
held-out spike rate only where the largest stable rate has no number in some seed (both arms
censored: nothing diverged), and the diverged-run count is reported beside them. One deciding
number keeps the claim a single test (no best-of-three), and its p-value joins the study's Holm
family. These are coarse outcomes (whole sweep steps, counts) on which seeds often tie, so a
difference needs both the t-interval and the exact sign-flip test (t_interval ``exact``): n
seeds that all agree give p = 2/2ⁿ, so a verdict takes at least 6 seeds (p = 0.031) — two seeds that
agree are not evidence, however narrow their t-interval.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import torch

from normswap.report.claims import NOT_MEASURABLE, NOT_REPRODUCED, REPRODUCED
from normswap.stats.t_intervals import fmt_t_interval, t_interval
from normswap.study.persistence.study_dir import unit_key
from normswap.study.training.interleaved import autocast_for

RATE_FACTOR = 2.0
DEFAULT_RATES = 6
EVALS = 8  # held-out evaluations per sweep run (spikes are read between consecutive ones)
HELDOUT_JUMP = 0.05  # a held-out spike: +5 % over the previous evaluation
DIVERGED_RISE = 0.20  # diverged: ends 20 % above the lowest held-out loss of the run
PROBE_ROWS = 4
MIN_SEEDS = 3  # a verdict needs an interval across seeds that could have come out the other way
# the number that decides the claim, and the one used where it has no number in some seed
DECIDING = {
    "largest_stable_steps_difference": "largest stable rate",
    "heldout_spike_rate_difference": "held-out spike rate",
}
UNIT_PREFIX = "stability-"


def multipliers(n_rates: int) -> list[float]:
    return [RATE_FACTOR**k for k in range(n_rates)]


def stability_key(arm: str, seed: int, m: float) -> str:
    return UNIT_PREFIX + unit_key(arm, seed, m)


# ---------------------------------------------------------------------------- activations


def residual_blocks(model) -> list[tuple[str, torch.nn.Module]]:
    """The model's blocks (the family's ``layers`` list), whose outputs are the residual stream."""
    from normswap.architectures.registry import family_for_config

    family = family_for_config(model.config)
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    base = base if isinstance(base, torch.nn.Module) else model
    layers = base.get_submodule(family.layers)
    return [(f"{family.layers}.{i}", block) for i, block in enumerate(layers)]


def activation_stats(model, probe: torch.Tensor, precision: str, device) -> tuple[list[str], list, list]:
    """(layer names, RMS per layer, kurtosis per layer) of the residual stream on ``probe``."""
    blocks = residual_blocks(model)
    seen: dict[int, torch.Tensor] = {}

    def hook(i):
        def save(_module, _inputs, output):
            h = output[0] if isinstance(output, (tuple, list)) else output
            seen[i] = h.detach().double()

        return save

    handles = [m.register_forward_hook(hook(i)) for i, (_, m) in enumerate(blocks)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast_for(precision, device):
            model(input_ids=probe.to(device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    rms, kurt = [], []
    for i in range(len(blocks)):
        h = seen.get(i)
        if h is None or not torch.isfinite(h).all():
            rms.append(None)
            kurt.append(None)
            continue
        rms.append(float(h.pow(2).mean().sqrt()))
        c = h - h.mean(-1, keepdim=True)
        var = c.pow(2).mean(-1)
        k = c.pow(4).mean(-1) / var.pow(2)
        k = k[var > 0]
        kurt.append(float(k.mean()) if k.numel() else None)
    return [n for n, _ in blocks], rms, kurt


class _Activations:
    """Each arm's activation record, measured at step 0 and at every evaluation (between steps)."""

    def __init__(self, group, probe, cfg):
        self.group, self.probe, self.cfg = group, probe, cfg
        for arm in group.arms:
            arm.record["activations"] = {"layers": [], "steps": [], "rms": [], "kurtosis": []}
        self.measure(0)

    def measure(self, t: int) -> None:
        for arm in self.group.arms:
            if arm.stopped:
                continue
            layers, rms, kurt = activation_stats(arm.model, self.probe, self.cfg.precision, self.group.dist.device)
            rec = arm.record["activations"]
            rec["layers"] = layers
            rec["steps"].append(t)
            rec["rms"].append(rms)
            rec["kurtosis"].append(kurt)

    def on_step(self, t: int, _arms) -> None:
        every = self.cfg.eval_every
        if t == self.cfg.steps or (every and t % every == 0):
            self.measure(t)


# ---------------------------------------------------------------------------- one run's reading


def heldout_spikes(unit: dict) -> tuple[int, int]:
    """(spikes, intervals): evaluations whose held-out loss rose > HELDOUT_JUMP over the previous one."""
    losses = [e["loss"] for e in unit.get("eval") or []]
    spikes = intervals = 0
    for a, b in zip(losses, losses[1:]):
        if a is None or b is None:
            break
        intervals += 1
        if b > a * (1 + HELDOUT_JUMP):
            spikes += 1
    return spikes, intervals


def diverged(unit: dict) -> str | None:
    """Why the run counts as diverged, or None."""
    if unit.get("nonfinite"):
        nf = unit["nonfinite"]
        return f"{nf['what']} non-finite at step {nf['step']}"
    losses = [e["loss"] for e in unit.get("eval") or []]
    final = unit.get("final_eval_loss")
    if final is None or not losses or losses[0] is None:
        return "no final held-out loss"
    if final >= losses[0]:
        return f"final held-out loss {final:.3f} ≥ step 0's {losses[0]:.3f}"
    best = min(v for v in losses if v is not None)
    if final > best * (1 + DIVERGED_RISE):
        return f"final held-out loss {final:.3f} > {1 + DIVERGED_RISE:g} × its lowest {best:.3f}"
    return None


def growth(unit: dict, what: str) -> list[float | None]:
    act = unit.get("activations") or {}
    rows = act.get(what) or []
    if len(rows) < 2:
        return []
    first, last = rows[0], rows[-1]
    return [(b / a) if a and b is not None else None for a, b in zip(first, last)]


# ---------------------------------------------------------------------------- the sweep


def run_sweep(cfg, arms, *, study, make_group, eval_set, make_stream, main=True, agree=None, echo=None) -> dict:
    """Train every arm at rising rates until it diverges, per seed; return {(arm, seed, m): unit}.
    ``make_group(cfg, arms, seed, multiplier)`` builds the study's trainer group. Finished units already
    in DIR (a resume) are read, not run again. With several processes only process 0 reads DIR, and
    ``agree(flags)`` sends its decisions (which units to run, which arms stay) to the others."""
    agree = agree or (lambda flags: flags)
    every = max(1, cfg.steps // EVALS)
    scfg = dataclasses.replace(cfg, eval_every=every)
    mults = multipliers(cfg.stability_rates)
    probe = eval_set[:PROBE_ROWS]
    units: dict = {}
    for seed in range(cfg.seeds):
        alive = list(arms)
        for m in mults:
            have = {a: study.read_unit(stability_key(a, seed, m)) for a in alive} if main else {}
            done = agree([have.get(a) is not None for a in alive])
            todo = [a for a, d in zip(alive, done) if not d]
            units.update({(a, seed, m): u for a, u in have.items() if u is not None})
            if todo:
                group = make_group(scfg, todo, seed, m)
                acts = _Activations(group, probe, scfg)
                for record in group.run(make_stream(seed), eval_set, on_step=acts.on_step):
                    units[(record["arm"], seed, m)] = record
                    if main:
                        study.write_unit(stability_key(record["arm"], seed, m), record)
                del group
            stable = agree([(a, seed, m) in units and diverged(units[(a, seed, m)]) is None for a in alive])
            alive = [a for a, ok in zip(alive, stable) if ok]
            if echo and main:
                echo(
                    f"normswap study: stability seed {seed + 1} lr ×{m:g}: "
                    + (", ".join(alive) + " stable" if alive else "every arm diverged")
                )
            if not alive:
                break
    return units


# ---------------------------------------------------------------------------- summaries


def _seed_table(units: dict, arm: str, seed: int, mults: list[float]) -> list[str]:
    """Per rate: "stable" / "diverged" (a rate above a divergence: "diverged", by monotonicity) / "" (not run)."""
    out, gone = [], False
    for m in mults:
        u = units.get((arm, seed, m))
        if gone:
            out.append("diverged")
        elif u is None:
            out.append("")
        else:
            gone = diverged(u) is not None
            out.append("diverged" if gone else "stable")
    return out


def _level(table: list[str]) -> tuple[int | None, bool]:
    """(index of the largest stable rate, or -1 when the first diverged; censored: the top rate was stable)."""
    if not table or table[0] == "":
        return None, False
    if "diverged" in table:
        return table.index("diverged") - 1, False
    run = [s for s in table if s]
    return len(run) - 1, True


def summarize(units: dict, arms: list[str], seeds: list[int], cfg) -> dict:
    """``stability[arm]`` for results.json."""
    mults = multipliers(cfg.stability_rates)
    out = {}
    for arm in arms:
        per_seed, censored, n_div, n_runs, sp, iv, train_spikes = [], 0, 0, 0, 0, 0, 0
        rms_g: dict[str, list] = {}
        kurt_g: dict[str, list] = {}
        for seed in seeds:
            table = _seed_table(units, arm, seed, mults)
            level, cens = _level(table)
            censored += cens
            per_seed.append(None if level is None else (0.0 if level < 0 else cfg.lr * mults[level]))
            for m, state in zip(mults, table):
                u = units.get((arm, seed, m))
                if not state:
                    continue
                n_runs += 1
                n_div += state == "diverged"
                if u is not None and state == "stable":
                    s, i = heldout_spikes(u)
                    sp, iv = sp + s, iv + i
                    train_spikes += len(u.get("spikes") or [])
                    rms_g.setdefault(f"{m:g}", []).append(growth(u, "rms"))
                    kurt_g.setdefault(f"{m:g}", []).append(growth(u, "kurtosis"))
        layers = next(
            (
                u["activations"]["layers"]
                for (a, _, _), u in units.items()
                if a == arm and (u.get("activations") or {}).get("layers")
            ),
            [],
        )
        known = [v for v in per_seed if v is not None]
        out[arm] = {
            "largest_stable_lr": min(known) if known and len(known) == len(per_seed) else None,
            "largest_stable_lr_per_seed": per_seed,
            "censored_seeds": censored,
            "rates": [cfg.lr * m for m in mults],
            "runs": n_runs,
            "diverged_runs": n_div,
            "divergence_rate": n_div / n_runs if n_runs else None,
            "heldout_spikes": sp,
            "heldout_intervals": iv,
            "heldout_spike_rate": sp / iv if iv else None,
            "training_spikes": train_spikes,
            "activation_layers": layers,
            "activation_rms_growth": {m: _mean_cols(v) for m, v in rms_g.items()},
            "activation_kurtosis_growth": {m: _mean_cols(v) for m, v in kurt_g.items()},
            "per_seed": {
                str(seed): {
                    f"{m:g}": {
                        "state": state,
                        "why": diverged(units[(arm, seed, m)]) if (arm, seed, m) in units else None,
                        "final_eval_loss": (units.get((arm, seed, m)) or {}).get("final_eval_loss"),
                        "heldout_spikes": heldout_spikes(units[(arm, seed, m)])[0] if (arm, seed, m) in units else None,
                    }
                    for m, state in zip(mults, _seed_table(units, arm, seed, mults))
                    if state
                }
                for seed in seeds
            },
        }
    return out


def _mean_cols(rows: list[list]) -> list[float | None]:
    if not rows:
        return []
    cols = []
    for j in range(max(len(r) for r in rows)):
        vals = [r[j] for r in rows if j < len(r) and r[j] is not None and math.isfinite(r[j])]
        cols.append(statistics.fmean(vals) if vals else None)
    return cols


def compare(units: dict, arm: str, base: str, seeds: list[int], cfg) -> dict:
    """Paired by seed, ``arm`` against ``base``: largest stable rate (in sweep steps; a censored side gives
    a bound, both censored: no number), diverged runs and held-out spike rate over the rates run by both."""
    mults = multipliers(cfg.stability_rates)
    levels, divs, spikes = {}, {}, {}
    for seed in seeds:
        ta, tb = _seed_table(units, arm, seed, mults), _seed_table(units, base, seed, mults)
        (la, ca), (lb, cb) = _level(ta), _level(tb)
        levels[seed] = None if la is None or lb is None or (ca and cb) else la - lb
        both = [i for i in range(len(mults)) if ta[i] and tb[i]]
        divs[seed] = sum(ta[i] == "diverged" for i in both) - sum(tb[i] == "diverged" for i in both)
        stable = [mults[i] for i in both if ta[i] == tb[i] == "stable"]

        def rate(a, seed=seed, stable=stable):
            s = [heldout_spikes(units[(a, seed, m)]) for m in stable]
            n = sum(i for _, i in s)
            return sum(k for k, _ in s) / n if n else None

        ra, rb = rate(arm), rate(base)
        spikes[seed] = None if ra is None or rb is None else ra - rb
    return {
        "seeds": list(seeds),
        "rate_factor": RATE_FACTOR,
        "largest_stable_steps_difference": t_interval(list(levels.values()), exact=True),
        "diverged_runs_difference": t_interval(list(divs.values()), exact=True),
        "heldout_spike_rate_difference": t_interval(list(spikes.values()), exact=True),
    }


# ---------------------------------------------------------------------------- the claim


def _deciding(cmp: dict) -> tuple[str, dict | None]:
    """The number that decides (``DECIDING``): the largest stable rate when every seed has one, else
    the held-out spike rate."""
    (first, name), (fallback, fallback_name) = DECIDING.items()
    iv = cmp[first]
    if iv and not iv.get("missing") and len(iv["values"]) == len(cmp["seeds"]):
        return name, iv
    return fallback_name, cmp[fallback]


def judge(cmp: dict | None, precision: str, norm_dtypes: list[str] | None = None) -> tuple[str, str, float | None]:
    """The verdict of "better low-precision stability" for one arm, from its sweep comparison, with the
    deciding test's p-value (None when no test decided)."""
    if cmp is None:
        return (
            NOT_MEASURABLE,
            "needs --stability (learning rates rising until divergence) with --precision bf16 or fp16",
            None,
        )
    lv, dv, sp = (
        cmp["largest_stable_steps_difference"],
        cmp["diverged_runs_difference"],
        cmp["heldout_spike_rate_difference"],
    )
    text = (
        f"stability sweep in {precision}, RMSNorm − LayerNorm paired by seed: largest stable rate "
        f"{fmt_t_interval(lv, '+.2f')} steps of ×{cmp['rate_factor']:g}, diverged runs {fmt_t_interval(dv, '+.2f')}, "
        f"held-out spike rate {fmt_t_interval(sp, '+.3f')}"
    )
    if precision == "fp32":
        return (
            NOT_MEASURABLE,
            "the study trained in fp32: low-precision stability is not measurable here "
            "(needs --precision bf16|fp16); " + text,
            None,
        )
    low = [d for d in (norm_dtypes or []) if d in ("float32", "torch.float32")]
    if low:
        return NOT_MEASURABLE, f"the norms computed in float32 under --precision {precision}: " + text, None
    name, iv = _deciding(cmp)
    if iv is None:
        why = ": the sweep did not reach divergence in both arms (raise --stability-rates)"
        return NOT_MEASURABLE, text + why, None
    if iv["n"] < MIN_SEEDS:
        return NOT_MEASURABLE, f"needs ≥ {MIN_SEEDS} seeds with a number for an interval; " + text, None
    p = iv.get("p_value")
    decided = f"; decided by the {name} (t-test and exact sign-flip test, p = {p:.3g})"
    # the spike rate is a rate of trouble (lower is better); the stable rate is headroom (higher is better)
    better, worse = ("higher", "lower") if name == "largest stable rate" else ("lower", "higher")
    if iv["verdict"] == worse:
        return NOT_REPRODUCED, text + decided + ": RMSNorm measurably less stable", p
    if iv["verdict"] == better:
        return REPRODUCED, text + decided, p
    if iv["low"] == iv["high"] == 0 and iv.get("p_sign_flip", 0) >= 1:
        return (
            NOT_REPRODUCED,
            text + f": the same {name} in every seed (to a factor {RATE_FACTOR:g}); no seed favours RMSNorm",
            None,
        )
    flip = iv.get("p_sign_flip")
    if flip is not None and flip > 1 - iv["level"] and len(set(iv["values"])) == 1:
        return (
            NOT_MEASURABLE,
            text
            + (
                f": the {name} differs the same way in all {iv['n']} seeds, but {iv['n']} agreeing seeds give "
                f"p = {flip:.3g} at best (exact sign-flip test): more seeds (≥ 6) could decide it"
            ),
            None,
        )
    return NOT_MEASURABLE, text + f": the {name}'s interval includes no difference (p = {p:.3g})", None


def sweep_record(units: dict, arms: list[str], seeds: list[int], cfg, base: str) -> dict:
    """results.json's ``stability_sweep``: how the sweep ran and each arm's paired comparison with ``base``."""
    dtypes: dict[str, list[str]] = {}
    for (a, _, _), u in units.items():
        d = u.get("norm_compute_dtype")
        if d and d not in dtypes.setdefault(a, []):
            dtypes[a].append(d)
    return {
        "precision": cfg.precision,
        "rates": [cfg.lr * m for m in multipliers(cfg.stability_rates)],
        "rate_factor": RATE_FACTOR,
        "steps": cfg.steps,
        "evaluations_per_run": EVALS,
        "diverged_rule": (
            f"loss non-finite, or final held-out loss ≥ step 0's, or > {1 + DIVERGED_RISE:g} × the run's lowest; "
            "a rate above a diverged one counts as diverged (not run)"
        ),
        "heldout_spike_rule": f"held-out loss > {1 + HELDOUT_JUMP:g} × the previous evaluation's",
        "activation_rule": (
            f"residual stream after each block on {PROBE_ROWS} held-out rows, eval mode, between steps: "
            "RMS, and per-token kurtosis over the hidden features averaged over tokens; growth = last ÷ step 0"
        ),
        "norm_compute_dtypes": dtypes,
        "comparisons": {a: compare(units, a, base, seeds, cfg) for a in arms if a != base},
    }
