"""Paired-by-seed differences with 95 % t-intervals, and the verdict they allow.

Every arm of a seed shares that seed's initialisation and data, so the arm's number minus the
baseline's number *of the same seed* is one paired difference; the seed-to-seed spread cancels in
it. Over n seeds, the interval is mean ± t(0.975, n−1)·sd/√n (Student's t). "No measurable
difference" when the interval contains 0 — or when it cannot be formed (one seed, or a seed where
one side has no number). Ratios (throughput) are intervals of the per-seed ratio, compared with 1.

This is the study's counterpart of normswap/evaluate/stats.py (min–max of interleaved repeats),
whose wording it shares: a difference is only called one when the interval excludes "no change".
"""

from __future__ import annotations

import math
import statistics

from normswap.evaluate.stats import NO_DIFFERENCE

LEVEL = 0.95
METHOD = (
    "paired by seed: mean ± t(0.975, n−1)·sd/√n over the seeds' differences; "
    "a difference needs the interval to exclude 0"
)


def t_quantile(df: int) -> float:
    from scipy.stats import t

    return float(t.ppf(0.5 + LEVEL / 2, df))


def interval(values, *, null: float = 0.0) -> dict | None:
    """``{mean, low, high, n, values, verdict}`` of per-seed values, or None with none. ``verdict``:
    ``higher`` / ``lower`` than ``null`` when the interval excludes it, else no measurable difference."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    n, mean = len(vals), statistics.fmean(vals)
    if n < 2:
        return {"mean": mean, "low": None, "high": None, "n": n, "values": vals, "verdict": NO_DIFFERENCE}
    half = t_quantile(n - 1) * statistics.stdev(vals) / math.sqrt(n)
    low, high = mean - half, mean + half
    verdict = NO_DIFFERENCE if low <= null <= high else ("higher" if low > null else "lower")
    return {"mean": mean, "low": low, "high": high, "n": n, "values": vals, "verdict": verdict}


def paired(arm: dict, base: dict, *, ratio: bool = False) -> dict | None:
    """Interval of arm[seed] − base[seed] (or arm/base with ``ratio``) over the seeds both have."""
    seeds = sorted(set(arm) & set(base))
    vals = []
    for s in seeds:
        a, b = arm[s], base[s]
        if a is None or b is None or (ratio and not b):
            vals.append(None)
        else:
            vals.append(a / b if ratio else a - b)
    iv = interval(vals, null=1.0 if ratio else 0.0)
    if iv is not None and len(iv["values"]) < len(seeds):
        iv["missing"] = len(seeds) - len(iv["values"])
    return iv


def measurable(iv: dict | None) -> bool:
    return bool(iv) and iv["verdict"] != NO_DIFFERENCE


def fmt(iv: dict | None, spec: str = ".4f", scale: float = 1.0, unit: str = "") -> str:
    """``+0.0123 [−0.0040, +0.0286]`` (or the mean alone with one seed)."""
    if not iv:
        return "n/a"
    m = format(iv["mean"] * scale, spec) + unit
    if iv["low"] is None:
        return f"{m} (one seed: no interval)"
    return f"{m} [{format(iv['low'] * scale, spec)}, {format(iv['high'] * scale, spec)}]{unit}"
