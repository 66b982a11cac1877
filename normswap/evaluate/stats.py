"""How sure a speed ratio is: intervals from the interleaved repeats, and the verdict they allow.

Speed is measured interleaved (speed.py): repeat r visits every model once, so a model's r-th
sample and the baseline's r-th sample saw the same state of the machine. Their quotient is one
*paired ratio*; a shared machine's drift (other jobs, clock, heat) cancels in it. The interval of
a ratio is [min, max] of its per-repeat paired ratios.

Why min/max and what it can tell: if the two models were equally fast, each paired ratio would be
as likely above 1 as below, so all n of them landing on one side has probability 2 · 0.5ⁿ (n = 5:
6 %). A ratio is therefore called a difference only when its interval excludes 1 *and* it rests
on at least ``MIN_REPEATS`` repeats; otherwise it is "no measurable difference" — whatever the
median ratio says.
"""

from __future__ import annotations

import statistics

METHOD = "min-max of per-repeat paired ratios (interleaved repeats); a difference needs the interval to exclude 1 and >= 5 repeats"
MIN_REPEATS = 5
NO_DIFFERENCE = "no measurable difference"
# speed.py's raw samples (per repeat) behind each ratio; norm_ms is time, so lower is better.
SAMPLED = ("forward", "train_step", "generate", "prefill", "decode")


def paired_ratios(samples, base_samples) -> list[float]:
    """Per-repeat ratios sample[r] / base[r] over the repeats both have."""
    return [a / b for a, b in zip(samples or [], base_samples or []) if a is not None and b]


def interval(samples, base_samples) -> dict | None:
    """``{low, high, median, repeats, verdict}`` of the paired ratios; None without any pair.

    verdict: ``higher`` / ``lower`` (the model's number against the baseline's) when the interval
    excludes 1 over ``MIN_REPEATS`` repeats or more, else ``no measurable difference``.
    """
    ratios = paired_ratios(samples, base_samples)
    if not ratios:
        return None
    low, high = min(ratios), max(ratios)
    if len(ratios) < MIN_REPEATS or low <= 1.0 <= high:
        verdict = NO_DIFFERENCE
    else:
        verdict = "higher" if low > 1.0 else "lower"
    return {"low": low, "high": high, "median": statistics.median(ratios), "repeats": len(ratios), "verdict": verdict}


def _samples(model: dict) -> dict:
    return ((model.get("speed_setup") or {}).get("samples")) or {}


def ratio_intervals(model: dict, base: dict) -> dict:
    """Intervals for every sampled speed ratio of ``model`` against ``base`` (results.json rows).

    ``{"tokens_per_second": {kind: interval}, "norm_ms_per_forward": interval}``; a kind without
    samples (older results, speed not measured) is None.
    """
    mine, theirs = _samples(model), _samples(base)
    same = model is base or model.get("name") == base.get("name")
    out = {"tokens_per_second": {}, "norm_ms_per_forward": None}
    for kind in SAMPLED:
        out["tokens_per_second"][kind] = None if same else interval(mine.get(kind), theirs.get(kind))
    if not same:
        out["norm_ms_per_forward"] = interval(mine.get("norm_ms"), theirs.get("norm_ms"))
    return out


def intervals_of(model: dict, results: dict) -> dict | None:
    """The stored intervals, or computed from the raw samples for a results.json that predates them."""
    if model.get("ratio_intervals") is not None:
        return model["ratio_intervals"]
    base = next((m for m in results.get("models", []) if m["name"] == results.get("baseline")), None)
    return None if base is None else ratio_intervals(model, base)


def measurable(iv: dict | None) -> bool:
    return bool(iv) and iv["verdict"] != NO_DIFFERENCE


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
    few repeats) not measurable here.
    """
    if not iv or iv["repeats"] < MIN_REPEATS:
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
