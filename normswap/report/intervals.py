"""How sure a quality change is: the interval the evaluation recorded for a model's perplexity or
bits/byte against the baseline (a bootstrap over documents or blocks), read the same way by the
table, the headline cards and the perplexity chart. A change whose interval contains "no change"
is never coloured or drawn solid."""

from __future__ import annotations

from normswap.stats.verdicts import contains


def change_interval(m: dict, key: str) -> dict | None:
    """The interval of a model's quality change against the baseline (``perplexity``,
    ``bits_per_byte``), when the evaluation recorded one: ``{low, high}`` of the ratio (a range that
    contains 1 is no measured change). None for results without intervals."""
    iv = ((m.get("quality_intervals") or {}).get(key)) or ((m.get("ratio_intervals") or {}).get(key))
    if isinstance(iv, dict) and iv.get("low") is not None and iv.get("high") is not None:
        return iv
    return None


def difference_resolved(m: dict, key: str) -> bool:
    """False when the model's change in ``key`` has an interval that contains no change; True when
    its interval excludes it, or when the run recorded no interval (older results: the exact number
    decides, as before)."""
    iv = change_interval(m, key)
    return iv is None or not contains(iv, 1.0)
