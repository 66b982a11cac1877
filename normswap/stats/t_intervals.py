"""Student's t intervals of per-seed values and of paired-by-seed differences.

Every arm of a study's seed shares that seed's initialisation and data, so the arm's number minus
the baseline's number *of the same seed* is one paired difference; the seed-to-seed spread cancels
in it. Over n seeds, the interval is mean ± t(0.975, n−1)·sd/√n. "No measurable difference" when
the interval contains the null value — or when it cannot be formed (one seed, or a seed where one
side has no number). Ratios (throughput) are intervals of the per-seed ratio, compared with 1.
"""

from __future__ import annotations

import math
import statistics

from normswap.stats.levels import LEVEL
from normswap.stats.quantiles import t_upper_tail, two_sided_t_quantile
from normswap.stats.sign_flip import sign_flip_p
from normswap.stats.verdicts import NO_DIFFERENCE

PAIRED_BY_SEED_METHOD = (
    "paired by seed: mean ± t(0.975, n−1)·sd/√n over the seeds' differences (95 %); a difference needs the "
    "interval to exclude 0. Equivalence: TOST, the whole 90 % interval within ±margin. The claims' tests are "
    "adjusted together with Holm's step-down method (family-wise α = 0.05)"
)


def _finite(values) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def t_interval(values, *, null: float = 0.0, level: float = LEVEL, exact: bool = False) -> dict | None:
    """``{mean, low, high, n, values, verdict, level, p_value}`` of ``values``: mean ± t·sd/√n, or None
    with no finite value. ``verdict``: ``higher`` / ``lower`` than ``null`` when the interval excludes
    it, else no measurable difference; ``p_value``: the two-sided one-sample t-test's against ``null``.

    ``exact`` (for counts and other coarse outcomes, where seeds often tie and a t-interval of n
    identical values has zero width): the verdict also needs the exact sign-flip test
    (``sign_flip_p``, recorded as ``p_sign_flip``) at the same level, and ``p_value`` is the larger of
    the two. Its smallest p-value with n seeds is 2/2ⁿ, so such a difference decides from 6 seeds on,
    whatever the t-interval says."""
    vals = _finite(values)
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
            "p_value": None,
        }
    sd = statistics.stdev(vals)
    half = two_sided_t_quantile(n - 1, level) * sd / math.sqrt(n)
    low, high = mean - half, mean + half
    if sd > 0:
        p = min(1.0, 2 * t_upper_tail(abs(mean - null) / (sd / math.sqrt(n)), n - 1))
    else:
        p = 1.0 if mean == null else 0.0
    verdict = NO_DIFFERENCE if low <= null <= high else ("higher" if low > null else "lower")
    out = {"mean": mean, "low": low, "high": high, "n": n, "values": vals, "verdict": verdict, "level": level}
    if exact:
        out["p_sign_flip"] = sign_flip_p([v - null for v in vals])
        p = max(p, out["p_sign_flip"])
        if out["p_sign_flip"] > 1 - level:
            out["verdict"] = NO_DIFFERENCE
    out["p_value"] = p
    return out


def standard_error(values) -> float | None:
    """sd/√n of the finite values (None with fewer than two)."""
    vals = _finite(values)
    return statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) >= 2 else None


def paired_t_interval(
    arm: dict, base: dict, *, ratio: bool = False, level: float = LEVEL, exact: bool = False
) -> dict | None:
    """:func:`t_interval` of arm[seed] − base[seed] (or arm/base with ``ratio``, against 1) over the
    seeds both have; ``missing``: the seeds where one side has no number."""
    seeds = sorted(set(arm) & set(base))
    vals = []
    for s in seeds:
        a, b = arm[s], base[s]
        if a is None or b is None or (ratio and not b):
            vals.append(None)
        else:
            vals.append(a / b if ratio else a - b)
    iv = t_interval(vals, null=1.0 if ratio else 0.0, level=level, exact=exact)
    if iv is not None and len(iv["values"]) < len(seeds):
        iv["missing"] = len(seeds) - len(iv["values"])
    return iv


def fmt_t_interval(iv: dict | None, spec: str = ".4f", scale: float = 1.0, unit: str = "") -> str:
    """``+0.0123 [−0.0040, +0.0286]`` (or the mean alone with one seed; the level said when not 95 %)."""
    if not iv:
        return "n/a"
    m = format(iv["mean"] * scale, spec) + unit
    if iv["low"] is None:
        return f"{m} (one seed: no interval)"
    level = f"{iv['level']:.0%} " if iv.get("level", LEVEL) != LEVEL else ""
    return f"{m} [{level}{format(iv['low'] * scale, spec)}, {format(iv['high'] * scale, spec)}]{unit}"
