"""normswap/stats/: each interval covers the truth at about its stated rate and misses a shifted
value, each test says what planted data holds, and the statistics live in one place.

Negative controls are marked ``# control``: a shifted truth the interval must miss, planted data
on the other side of the margin, the unadjusted or wrongly resampled version that fails the rate.
"""

from __future__ import annotations

import random
import re
import statistics
from pathlib import Path

import pytest

from normswap.stats import bootstrap, equivalence, multiple_comparisons, power_analysis, sign_flip, t_intervals
from normswap.stats.levels import LEVEL

PACKAGE = Path(__file__).resolve().parents[1] / "normswap"


def _covers(iv, value) -> bool:
    return iv[0] <= value <= iv[1]


def test_median_bootstrap_covers_the_true_median_at_about_its_level_and_not_a_shifted_one():
    rng = random.Random(0)
    runs, hits, shifted_hits = 200, 0, 0
    for k in range(runs):
        xs = [rng.lognormvariate(0.0, 0.1) for _ in range(60)]  # true median exp(0) = 1
        _, low, high = bootstrap.median_interval(xs, draws=500, seed=k)
        hits += _covers((low, high), 1.0)
        shifted_hits += _covers((low, high), 1.06)  # control: 6 % off, about 2.4 standard errors
    assert 0.85 <= hits / runs <= 0.99
    assert shifted_hits / runs < 0.2


def test_t_interval_covers_the_mean_at_its_level_and_its_verdict_follows():
    rng = random.Random(1)
    runs, hits, shifted_hits = 400, 0, 0
    for _ in range(runs):
        iv = t_intervals.t_interval([rng.gauss(0.3, 1.0) for _ in range(8)], null=0.3)
        hits += _covers((iv["low"], iv["high"]), 0.3)
        shifted_hits += _covers((iv["low"], iv["high"]), 0.3 + 1.5)  # control: 4.2 standard errors off
        assert (iv["verdict"] == "no measurable difference") == _covers((iv["low"], iv["high"]), 0.3)
        assert (iv["p_value"] > 1 - LEVEL) == _covers((iv["low"], iv["high"]), 0.3)  # test and interval agree
    assert abs(hits / runs - LEVEL) < 0.04
    assert shifted_hits / runs < 0.1


def test_seed_blocked_bootstrap_covers_where_resampling_steps_alone_does_not():
    """Steps within a seed share the seed's level: treating them as independent (the iid bootstrap
    of the pooled steps) is far too narrow, the blocked bootstrap is not."""
    rng = random.Random(2)
    runs, blocked_hits, iid_hits = 60, 0, 0
    for k in range(runs):
        per_seed = {}
        for s in range(8):
            level = rng.gauss(1.0, 0.05)  # the seed's own level; the population median is 1
            per_seed[s] = [rng.gauss(level, 0.01) for _ in range(20)]
        iv = bootstrap.seed_blocked_median_interval(per_seed, draws=400, seed=k)
        blocked_hits += _covers((iv["low"], iv["high"]), 1.0)
        pooled = [q for qs in per_seed.values() for q in qs]
        iid_hits += _covers(bootstrap.median_interval(pooled, draws=400, seed=k)[1:], 1.0)  # control
    assert blocked_hits / runs >= 0.8
    assert iid_hits / runs < 0.5
    assert bootstrap.seed_blocked_median_interval({0: [], 1: []}) is None


def test_two_way_interval_reads_the_order_statistics_of_the_draws():
    import torch

    values = [float(i) for i in range(50)]

    def mean_of_rows(rows, _cols):
        return statistics.fmean(values[i] for i in rows)

    low, high = bootstrap.two_way_interval(mean_of_rows, 50, 3, draws=400, generator=torch.Generator().manual_seed(0))
    assert low < 24.5 < high  # covers the mean of the table
    assert not (low <= 30 <= high)  # control: a mean 2.6 standard errors away
    assert 4 < high - low < 12  # about 2 × 1.96 × 14.4/√50 ≈ 8


