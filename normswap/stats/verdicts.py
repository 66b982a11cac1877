"""The rules that turn a ratio's interval into words, one set for every verdict normswap prints.

A speed ratio (candidate speed / baseline speed) is judged against its run's **null control** (the
baseline against a second copy of itself, timed the same way): "too noisy to tell" when the null
control's interval is not inside [1 − ``NULL_BAND``, 1 + ``NULL_BAND``]; else "faster" / "slower"
when the candidate's whole interval lies further from 1, on its side, than the null control's
interval reached on either side (two identical copies at 0.981–0.995 say this run cannot tell 1.9 %
in either direction: a candidate at 1.001–1.013 is not faster); else "no measurable difference".
Fewer than ``MIN_PAIRS`` pairs decide nothing (a ratio of 2 pairs can exclude 1 by chance).

Results written before the paired instrument hold per-repeat samples instead, read under the
min–max rule (:func:`min_max_interval`): a difference needs at least ``MIN_REPEATS`` repeats, an
interval that excludes 1 and the null control's, and the null control within the same band.

A quoted claim ("ratio ≥ x") is reproduced when its whole interval meets it, not reproduced when
none of it does (:func:`claim_verdict`).
"""

from __future__ import annotations

import statistics

FASTER = "faster"
SLOWER = "slower"
NO_DIFFERENCE = "no measurable difference"
TOO_NOISY = "too noisy to tell"
VERDICTS = (FASTER, SLOWER, NO_DIFFERENCE, TOO_NOISY)

# The null control must land within ±NULL_BAND of 1 for any verdict: a machine where two identical
# copies differ by more than 2 % cannot be trusted with the few-per-cent differences a norm swap makes.
NULL_BAND = 0.02
# below this many pairs a bootstrap interval is too coarse to call anything: no measurable difference
MIN_PAIRS = 10
# below this many per-repeat samples the min–max rule calls nothing
MIN_REPEATS = 5
# ``null`` of min_max_interval(): no null control in this run (results from before it existed)
UNCONTROLLED = None


def null_within_band(null_low: float, null_high: float, band: float = NULL_BAND) -> bool:
    """Whether the null control says this run could tell differences (its interval inside the band)."""
    return 1 - band <= null_low and null_high <= 1 + band


def speed_ratio_verdict(
    low: float, high: float, null_low: float | None, null_high: float | None, band: float = NULL_BAND, pairs=None
) -> str:
    """The verdict on a speed-ratio interval [low, high], given the null control's (None, None: a run
    without one, judged on 1 alone); fewer than ``MIN_PAIRS`` pairs decide nothing."""
    if pairs is not None and pairs < MIN_PAIRS:
        return NO_DIFFERENCE
    if null_low is None:
        null_low = null_high = 1.0
    elif not null_within_band(null_low, null_high, band):
        return TOO_NOISY
    reach = max(null_high - 1.0, 1.0 - null_low, 0.0)  # how far from 1 two identical copies got, either way
    if low > 1.0 + reach:
        return FASTER
    if high < 1.0 - reach:
        return SLOWER
    return NO_DIFFERENCE


def null_control_verdict(low: float, high: float, pairs: int, band: float = NULL_BAND) -> str:
    """The null control's own word: the yardstick is "no difference" by construction when it has enough
    pairs and lies within its band, else the run is too noisy to tell."""
    return NO_DIFFERENCE if pairs >= MIN_PAIRS and null_within_band(low, high, band) else TOO_NOISY


def paired_ratios(samples, base_samples) -> list[float]:
    """Per-repeat ratios sample[r] / base[r] over the repeats both have."""
    return [a / b for a, b in zip(samples or [], base_samples or []) if a is not None and b]


def judged(iv: dict) -> bool:
    """Whether an interval rests on enough samples to judge anything: a paired instrument's interval
    (it has ``pairs``) needs ``MIN_PAIRS``, a per-repeat one ``MIN_REPEATS``."""
    return iv.get("repeats", 0) >= (MIN_PAIRS if "pairs" in iv else MIN_REPEATS)


def null_is_tight(null_iv: dict | None) -> bool:
    """Whether the null control's interval says the machine was quiet enough to tell. A paired
    instrument's intervals carry its word on that (a turned-over time interval is judged on the speed
    interval it came from, so the banner and the verdicts never disagree at the band's edge)."""
    if not null_iv or not judged(null_iv):
        return False
    if "pairs" in null_iv:
        return null_iv["verdict"] != TOO_NOISY
    return null_within_band(null_iv["low"], null_iv["high"])


def min_max_interval(samples, base_samples, null=UNCONTROLLED) -> dict | None:
    """``{low, high, median, repeats, verdict}``: [min, max] of the per-repeat paired ratios; None
    without any pair.

    ``null``: the null control's interval for the same kind (``{}`` when the run had a null control
    but it has no samples of this kind); ``UNCONTROLLED`` for a run without one. verdict:
    ``higher`` / ``lower`` (the model's number against the baseline's), ``too noisy to tell`` when
    the null control is not tight, else ``no measurable difference``.
    """
    ratios = paired_ratios(samples, base_samples)
    if not ratios:
        return None
    low, high = min(ratios), max(ratios)
    if len(ratios) < MIN_REPEATS:
        verdict = NO_DIFFERENCE  # too few repeats to judge the ratio, or the machine
    elif null is not UNCONTROLLED and not null_is_tight(null):
        verdict = TOO_NOISY
    elif low <= 1.0 <= high:
        verdict = NO_DIFFERENCE
    elif null is not UNCONTROLLED and not (low > null["high"] or high < null["low"]):
        verdict = NO_DIFFERENCE  # within what the baseline against itself did
    else:
        verdict = "higher" if low > 1.0 else "lower"
    return {"low": low, "high": high, "median": statistics.median(ratios), "repeats": len(ratios), "verdict": verdict}


def measurable(iv: dict | None) -> bool:
    """Whether an interval's verdict names a difference (not "no measurable difference", not "too noisy")."""
    return bool(iv) and iv["verdict"] not in (NO_DIFFERENCE, TOO_NOISY)


def undecided(iv: dict | None) -> str:
    """The words for an interval that is no difference: "no measurable difference" or "too noisy to tell"."""
    return TOO_NOISY if iv and iv["verdict"] == TOO_NOISY else NO_DIFFERENCE


def contains(iv: dict, value: float = 1.0) -> bool:
    """Whether the interval ``{low, high}`` holds ``value`` (a ratio's "no change" is 1)."""
    return iv["low"] <= value <= iv["high"]


def claim_verdict(iv: dict | None, *, at_least: float | None = None, at_most: float | None = None) -> str:
    """Verdict on a quoted claim "ratio >= at_least" (or "<= at_most") from an interval.

    reproduced: the whole interval meets the claim; not reproduced: none of it does; else (or with
    too few repeats, or a null control that says the machine was too noisy) not measurable here.
    """
    if not iv or iv["repeats"] < MIN_REPEATS or iv["verdict"] == TOO_NOISY:
        return "not measurable here"
    if at_least is not None:
        if iv["low"] >= at_least:
            return "reproduced"
        if iv["high"] < at_least:
            return "not reproduced"
    if at_most is not None:
        if iv["high"] <= at_most:
            return "reproduced"
        if iv["low"] > at_most:
            return "not reproduced"
    return "not measurable here"
