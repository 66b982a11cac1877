"""Equivalence within ±margin by two one-sided t-tests (Schuirmann's TOST), and the opposite finding.

At level α the two one-sided tests are rejected together exactly when the whole (1 − 2α) interval —
90 % for α = 0.05 — lies within ±margin; the opposite finding, a difference beyond the margin, is the
one-sided test that the whole 90 % interval lies past +margin (or −margin). Each gives a p-value, so
several verdicts can be adjusted together (multiple_comparisons.holm).
"""

from __future__ import annotations

import math
import statistics

from normswap.stats.levels import EQUIVALENCE_LEVEL
from normswap.stats.quantiles import t_upper_tail
from normswap.stats.t_intervals import t_interval

EQUIVALENT, BEYOND_MARGIN, UNDECIDED = "equivalent", "beyond margin", "undecided"


def tost(values, margin: float) -> dict | None:
    """Equivalence of the paired differences ``values`` to 0 within ±``margin``, and the opposite.

    ``{interval (90 %), margin, p_equivalent, p_beyond, finding}``: ``p_equivalent`` is TOST's
    p-value (the larger of the two one-sided tests: mean > −margin and mean < +margin);
    ``p_beyond`` the one-sided p-value that the difference lies past the margin on the side of the
    mean; ``finding`` is ``equivalent`` (whole 90 % interval within ±margin), ``beyond margin``
    (whole interval outside it) or ``undecided``. None without two values."""
    iv = t_interval(values, level=EQUIVALENCE_LEVEL)
    if iv is None or iv["n"] < 2:
        return None
    n, mean, sd = iv["n"], iv["mean"], statistics.stdev(iv["values"])
    df = n - 1
    if sd == 0:  # identical differences: the interval is the point
        inside = abs(mean) < margin
        p_eq, p_beyond = (0.0, 1.0) if inside else (1.0, 0.0 if abs(mean) > margin else 1.0)
    else:
        se = sd / math.sqrt(n)
        p_eq = max(t_upper_tail((mean + margin) / se, df), t_upper_tail((margin - mean) / se, df))
        p_beyond = t_upper_tail((abs(mean) - margin) / se, df)
    if -margin < iv["low"] and iv["high"] < margin:
        finding = EQUIVALENT
    elif iv["low"] > margin or iv["high"] < -margin:
        finding = BEYOND_MARGIN
    else:
        finding = UNDECIDED
    return {"interval": iv, "margin": margin, "p_equivalent": p_eq, "p_beyond": p_beyond, "finding": finding}
