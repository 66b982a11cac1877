"""From the finished units to results.json's numbers: per-unit summaries and paired comparisons.

Final quality: a unit's ``final_eval_loss`` is the mean of its final evaluations (interleaved.py). A
seed where an arm diverged keeps its place as an outcome: its final quality is the uniform
distribution's loss ln V (what a model that has learned nothing scores), so the paired difference
of that seed shows the divergence instead of vanishing from the interval; ``diverged`` counts them.

Throughput: only a unit's timed steps count (measure.StepPlan: not step 1, not the memory step,
not the profiled steps); within a seed, step t of an arm and step t of the baseline ran back to
back, so their time quotient is one paired sample, and the seed's throughput ratio is the median
of those quotients (a step the machine interrupted moves one sample, not the mean). The interval
over the seeds and steps, the Amdahl bound and the verdict's gating are study/judging/speed.py's.
Schema: docs/study-schema.md.
"""

from __future__ import annotations

import math
import statistics

from normswap.stats.equivalence import tost
from normswap.stats.t_intervals import paired_t_interval, standard_error, t_interval
from normswap.study.judging import speed

timed_seconds = speed.timed_seconds


def instabilities(unit: dict) -> int:
    return (1 if unit.get("nonfinite") else 0) + len(unit.get("spikes") or []) + len(unit.get("skipped_steps") or [])


def summarize_unit(unit: dict, tokens_per_step: int) -> dict:
    """results.json's row of one unit: its curves and measurements (the per-layer norm-input
    gradient norms reduced to their first-step, last-step and mean values)."""
    secs = timed_seconds(unit)
    per_step = unit["norm_input_grad_norm"]["per_step"]
    layers = unit["norm_input_grad_norm"]["layers"]

    def col(i):
        return [row[i] for row in per_step if row[i] is not None]

    norm_grads = {
        name: {
            "first": (col(i) or [None])[0],
            "last": (col(i) or [None])[-1],
            "mean": statistics.fmean(col(i)) if col(i) else None,
        }
        for i, name in enumerate(layers)
    }
    return {
        "arm": unit["arm"],
        "seed": unit["seed"],
        "lr_multiplier": unit["lr_multiplier"],
        "arm_lr_multiplier": unit.get("arm_lr_multiplier", 1.0),
        "warmup": unit.get("warmup"),
        "lr": unit["lr"],
        "data_seed": unit.get("data_seed", unit["seed"]),
        "status": unit["status"],
        "steps_done": unit["steps_done"],
        "final_eval_loss": unit["final_eval_loss"],
        "final_evals": unit.get("final_evals", []),
        "last_eval_loss": unit.get("last_eval_loss"),
        "lm_eval": unit.get("lm_eval"),
        "eval": unit["eval"],
        "loss": unit["loss"],
        "grad_norm": unit["grad_norm"],
        "grad_scale_start": unit["grad_scale_start"],
        "norm_input_grad_norm": norm_grads,
        "nonfinite": unit["nonfinite"],
        "spikes": unit["spikes"],
        "skipped_steps": unit["skipped_steps"],
        "instabilities": instabilities(unit),
        "memory": unit["memory"],
        "norm_kernel": unit.get("norm_kernel"),
        "norm_kernel_fused": unit.get("norm_kernel_fused"),
        "norm_compute_dtype": unit.get("norm_compute_dtype"),
        "timing": {
            "tokens_per_second": tokens_per_step / statistics.median(secs) if secs else None,
            "median_step_seconds": statistics.median(secs) if secs else None,
            "timed_steps": len(secs),
            "norm_share": unit["norm_share"],
            "load_average": unit.get("load"),
        },
    }


def _per_seed(units: dict, arm: str, mult: float, fn) -> dict[int, float | None]:
    return {seed: fn(u) for (a, seed, m), u in units.items() if a == arm and m == mult}


def throughput_ratio(unit: dict, base: dict) -> float | None:
    """Median over the common timed steps of base_time / unit_time (> 1: the arm is faster)."""
    q = speed.step_quotients(unit, base)
    return statistics.median(q) if q else None


def final_quality(unit: dict, diverged_loss: float | None) -> float | None:
    """A unit's final quality: its final held-out loss, or ``diverged_loss`` when it diverged."""
    if unit.get("nonfinite") or unit.get("status") == "diverged":
        return diverged_loss
    return unit["final_eval_loss"]


def heldout_standard_error(mine: dict, theirs: dict, seeds: list) -> float | None:
    """The held-out sampling error of the mean paired difference: per seed, the spread of the
    per-block differences (arm − base on the same block) over √blocks; over the seeds, the root
    of the summed squares over n. How much of the difference the choice of held-out blocks
    alone could move."""
    per_seed = []
    for s in seeds:
        a, b = mine[s].get("final_eval_blocks"), theirs[s].get("final_eval_blocks")
        if not a or not b or len(a) != len(b) or len(a) < 2:
            continue
        d = [x - y for x, y in zip(a, b)]
        per_seed.append(statistics.stdev(d) / math.sqrt(len(d)))
    if not per_seed:
        return None
    return math.sqrt(sum(v * v for v in per_seed)) / len(per_seed)


