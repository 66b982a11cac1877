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


def interval(values, *, null: float = 0.0, level: float = LEVEL, exact: bool = False) -> dict | None:
    """``{mean, low, high, n, values, verdict, level, p_value}`` of per-seed values, or None with none.
    ``verdict``: ``higher`` / ``lower`` than ``null`` when the interval excludes it, else no measurable
    difference; ``p_value``: the two-sided t-test's.

    ``exact`` (for counts and other coarse outcomes, where seeds often tie and a t-interval of n
    identical values has zero width): the verdict also needs the exact sign-flip test
    (``sign_flip_p``, recorded as ``p_sign_flip``) at the same level, and ``p_value`` is the larger of
    the two. Its smallest p-value with n seeds is 2/2ⁿ, so such a difference decides from 6 seeds on,
    whatever the t-interval says."""
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
            "p_value": None,
        }
    sd = statistics.stdev(vals)
    half = t_quantile(n - 1, level) * sd / math.sqrt(n)
    low, high = mean - half, mean + half
    if sd > 0:
        p = min(1.0, 2 * _t_sf(abs(mean - null) / (sd / math.sqrt(n)), n - 1))
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


def sign_flip_p(diffs: list[float], *, draws: int = 20_000) -> float:
    """The exact two-sided sign-flip (randomization) test of paired differences against 0: the share
    of the 2ⁿ sign assignments whose |mean| is at least the observed one. Under "no difference" each
    seed's difference is as likely negated, whatever its distribution, so ties and coarse counts need
    no normality; enumerated up to 16 seeds, sampled (fixed seed) above."""
    import itertools
    import random

    n = len(diffs)
    if n == 0:
        return 1.0
    observed = abs(sum(diffs)) - 1e-12 * (1 + sum(abs(d) for d in diffs))
    if n <= 16:
        signs = itertools.product((1, -1), repeat=n)
        hits = sum(abs(sum(s * d for s, d in zip(ss, diffs))) >= observed for ss in signs)
        return hits / 2**n
    rng = random.Random(0)
    hits = sum(abs(sum(d if rng.random() < 0.5 else -d for d in diffs)) >= observed for _ in range(draws))
    return (hits + 1) / (draws + 1)


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


def paired(arm: dict, base: dict, *, ratio: bool = False, level: float = LEVEL, exact: bool = False) -> dict | None:
    """Interval of arm[seed] − base[seed] (or arm/base with ``ratio``) over the seeds both have."""
    seeds = sorted(set(arm) & set(base))
    vals = []
    for s in seeds:
        a, b = arm[s], base[s]
        if a is None or b is None or (ratio and not b):
            vals.append(None)
        else:
            vals.append(a / b if ratio else a - b)
    iv = interval(vals, null=1.0 if ratio else 0.0, level=level, exact=exact)
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
