"""How sure a speed ratio is: intervals from the interleaved repeats, and the verdict they allow.

Speed is measured interleaved (speed.py): repeat r visits every model once, so a model's r-th
sample and the baseline's r-th sample saw the same state of the machine. Their quotient is one
*paired ratio*; a shared machine's drift (other jobs, clock, heat) cancels in it. The interval of
a ratio is [min, max] of its per-repeat paired ratios.

Why min/max and what it can tell: if the two models were equally fast, each paired ratio would be
as likely above 1 as below, so all n of them landing on one side has probability 2 · 0.5ⁿ (n = 5:
6 %). Pairing cancels a drift that is slow against one repeat, not a machine whose load changes
*within* a repeat (another job starting between two models' turns): that moves single paired
ratios by tens of per cent, and min/max then straddles or misses 1 by chance. So every speed run
also times a **null control**: the baseline loaded a second time, interleaved like the rest. Its
paired ratios to the baseline show what "no difference" looks like on this machine during this run.

The rule (:func:`interval`, :func:`null_is_tight`), per measured kind (forward, decode, ...):
a ratio is a difference only when
  1. it rests on at least ``MIN_REPEATS`` repeats and its interval excludes 1, and
  2. the null control's interval for that kind lies within [1 − ``NULL_DELTA``, 1 + ``NULL_DELTA``]
     (the machine was quiet enough to tell), and
  3. the ratio's interval does not overlap the null control's (it is outside what noise did).
Otherwise it is "no measurable difference" (2 failed: "too noisy to tell"), whatever the median
ratio says; a report says once, at the top, which kinds were too noisy, and colours none of them.

``NULL_DELTA`` = 0.05: on the project's quiet 2-core machine two models of identical cost (the
demo's original and its exact conversion) pair within 0.98–1.02 on forward and train step
(docs/demo/results.json); ±5 % leaves room for that spread and still refuses a machine whose load
moved by more than the few-per-cent differences a norm swap can make (the busy runs this guards
against pair at 0.13–0.90). Results written before the null control (no ``null_control``) keep
the rule of 1. alone.
"""

from __future__ import annotations

import statistics

MIN_REPEATS = 5
NULL_DELTA = 0.05
METHOD = (
    "min-max of per-repeat paired ratios (interleaved repeats); a difference needs "
    f">= {MIN_REPEATS} repeats, an interval "
    "that excludes 1 and the null control's (the baseline loaded twice), and a null control within "
    f"[{1 - NULL_DELTA:.2f}, {1 + NULL_DELTA:.2f}] (else: too noisy to tell)"
)
NO_DIFFERENCE = "no measurable difference"
TOO_NOISY = "too noisy to tell"
# ``null`` of interval(): no null control in this run (results from before it existed)
UNCONTROLLED = None
# speed.py's raw samples (per repeat) behind each ratio; norm_ms is time, so lower is better.
SAMPLED = ("forward", "train_step", "generate", "prefill", "decode")


def paired_ratios(samples, base_samples) -> list[float]:
    """Per-repeat ratios sample[r] / base[r] over the repeats both have."""
    return [a / b for a, b in zip(samples or [], base_samples or []) if a is not None and b]


def null_is_tight(null_iv: dict | None) -> bool:
    """Whether the null control's interval says the machine was quiet enough to tell (rule 2)."""
    return (
        bool(null_iv)
        and null_iv.get("repeats", 0) >= MIN_REPEATS
        and 1 - NULL_DELTA <= null_iv["low"]
        and null_iv["high"] <= 1 + NULL_DELTA
    )


def interval(samples, base_samples, null=UNCONTROLLED) -> dict | None:
    """``{low, high, median, repeats, verdict}`` of the paired ratios; None without any pair.

    ``null``: the null control's interval for the same kind (``{}`` when the run had a null control
    but it has no samples of this kind); ``UNCONTROLLED`` for a run without one. verdict:
    ``higher`` / ``lower`` (the model's number against the baseline's) under the module's rule,
    ``too noisy to tell`` when the null control is not tight, else ``no measurable difference``.
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


def _samples(model: dict) -> dict:
    return ((model.get("speed_setup") or {}).get("samples")) or {}


def null_intervals(null_row: dict | None, base: dict) -> dict | None:
    """The null control's own intervals against the baseline (rule 1 only: it is the yardstick),
    shaped like :func:`ratio_intervals`; None when the run had no null control."""
    return None if null_row is None else ratio_intervals(null_row, base)


def ratio_intervals(model: dict, base: dict, null: dict | None = None) -> dict:
    """Intervals for every sampled speed ratio of ``model`` against ``base`` (results.json rows).

    ``{"tokens_per_second": {kind: interval}, "norm_ms_per_forward": interval}``; a kind without
    samples (older results, speed not measured) is None. ``null``: :func:`null_intervals` of the
    run's null control (None: a run without one, judged by rule 1 alone).
    """
    mine, theirs = _samples(model), _samples(base)
    same = model is base or model.get("name") == base.get("name")

    def yardstick(iv):
        return UNCONTROLLED if null is None else (iv or {})

    out = {"tokens_per_second": {}, "norm_ms_per_forward": None}
    for kind in SAMPLED:
        yard = yardstick(((null or {}).get("tokens_per_second") or {}).get(kind))
        out["tokens_per_second"][kind] = None if same else interval(mine.get(kind), theirs.get(kind), yard)
    if not same:
        out["norm_ms_per_forward"] = interval(
            mine.get("norm_ms"), theirs.get("norm_ms"), yardstick((null or {}).get("norm_ms_per_forward"))
        )
    return out


def noisy_kinds(results: dict) -> list[str]:
    """The measured kinds (``forward``, ``decode``, ``norm_ms_per_forward`` …) whose null control was
    not tight: their ratios are "too noisy to tell". Empty for a run without a null control."""
    noise = results.get("speed_noise") or {}
    return [k for k, tight in (noise.get("tight") or {}).items() if tight is False]  # None: too few repeats to judge


def intervals_of(model: dict, results: dict) -> dict | None:
    """The stored intervals, or computed from the raw samples for a results.json that predates them."""
    if model.get("ratio_intervals") is not None:
        return model["ratio_intervals"]
    base = next((m for m in results.get("models", []) if m["name"] == results.get("baseline")), None)
    if base is None:
        return None
    null_row = results.get("null_control")
    return ratio_intervals(model, base, null_intervals(null_row, base) if null_row else None)


def measurable(iv: dict | None) -> bool:
    return bool(iv) and iv["verdict"] not in (NO_DIFFERENCE, TOO_NOISY)


def undecided(iv: dict | None) -> str:
    """The words for an interval that is no difference: "no measurable difference" or "too noisy to tell"."""
    return TOO_NOISY if iv and iv["verdict"] == TOO_NOISY else NO_DIFFERENCE


def fmt_interval(iv: dict | None) -> str:
    """``[0.93–1.20]``, or empty without one; a bound that would round to 1.00 gets a third digit,
    so a range that excludes 1 never reads as if it touched it."""
    if not iv:
        return ""
    digits = 3 if any(b != 1.0 and round(b, 2) == 1.0 for b in (iv["low"], iv["high"])) else 2
    return f"[{iv['low']:.{digits}f}–{iv['high']:.{digits}f}]"


def claim_verdict(iv: dict | None, *, at_least: float | None = None, at_most: float | None = None) -> str:
    """Verdict on a quoted claim "ratio >= at_least" (or "<= at_most") from an interval.

    reproduced: every repeat meets the claim; not reproduced: no repeat does; else (or with too
    few repeats, or a null control that says the machine was too noisy) not measurable here.
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