def compare(
    units: dict, arm: str, base: str, mult: float, *, margin: float = 0.02, diverged_loss: float | None = None
) -> dict:
    """The paired intervals of ``arm`` against ``base`` at multiplier ``mult``."""
    mine = {seed: u for (a, seed, m), u in units.items() if a == arm and m == mult}
    theirs = {seed: u for (a, seed, m), u in units.items() if a == base and m == mult}
    seeds = sorted(set(mine) & set(theirs))

    def get(fn):
        return {s: fn(mine[s]) for s in seeds}, {s: fn(theirs[s]) for s in seeds}

    loss_a, loss_b = get(lambda u: final_quality(u, diverged_loss))
    diffs = [loss_a[s] - loss_b[s] if loss_a[s] is not None and loss_b[s] is not None else None for s in seeds]
    rel = {s: (loss_a[s] / loss_b[s] - 1) if loss_a[s] is not None and loss_b[s] else None for s in seeds}
    tput = {s: throughput_ratio(mine[s], theirs[s]) for s in seeds}
    mem_a, mem_b = get(lambda u: (u["memory"] or {}).get("peak_bytes"))
    inst_a, inst_b = get(instabilities)
    share_a, share_b = get(lambda u: (u["norm_share"] or {}).get("share"))
    return {
        "seeds": seeds,
        "final_eval_loss_difference": paired_t_interval(loss_a, loss_b),
        "final_eval_loss_equivalence": tost(diffs, margin),
        "final_eval_loss_relative": t_interval(list(rel.values())),
        # over the seeds that finished (a diverged seed has no loss of its own): what the bigram gate reads
        "final_eval_loss_means": {
            "arm": _mean([mine[s]["final_eval_loss"] for s in seeds]),
            "baseline": _mean([theirs[s]["final_eval_loss"] for s in seeds]),
        },
        "seed_standard_error": standard_error(diffs),
        "heldout_standard_error": heldout_standard_error(mine, theirs, seeds),
        "throughput_ratio": t_interval(list(tput.values()), null=1.0),
        # bootstrap over the timed steps, blocked by seed (study/judging/speed.py)
        "throughput_ratio_bootstrap": speed.bootstrap_ratio(
            {s: speed.step_quotients(mine[s], theirs[s]) for s in seeds}
        ),
        "cost_at_equal_tokens": t_interval([1 / v if v else None for v in tput.values()], null=1.0),
        "peak_memory_ratio": paired_t_interval(mem_a, mem_b, ratio=True),
        "peak_memory_difference_bytes": paired_t_interval(mem_a, mem_b),
        "instabilities_difference": paired_t_interval(inst_a, inst_b, exact=True),  # counts: seeds tie
        "norm_share_difference": paired_t_interval(share_a, share_b),
        "diverged": {
            "arm": sum(1 for s in seeds if mine[s]["nonfinite"]),
            "baseline": sum(1 for s in seeds if theirs[s]["nonfinite"]),
        },
    }


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def _metrics(scores: dict) -> dict[str, float]:
    """{"task metric": value} of one unit's lm-eval scores (numbers only, no standard errors)."""
    return {
        f"{task} {metric}": float(v)
        for task, row in (scores or {}).items()
        for metric, v in (row or {}).items()
        if isinstance(v, (int, float)) and not metric.endswith("_stderr")
    }


def lm_eval_table(units: dict, arms: list[str], mult: float, base: str = "layernorm") -> dict | None:
    """{arm: {seed, scores (the first seed's), per_seed: {seed: scores}, differences}} of every seed's
    final models (None when lm-eval did not run). ``differences``: each metric's arm − base, paired by
    seed with a 95 % t-interval, as the held-out loss is."""
    table = {}
    for arm in arms:
        scored = sorted(
            (seed, u["lm_eval"]) for (a, seed, m), u in units.items() if a == arm and m == mult and u.get("lm_eval")
        )
        if scored:
            table[arm] = {"seed": scored[0][0], "scores": scored[0][1], "per_seed": {str(s): v for s, v in scored}}
    if base in table:
        base_metrics = {int(s): _metrics(v) for s, v in table[base]["per_seed"].items()}
        for arm, row in table.items():
            if arm == base:
                continue
            mine = {int(s): _metrics(v) for s, v in row["per_seed"].items()}
            names = sorted({k for v in mine.values() for k in v})
            row["differences"] = {
                name: paired_t_interval(
                    {s: v.get(name) for s, v in mine.items()}, {s: v.get(name) for s, v in base_metrics.items()}
                )
                for name in names
            }
    return table or None


def sweep(units: dict, arms: list[str], mults: list[float], base: str) -> dict | None:
    """Each arm's best multiplier (lowest mean final held-out loss; a diverged seed counts as +inf)."""
    if len(mults) < 2:
        return None

    def mean_loss(arm, m):
        vals = [u["final_eval_loss"] for (a, _, mm), u in units.items() if a == arm and mm == m]
        return math.inf if not vals or any(v is None for v in vals) else statistics.fmean(vals)

    table = {
        arm: {f"{m:g}": (None if math.isinf(mean_loss(arm, m)) else mean_loss(arm, m)) for m in mults} for arm in arms
    }
    best = {arm: min(mults, key=lambda m: mean_loss(arm, m)) for arm in arms}

    def vs_best(arm, m):
        return paired_t_interval(
            _per_seed(units, arm, m, lambda u: u["final_eval_loss"]),
            _per_seed(units, arm, best[arm], lambda u: u["final_eval_loss"]),
        )

    return {
        "multipliers": mults,
        "mean_final_eval_loss": table,
        "best_multiplier": {a: best[a] for a in arms},
        # each rate's final held-out loss minus the arm's best rate's, paired by seed
        "vs_best": {a: {f"{m:g}": vs_best(a, m) for m in mults if m != best[a]} for a in arms},
    }
