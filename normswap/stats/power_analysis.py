"""The power of the equivalence test (equivalence.tost): what n paired differences can decide.

Equivalence within ±δ is found when the whole 90 % interval of the paired differences,
mean ± t(0.95, n−1)·σ/√n, lies inside ±δ (two one-sided tests at α = 0.05 each). With a true
difference of 0 and the mean's sampling error σ/√n, that happens with probability

    power(n, σ) ≈ 2·Φ(√n·δ/σ − t(0.95, n−1)) − 1,

so n seeds decide "equivalent" with 80 % power while σ ≤ σ_max(n) = √n·δ / (t(0.95, n−1) + z(0.90)).
The opposite finding needs the interval wholly past the margin: a true difference D is found
"different" (beyond δ) with 80 % power once D ≥ δ + (t(0.95, n−1) + t(0.80, n−1))·σ/√n; and a
difference from 0 (the 95 % interval excluding it) is detected with 80 % power from
(t(0.975, n−1) + t(0.80, n−1))·σ/√n — the minimal detectable difference.
"""

from __future__ import annotations

import math

from normswap.stats.levels import ALPHA, POWER
from normswap.stats.quantiles import normal_cdf, normal_quantile, t_quantile

MAX_SEEDS_SEARCHED = 1000


def equivalence_half_width(n: int, sd: float) -> float:
    """The 90 % interval's half-width t(1 − α, n−1)·sd/√n that TOST reads."""
    return t_quantile(1 - ALPHA, n - 1) * sd / math.sqrt(n)


def equivalence_power(n: int, sd: float, margin: float, true_difference: float = 0.0) -> float:
    """P(the 90 % interval lies within ±margin) for n seeds, paired sd ``sd`` (normal approximation
    of the mean; the t quantile for the interval's width)."""
    if n < 2:
        return 0.0
    if sd <= 0:
        return 1.0 if abs(true_difference) < margin else 0.0
    se = sd / math.sqrt(n)
    half = t_quantile(1 - ALPHA, n - 1) * se
    if half >= margin:
        return 0.0
    lo, hi = -margin + half, margin - half  # where the mean must land
    return max(0.0, normal_cdf((hi - true_difference) / se) - normal_cdf((lo - true_difference) / se))


def sd_max(n: int, margin: float) -> float | None:
    """The largest paired sd at which n seeds decide "equivalent" with 80 % power (true difference 0)."""
    if n < 2:
        return None
    return math.sqrt(n) * margin / (t_quantile(1 - ALPHA, n - 1) + normal_quantile(1 - (1 - POWER) / 2))


def detectable(n: int, sd: float) -> dict:
    """What n seeds at paired sd ``sd`` detect with 80 % power: a difference from 0, and how far past
    the margin a difference must lie to be found beyond it."""
    se = sd / math.sqrt(n)
    return {
        "difference_from_zero": (t_quantile(1 - ALPHA / 2, n - 1) + t_quantile(POWER, n - 1)) * se,
        "beyond_margin_by": (t_quantile(1 - ALPHA, n - 1) + t_quantile(POWER, n - 1)) * se,
    }


def seeds_needed(sd: float, margin: float, mean: float = 0.0) -> int | None:
    """The fewest seeds whose equivalence power reaches 80 % at this sd and true difference ``mean``
    (None when no number of seeds up to MAX_SEEDS_SEARCHED does: the difference is past the margin)."""
    for n in range(2, MAX_SEEDS_SEARCHED + 1):
        if equivalence_power(n, sd, margin, mean) >= POWER:
            return n
    return None
