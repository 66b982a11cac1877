"""Paired-by-seed differences with t-intervals, the equivalence test, and Holm's adjustment.

Every arm of a seed shares that seed's initialisation and data, so the arm's number minus the
baseline's number *of the same seed* is one paired difference; the seed-to-seed spread cancels in
it. Over n seeds, the interval is mean ± t(0.975, n−1)·sd/√n (Student's t). "No measurable
difference" when the interval contains 0 — or when it cannot be formed (one seed, or a seed where
one side has no number). Ratios (throughput) are intervals of the per-seed ratio, compared with 1.

This is the study's counterpart of normswap/evaluate/stats.py (min–max of interleaved repeats),
whose wording it shares: a difference is only called one when the interval excludes "no change".

Equivalence (``tost``): two one-sided t-tests against ±margin (Schuirmann's TOST). At level α the
two are rejected together exactly when the whole (1 − 2α) interval — 90 % for α = 0.05 — lies
within ±margin; the opposite finding, a difference beyond the margin, is the one-sided test that
the whole 90 % interval lies past +margin (or −margin). Each gives a p-value, so a study's several
verdicts can be adjusted together (``holm``: Holm's step-down over the family of tests; a verdict
stands only when its adjusted p-value is below α).
"""

from __future__ import annotations

import math
import statistics

from normswap.evaluate.stats import NO_DIFFERENCE

LEVEL = 0.95
METHOD = (
    "paired by seed: mean ± t(0.975, n−1)·sd/√n over the seeds' differences (95 %); a difference needs the "
    "interval to exclude 0. Equivalence: TOST, the whole 90 % interval within ±margin. The claims' tests are "
    "adjusted together with Holm's step-down method (family-wise α = 0.05)"
)


ALPHA = 0.05  # each test's level, and the family's under Holm
EQUIVALENCE_LEVEL = 1 - 2 * ALPHA  # the interval TOST reads: 90 %


def t_quantile(df: int, level: float = LEVEL) -> float:
    from scipy.stats import t

    return float(t.ppf(0.5 + level / 2, df))


def _t_sf(x: float, df: int) -> float:
    """P(T > x) for Student's t with ``df`` degrees of freedom."""
    from scipy.stats import t

    return float(t.sf(x, df))


def interval(values, *, null: float = 0.0, level: float = LEVEL) -> dict | None:
    """``{mean, low, high, n, values, verdict, level}`` of per-seed values, or None with none. ``verdict``:
    ``higher`` / ``lower`` than ``null`` when the interval excludes it, else no measurable difference."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    n, mean = len(vals), statistics.fmean(vals)
    if n < 2:
        return {
            "mean": mean,
            "low": None,
            "high": None,
            "n": n,
            "values": vals,
            "verdict": NO_DIFFERENCE,
            "level": level,
        }
    half = t_quantile(n - 1, level) * statistics.stdev(vals) / math.sqrt(n)
    low, high = mean - half, mean + half
    verdict = NO_DIFFERENCE if low <= null <= high else ("higher" if low > null else "lower")
    return {"mean": mean, "low": low, "high": high, "n": n, "values": vals, "verdict": verdict, "level": level}


def standard_error(values) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) >= 2 else None


def tost(values, margin: float) -> dict | None:
    """Equivalence of the paired differences ``values`` to 0 within ±``margin``, and the opposite.

    ``{interval (90 %), margin, p_equivalent, p_beyond, finding}``: ``p_equivalent`` is TOST's
    p-value (the larger of the two one-sided tests: mean > −margin and mean < +margin);
    ``p_beyond`` the one-sided p-value that the difference lies past the margin on the side of the
    mean; ``finding`` is ``equivalent`` (whole 90 % interval within ±margin), ``beyond margin``
    (whole interval outside it) or ``undecided``. None without two values."""
    iv = interval(values, level=EQUIVALENCE_LEVEL)
    if iv is None or iv["n"] < 2:
        return None
    n, mean, sd = iv["n"], iv["mean"], statistics.stdev(iv["values"])
    df = n - 1
    if sd == 0:  # identical differences: the interval is the point
        inside = abs(mean) < margin
        p_eq, p_beyond = (0.0, 1.0) if inside else (1.0, 0.0 if abs(mean) > margin else 1.0)
    else:
        se = sd / math.sqrt(n)
        p_eq = max(_t_sf((mean + margin) / se, df), _t_sf((margin - mean) / se, df))
        p_beyond = _t_sf((abs(mean) - margin) / se, df)
    if -margin < iv["low"] and iv["high"] < margin:
        finding = "equivalent"
    elif iv["low"] > margin or iv["high"] < -margin:
        finding = "beyond margin"
    else:
        finding = "undecided"
    return {"interval": iv, "margin": margin, "p_equivalent": p_eq, "p_beyond": p_beyond, "finding": finding}


def holm(p_values: list[float | None], alpha: float = ALPHA) -> list[float | None]:
    """Holm's step-down adjusted p-values (None stays None: not a test of the family).

    Sorted ascending, p₍ᵢ₎ becomes max over j ≤ i of min(1, (m − j + 1)·p₍ⱼ₎) with m the family's
    size; rejecting where the adjusted value is ≤ α controls the chance of any false verdict at α."""
    tested = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    m = len(tested)
    out: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def paired(arm: dict, base: dict, *, ratio: bool = False, level: float = LEVEL) -> dict | None:
    """Interval of arm[seed] − base[seed] (or arm/base with ``ratio``) over the seeds both have."""
    seeds = sorted(set(arm) & set(base))
    vals = []
    for s in seeds:
        a, b = arm[s], base[s]
        if a is None or b is None or (ratio and not b):
            vals.append(None)
        else:
            vals.append(a / b if ratio else a - b)
    iv = interval(vals, null=1.0 if ratio else 0.0, level=level)
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
    level = f"{iv['level']:.0%} " if iv.get("level", LEVEL) != LEVEL else ""
    return f"{m} [{level}{format(iv['low'] * scale, spec)}, {format(iv['high'] * scale, spec)}]{unit}"
