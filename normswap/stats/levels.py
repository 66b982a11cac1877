"""The levels every interval and test in normswap is read at, written once."""

from __future__ import annotations

LEVEL = 0.95  # every two-sided interval: 95 %
ALPHA = 0.05  # each test's level, and a family's under Holm's adjustment
EQUIVALENCE_LEVEL = 1 - 2 * ALPHA  # the interval TOST reads: 90 %
POWER = 0.80  # the power a plan asks for
