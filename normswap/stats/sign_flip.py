"""The exact two-sided sign-flip (randomization) test of paired differences against 0."""

from __future__ import annotations

import itertools
import random

ENUMERATED_UP_TO = 16  # seeds: 2¹⁶ sign assignments are enumerated, more are sampled


def sign_flip_p(diffs: list[float], *, draws: int = 20_000) -> float:
    """The share of the 2ⁿ sign assignments whose |sum| is at least the observed one. Under "no
    difference" each seed's difference is as likely negated, whatever its distribution, so ties and
    coarse counts need no normality; enumerated up to ``ENUMERATED_UP_TO`` differences, sampled (fixed
    seed) above."""
    n = len(diffs)
    if n == 0:
        return 1.0
    observed = abs(sum(diffs)) - 1e-12 * (1 + sum(abs(d) for d in diffs))
    if n <= ENUMERATED_UP_TO:
        signs = itertools.product((1, -1), repeat=n)
        hits = sum(abs(sum(s * d for s, d in zip(ss, diffs))) >= observed for ss in signs)
        return hits / 2**n
    rng = random.Random(0)
    hits = sum(abs(sum(d if rng.random() < 0.5 else -d for d in diffs)) >= observed for _ in range(draws))
    return (hits + 1) / (draws + 1)
