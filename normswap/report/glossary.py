"""The terms a report uses, defined once so that every report can say what its words mean.

A report lists the terms it uses (:func:`glossary`), in its own pages: a reader should not need
docs/ to know what a "paired interval" or an "Amdahl bound" is.
"""

from __future__ import annotations

from normswap.stats.verdicts import NO_DIFFERENCE, NULL_BAND, TOO_NOISY

TERMS: dict[str, str] = {
    "paired interval": (
        "Each seed (or each timing repeat) runs every arm on the same initial weights, data and machine state; "
        "the arm's number minus (or divided by) the reference's number of the same seed is one paired difference, "
        "so the seed-to-seed spread cancels. The interval is the 95 % range of the mean paired difference "
        "(Student's t over seeds; min–max over timing repeats)."
    ),
    NO_DIFFERENCE: (
        "The interval contains 0 (1 for a ratio): the run cannot tell the arms apart. It is not evidence "
        "that they are equal (that needs an equivalence margin)."
    ),
    "TOST margin": (
        "Equivalence test (two one-sided tests): two arms are called equal only when the whole interval of "
        "their difference lies inside ±margin. A narrow interval around 0 can show equality; a wide one cannot."
    ),
    "not measurable here": (
        "The study cannot decide the claim: the interval straddles the threshold, the run lacks what the claim "
        "needs (seeds, a learning-rate sweep, low precision), or the quantity cannot reach the threshold on this "
        "model and machine (see Amdahl bound)."
    ),
    "null control": (
        "A copy of the reference arm (same norm, its own data order and dropout draws in a study; the same model "
        "loaded twice in an eval), measured like the others. Its difference from the reference is what noise "
        "alone does; a difference is only a difference when it lies outside the null control's."
    ),
    TOO_NOISY: (
        f"The null control itself moved by more than ±{NULL_BAND * 100:.0f} % (or its study band): the machine was "
        "too busy during the run to tell a speed difference from noise, so no speed verdict is given."
    ),
    "norm share": (
        "The fraction of a step's (or a forward's) time spent inside the norm layers, measured apart from the "
        "timed steps (a study profiles a few steps; an eval replays one forward's norm calls, timed in pairs "
        "like the rest)."
    ),
    "Amdahl bound": (
        "The largest speed-up a faster norm can give a whole step: 1 / (1 − share × (1 − 1/s)) for a norm share "
        "`share` made `s` times faster (at most 1 / (1 − share) if the norms took no time at all). A claimed "
        "speed-up above it cannot be reached by changing the norm."
    ),
    "cost at equal tokens": "The inverse of the tokens/s ratio: the time the arm needs for the reference's tokens.",
    "unigram / bigram baseline": (
        "The held-out loss of a model that predicts each token from its training frequency alone (unigram) or "
        "from the previous token (count bigram). An arm that does not beat them has barely learned; a quality "
        "verdict then says little about the norm."
    ),
    "Holm correction": (
        "Several claims are tested at once; Holm's step-down rule keeps the chance of any false 'reproduced' "
        "at 5 % over all of them by testing the most certain result at 5 %/k, the next at 5 %/(k−1), and so on."
    ),
    "ε (machine epsilon)": (
        "The spacing of representable numbers near 1 in a dtype (bf16 0.0078, fp16 0.00098): kernel errors "
        "are given in units of it."
    ),
}


def glossary(used: list[str]) -> list[tuple[str, str]]:
    """(term, definition) for each term in ``used`` that the glossary defines, in that order."""
    return [(t, TERMS[t]) for t in used if t in TERMS]
