"""Speed ratios' intervals as results.json stores them (``ratio_intervals``), and how a report says
how they were made.

Throughput ratios (forward, train step, prefill, decode, generate) come from normswap's one timing
instrument, normswap/timing.py: interleaved pairs, the median of per-pair ratios with a bootstrap
interval, a null control (the baseline loaded a second time) timed in the same rounds, and a stop
rule. evaluate/throughput.py stores each model's result per kind under ``speed_setup.paired``; this
module turns it into results.json's ``ratio_intervals`` entries ``{low, high, median, repeats,
pairs, stop_reason, verdict}`` (``repeats`` = ``pairs``; verdict ``higher`` / ``lower`` for the
instrument's faster / slower, the words the results schema has always used for a number above or
below the baseline's).

The time in norm layers (``norm_ms_per_forward``) is timed by the same instrument (speed.py's
``norms``: the norm layers replaying one forward's calls), but it is a time, not a speed: its
interval is the instrument's speed interval turned over (time ratio = 1 / speed ratio, so lower is
less time; verdict ``lower`` for the instrument's faster). Results written before that have
per-repeat samples of hooked forwards instead, read under the min–max rule of
normswap/stats/verdicts.py (``min_max_interval``), as results.json files written before the
instrument are.
"""

from __future__ import annotations

from normswap import timing
from normswap.stats.levels import LEVEL
from normswap.stats.verdicts import FASTER, SLOWER, UNCONTROLLED, min_max_interval

METHOD = (
    f"throughput: {timing.METHOD}; time in norms: the same instrument on the norm layers replaying one "
    "forward's calls, as a time ratio (the speed ratio turned over)"
)
# the throughput kinds (speed.py's ``paired``, or the raw per-repeat samples of older results)
SAMPLED = ("forward", "train_step", "generate", "prefill", "decode")
# the instrument's words for a speed ratio, in the results schema's words for a ratio to the baseline
_SCHEMA_WORD = {FASTER: "higher", SLOWER: "lower"}


def paired_interval(entry: dict | None) -> dict | None:
    """results.json's interval for one of the instrument's ratios (speed.py's ``paired[kind]``)."""
    if not entry:
        return None
    return {
        "low": entry["low"],
        "high": entry["high"],
        "median": entry["ratio"],
        "repeats": entry["pairs"],
        "pairs": entry["pairs"],
        "stop_reason": entry.get("stop_reason"),
        "verdict": _SCHEMA_WORD.get(entry["verdict"], entry["verdict"]),
    }


# the instrument's words for a speed ratio, in the words for the time ratio it turns into
_TIME_WORD = {FASTER: "lower", SLOWER: "higher"}


def paired_time_interval(entry: dict | None) -> dict | None:
    """results.json's interval for a *time* ratio the instrument measured as a speed ratio (speed.py's
    ``paired["norms"]``): the candidate's seconds over the baseline's, so lower is less time."""
    iv = paired_interval(entry)
    if iv is None or not all(isinstance(iv[k], int | float) and iv[k] > 0 for k in ("low", "high", "median")):
        return None  # a speed ratio is positive: anything else (a hand-edited file) has no time ratio
    low, high, median = 1 / iv["high"], 1 / iv["low"], 1 / iv["median"]
    return iv | {"low": low, "high": high, "median": median, "verdict": _TIME_WORD.get(entry["verdict"], iv["verdict"])}


def _samples(model: dict) -> dict:
    return ((model.get("speed_setup") or {}).get("samples")) or {}


def null_intervals(null_row: dict | None, base: dict) -> dict | None:
    """The null control's own intervals against the baseline (rule 1 only: it is the yardstick),
    shaped like :func:`ratio_intervals`; None when the run had no null control."""
    return None if null_row is None else ratio_intervals(null_row, base)


def ratio_intervals(model: dict, base: dict, null: dict | None = None) -> dict:
    """Intervals for every sampled speed ratio of ``model`` against ``base`` (results.json rows).

    ``{"tokens_per_second": {kind: interval}, "norm_ms_per_forward": interval}``; a kind not
    measured is None. Throughput: the instrument's ``paired`` results; results written before it:
    intervals of the raw per-repeat samples. ``null``: :func:`null_intervals` of the run's null
    control (None: a run without one, judged by rule 1 alone), the yardstick of the per-repeat rule.
    """
    mine, theirs = _samples(model), _samples(base)
    same = model is base or model.get("name") == base.get("name")
    paired = (model.get("speed_setup") or {}).get("paired")

    def yardstick(iv):
        return UNCONTROLLED if null is None else (iv or {})

    out = {"tokens_per_second": {}, "norm_ms_per_forward": None}
    for kind in SAMPLED:
        if paired is not None:  # measured by normswap/timing.py: its interval and verdict as they are
            out["tokens_per_second"][kind] = None if same else paired_interval(paired.get(kind))
            continue
        yard = yardstick(((null or {}).get("tokens_per_second") or {}).get(kind))
        out["tokens_per_second"][kind] = None if same else min_max_interval(mine.get(kind), theirs.get(kind), yard)
    if same:
        return out
    if paired is not None and "norms" in paired:  # the instrument's, turned into a time ratio
        out["norm_ms_per_forward"] = paired_time_interval(paired["norms"])
    else:  # hooked forwards' per-repeat samples, as results from before that were written
        out["norm_ms_per_forward"] = min_max_interval(
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


def fmt_interval(iv: dict | None) -> str:
    """``[0.93–1.20]``, or empty without one; a bound that would round to 1.00 gets a third digit,
    so a range that excludes 1 never reads as if it touched it."""
    if not iv:
        return ""
    digits = 3 if any(b != 1.0 and round(b, 2) == 1.0 for b in (iv["low"], iv["high"])) else 2
    return f"[{iv['low']:.{digits}f}–{iv['high']:.{digits}f}]"


# what the instrument's bracket is, as tables and figures label it
INTERVAL_WORDS = f"{LEVEL:.0%} interval"


def throughput_pairs(results: dict) -> list[int]:
    """The pair counts of this run's throughput intervals (empty: results from before the instrument)."""
    return sorted(
        {
            iv["pairs"]
            for m in results.get("models", [])
            for iv in (((m.get("ratio_intervals") or {}).get("tokens_per_second")) or {}).values()
            if iv and iv.get("pairs")
        }
    )


def throughput_method(results: dict) -> str:
    """How this run's throughput ratios and their brackets were made, as a report says it."""
    pairs = throughput_pairs(results)
    if not pairs:  # written before the instrument: the rule it was written under
        s = results.get("speed_setup") or {}
        return f"ratio of medians, [min–max] of the per-repeat paired ratios over {s.get('repeats', '?')} repeats"
    span = str(pairs[0]) if len(pairs) == 1 else f"{pairs[0]}–{pairs[-1]}"
    return (
        f"median of the per-pair ratios over {span} interleaved pairs, "
        f"[its {INTERVAL_WORDS}, bootstrapped] (normswap/timing.py)"
    )
