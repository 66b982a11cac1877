"""`--fraction auto`: the largest fraction on the --round-to grid within a perplexity budget.

The rotation is computed once at width d − 1 and every narrower width is a prefix of it, so a
candidate width costs one held-out evaluation and nothing else. The search bisects the grid of
widths (multiples of --round-to below d) for the narrowest width whose perplexity rises by at most
``max_increase`` percent over the source's.

Perplexity is NOT guaranteed monotone in the width (deleting a direction can lower it, and a
narrower width can pass where a wider one failed); bisection assumes monotonicity only to choose
which widths to try. What is chosen is always a width that was measured and passed: the narrowest
(the largest fraction) among those tried, after at most ⌈log2(n + 1)⌉ evaluations for a grid of n.
It is not proven to be the narrowest passing width on the whole grid.

The perplexity is measured on the held-out text slice reports (the test split of --data): the choice
is made on the same text its figures are quoted on, so it flatters them; check on your own eval set.

This module is pure Python (no torch): the evaluation is passed in.
"""

from __future__ import annotations

import math

from normswap.errors import NormswapError


def width_grid(d: int, round_to: int) -> list[int]:
    """The widths --fraction can give (basis.width_for's values for F in (0, 1)), narrowest first."""
    step = max(1, int(round_to))
    widths = list(range(step, d, step))
    return widths or [d - 1]  # a step ≥ d leaves only width_for's floor


def fraction_of(width: int, d: int) -> float:
    """The fraction that gives ``width`` on the grid (width_for(d, fraction_of(w, d), step) == w)."""
    return 1.0 - width / d


def increase_pct(source: float, candidate: float) -> float:
    return (candidate / source - 1.0) * 100.0


def search(widths: list[int], d: int, source_ppl: float, evaluate, max_increase: float, *, say=None) -> dict:
    """Bisect ``widths`` (ascending) for the narrowest width whose ``evaluate(width)`` perplexity is
    within ``max_increase`` percent of ``source_ppl``; the ``auto`` record --json prints (``chosen``:
    the chosen try). NormswapError when no width tried passes (even the widest on the grid)."""
    say = say or (lambda msg: None)
    tried, best = [], None
    lo, hi = 0, len(widths) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        width = widths[mid]
        ppl = float(evaluate(width))
        rise = increase_pct(source_ppl, ppl)
        passed = math.isfinite(rise) and rise <= max_increase
        tried.append(
            {
                "fraction": fraction_of(width, d),
                "width": width,
                "perplexity": ppl,
                "increase_pct": rise,
                "passed": passed,
            }  # fmt: skip
        )
        say(f"auto: width {width} (fraction {fraction_of(width, d):.4f}): perplexity {ppl:.4f} ({rise:+.3f} %)")
        if passed:
            best, hi = tried[-1], mid - 1
        else:
            lo = mid + 1
    if best is None:
        widest = tried[-1]
        raise NormswapError(
            f"--fraction auto: no width keeps the held-out perplexity within +{max_increase:g} % of the source's "
            f"({source_ppl:.4f}); even width {widest['width']} of {d} raises it {widest['increase_pct']:+.3f} %; "
            "nothing was written (allow more with --max-ppl-increase)"
        )
    return {"max_ppl_increase": max_increase, "source_perplexity": source_ppl, "tried": tried, "chosen": best}
