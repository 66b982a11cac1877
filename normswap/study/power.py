"""The power of the equal-loss test: what a study of n seeds can decide, planned and achieved.

The test (stats.tost): equivalence within ±δ when the whole 90 % interval of the paired
differences, mean ± t(0.95, n−1)·σ/√n, lies inside ±δ (two one-sided tests at α = 0.05 each).
With a true difference of 0 and the mean's sampling error σ/√n, that happens with probability

    power(n, σ) ≈ 2·Φ(√n·δ/σ − t(0.95, n−1)) − 1,

so n seeds decide "equivalent" with 80 % power while σ ≤ σ_max(n) = √n·δ / (t(0.95, n−1) + z(0.90)).
The opposite finding needs the interval wholly past the margin: a true difference D is found
"different" (beyond δ) with 80 % power once D ≥ δ + (t(0.95, n−1) + t(0.80, n−1))·σ/√n; and a
difference from 0 (the 95 % interval excluding it) is detected with 80 % power from
(t(0.975, n−1) + t(0.80, n−1))·σ/√n — the minimal detectable difference.

``plan`` states the design's side (for the seeds the study starts with and the most it may add);
``achieved`` puts the run's measured σ of each arm's paired differences in and says what this run
could detect and how many seeds would decide it (computed, not guessed).
"""

from __future__ import annotations

import math
import statistics

ALPHA = 0.05
POWER = 0.80
MAX_SEEDS_SEARCHED = 1000


def _t(q: float, df: int) -> float:
    from scipy.stats import t

    return float(t.ppf(q, df))


def _z(q: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(q))


def equivalence_power(n: int, sd: float, margin: float, true_difference: float = 0.0) -> float:
    """P(the 90 % interval lies within ±margin) for n seeds, paired sd ``sd`` (normal approximation
    of the mean; the t quantile for the interval's width)."""
    if n < 2:
        return 0.0
    if sd <= 0:
        return 1.0 if abs(true_difference) < margin else 0.0
    from scipy.stats import norm

    se = sd / math.sqrt(n)
    half = _t(1 - ALPHA, n - 1) * se
    if half >= margin:
        return 0.0
    lo, hi = -margin + half, margin - half  # where the mean must land
    return max(0.0, float(norm.cdf((hi - true_difference) / se) - norm.cdf((lo - true_difference) / se)))


def sd_max(n: int, margin: float) -> float | None:
    """The largest paired sd at which n seeds decide "equivalent" with 80 % power (true difference 0)."""
    if n < 2:
        return None
    return math.sqrt(n) * margin / (_t(1 - ALPHA, n - 1) + _z(1 - (1 - POWER) / 2))


def detectable(n: int, sd: float) -> dict:
    """What n seeds at paired sd ``sd`` detect with 80 % power."""
    se = sd / math.sqrt(n)
    return {
        "difference_from_zero": (_t(1 - ALPHA / 2, n - 1) + _t(POWER, n - 1)) * se,
        "beyond_margin_by": (_t(1 - ALPHA, n - 1) + _t(POWER, n - 1)) * se,
    }


def seeds_needed(sd: float, margin: float, mean: float = 0.0) -> int | None:
    """The fewest seeds whose equivalence power reaches 80 % at this sd and true difference ``mean``
    (None when no number of seeds up to MAX_SEEDS_SEARCHED does: the difference is past the margin)."""
    for n in range(2, MAX_SEEDS_SEARCHED + 1):
        if equivalence_power(n, sd, margin, mean) >= POWER:
            return n
    return None


def plan(margin: float, seeds: int, max_seeds: int) -> dict:
    """The design's side: for --seeds and --max-seeds, the largest paired sd each decides at 80 % power."""
    rows = {str(n): sd_max(n, margin) for n in sorted({seeds, max_seeds, 3, 6}) if n >= 2}
    return {
        "method": "TOST at α = 0.05 (whole 90 % interval within ±margin), power 80 % at a true difference of 0: "
        "σ_max(n) = √n·margin / (t(0.95, n−1) + z(0.90)) (study/power.py)",
        "alpha": ALPHA,
        "power": POWER,
        "margin_nats": margin,
        "sd_max_by_seeds": rows,
    }


def achieved(comparisons: dict, margin: float, control: str) -> dict:
    """Per arm, from this run's paired differences: n, σ, the 90 % half-width, what it detects with
    80 % power, its equivalence power, and the seeds that would decide equivalence."""
    out = {}
    for arm, cmp in comparisons.items():
        diff = cmp.get("final_eval_loss_difference") or {}
        values = diff.get("values") or []
        if len(values) < 2:
            out[arm] = {"n": len(values), "sd": None}
            continue
        n, sd, mean = len(values), statistics.stdev(values), statistics.fmean(values)
        row = {
            "n": n,
            "sd": sd,
            "mean": mean,
            "half_width_90": _t(1 - ALPHA, n - 1) * sd / math.sqrt(n),
            "detects_with_80_power": detectable(n, sd),
            "equivalence_power_at_zero": equivalence_power(n, sd, margin),
            "sd_max": sd_max(n, margin),
            "seeds_for_equivalence_at_zero": seeds_needed(sd, margin),
        }
        out[arm] = row
    return {"margin_nats": margin, "alpha": ALPHA, "power": POWER, "control": control, "arms": out}