def test_tost_says_equivalent_beyond_and_undecided_on_planted_differences():
    rng = random.Random(3)
    near = [rng.gauss(0.0, 0.01) for _ in range(10)]
    far = [rng.gauss(0.08, 0.01) for _ in range(10)]
    vague = [rng.gauss(0.02, 0.04) for _ in range(4)]
    margin = 0.03
    eq = equivalence.tost(near, margin)
    assert eq["finding"] == "equivalent" and eq["p_equivalent"] < 0.05
    beyond = equivalence.tost(far, margin)  # control: the same test on a planted difference past the margin
    assert beyond["finding"] == "beyond margin" and beyond["p_equivalent"] > 0.5 and beyond["p_beyond"] < 0.05
    assert equivalence.tost(vague, margin)["finding"] == "undecided"
    assert equivalence.tost([0.01], margin) is None  # one value: no test
    # the p-value and the 90 % interval decide alike (TOST at α is the whole 1 − 2α interval inside)
    for _ in range(200):
        d = [rng.gauss(0.0, 0.03) for _ in range(6)]
        r = equivalence.tost(d, margin)
        assert (r["p_equivalent"] < 0.05) == (r["finding"] == "equivalent")


def test_holm_matches_a_worked_example_and_holds_the_familywise_rate():
    adjusted = multiple_comparisons.holm([0.01, None, 0.04, 0.03, 0.005])
    assert adjusted[1] is None  # not a test of the family
    assert (
        adjusted[0] == pytest.approx(0.03) and adjusted[2] == pytest.approx(0.06) and adjusted[4] == pytest.approx(0.02)
    )
    rng = random.Random(4)
    families, any_holm, any_raw = 2000, 0, 0
    for _ in range(families):
        ps = [rng.random() for _ in range(5)]  # five true nulls
        any_holm += any(p <= 0.05 for p in multiple_comparisons.holm(ps))
        any_raw += any(p <= 0.05 for p in ps)  # control: unadjusted, ~23 % of families err
    assert any_holm / families <= 0.065
    assert any_raw / families > 0.18


def test_sign_flip_is_exact_and_holds_its_level_under_no_difference():
    assert sign_flip.sign_flip_p([1.0] * 6) == pytest.approx(2 / 64)  # the smallest p-value of 6 seeds
    assert sign_flip.sign_flip_p([1.0] * 5) == pytest.approx(2 / 32)  # control: 5 seeds cannot reach 0.05
    assert sign_flip.sign_flip_p([1.0, -1.0, 1.0, -1.0]) == 1.0
    rng = random.Random(5)
    runs = 400
    rejected = sum(
        sign_flip.sign_flip_p([rng.choice((-1, 1)) * rng.expovariate(1) for _ in range(8)]) <= 0.05 for _ in range(runs)
    )
    assert rejected / runs <= 0.08
    shifted = sum(sign_flip.sign_flip_p([rng.gauss(1.0, 0.5) for _ in range(8)]) <= 0.05 for _ in range(100))
    assert shifted > 90  # control: a planted shift of 2 sd is found


def test_power_analysis_agrees_with_simulated_tost():
    rng = random.Random(6)
    n, sd, margin = 6, 0.01, 0.02
    planned = power_analysis.equivalence_power(n, sd, margin)
    hits = sum(
        equivalence.tost([rng.gauss(0.0, sd) for _ in range(n)], margin)["finding"] == "equivalent" for _ in range(1500)
    )
    assert planned == pytest.approx(hits / 1500, abs=0.05)
    assert power_analysis.equivalence_power(n, sd, margin, true_difference=0.05) < 0.01  # control: past the margin
    need = power_analysis.seeds_needed(sd, margin)
    assert (
        power_analysis.equivalence_power(need, sd, margin)
        >= 0.8
        > power_analysis.equivalence_power(need - 1, sd, margin)
    )


def test_the_statistics_live_in_one_package():
    """One LEVEL, one wrapper around scipy's t, no stats.py outside normswap/stats/."""
    level_lines, t_imports, stats_modules = [], [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        rel = path.relative_to(PACKAGE).as_posix()
        if re.search(r"^LEVEL = ", text, re.M):
            level_lines.append(rel)
        if re.search(r"from scipy\.stats import (t|norm)\b", text):
            t_imports.append(rel)
        if path.name == "stats.py":
            stats_modules.append(rel)
    assert level_lines == ["stats/levels.py"]
    assert t_imports == ["stats/quantiles.py"]
    assert stats_modules == []
