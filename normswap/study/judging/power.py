"""The power of the equal-loss test for a study: what its seeds can decide, planned and achieved.

The mathematics is normswap/stats/power_analysis.py (equivalence power, σ_max(n), the minimal
detectable differences, the seeds needed). ``plan`` states the design's side (for the seeds the study
starts with and the most it may add); ``achieved`` puts the run's measured σ of each arm's paired
differences in and says what this run could detect and how many seeds would decide it (computed,
not guessed).
"""

from __future__ import annotations

import statistics

from normswap.stats.levels import ALPHA, POWER
from normswap.stats.power_analysis import (
    detectable,
    equivalence_half_width,
    equivalence_power,
    sd_max,
    seeds_needed,
)


def plan(margin: float, seeds: int, max_seeds: int) -> dict:
    """The design's side: for --seeds and --max-seeds, the largest paired sd each decides at 80 % power."""
    rows = {str(n): sd_max(n, margin) for n in sorted({seeds, max_seeds, 3, 6}) if n >= 2}
    return {
        "method": "TOST at α = 0.05 (whole 90 % interval within ±margin), power 80 % at a true difference of 0: "
        "σ_max(n) = √n·margin / (t(0.95, n−1) + z(0.90)) (study/judging/power.py)",
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
            "half_width_90": equivalence_half_width(n, sd),
            "detects_with_80_power": detectable(n, sd),
            "equivalence_power_at_zero": equivalence_power(n, sd, margin),
            "sd_max": sd_max(n, margin),
            "seeds_for_equivalence_at_zero": seeds_needed(sd, margin),
        }
        out[arm] = row
    return {"margin_nats": margin, "alpha": ALPHA, "power": POWER, "control": control, "arms": out}
