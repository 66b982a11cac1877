"""Holm's step-down adjustment of a family of p-values."""

from __future__ import annotations

from normswap.stats.levels import ALPHA


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
