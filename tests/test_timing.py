"""normswap.timing on planted timings: a fake clock that the timed functions advance.

The planted host swings its speed ×3 (a slow sine over a fraction of a second, much longer than
one pair of blocks) — like this project's shared machine, only worse — and adds per-call jitter.
Nothing here reads the real clock, so no test depends on how fast or busy the machine is.

Negative controls, built in: ``test_unpaired_bootstrap_cannot_decide_what_pairing_decides``
shows that an instrument that ignored the pairing (each function's blocks bootstrapped on their
own, the ratio of their medians) leaves the 3 % difference undecided on the same planted
timings, so :func:`test_three_percent_slower_is_slower` fails for such an implementation; an
implementation that took the ratio the other way round (time over time) fails the "faster" test.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from normswap import timing
from normswap.stats import verdicts


class PlantedHost:
    """A fake machine: ``clock()`` reads its time, ``fn(cost)`` returns a function that spends
    ``cost`` seconds per call scaled by the host's current slowness and a per-call jitter."""

    def __init__(self, *, swing=0.5, period=0.4, jitter=0.005, seed=0, cold=0.0):
        self.now = 0.0
        self.swing, self.period, self.jitter = swing, period, jitter
        self.cold = cold  # extra cost of a call right after another function's (its cache was evicted)
        self.rng = random.Random(seed)
        self.calls: list[str] = []

    def clock(self) -> float:
        return self.now

    def slowness(self) -> float:
        return 1.0 + self.swing * math.sin(2 * math.pi * self.now / self.period)

    def fn(self, name: str, cost: float):
        def call():
            switched = bool(self.calls) and self.calls[-1] != name
            self.calls.append(name)
            cold = 1.0 + (self.cold if switched else 0.0)
            self.now += cost * cold * self.slowness() * self.rng.lognormvariate(0.0, self.jitter)

        return call


MS = 1e-3


def _compare(host, costs: dict, **kw):
    fns = {name: host.fn(name, cost) for name, cost in costs.items()}
    kw = {"calls_per_sample": 5, "budget_s": 60.0, "min_pairs": 40, "max_pairs": 3000, "clock": host.clock} | kw
    return timing.compare(fns, "original", "null control", **kw)


def _unpaired_interval(comparison, name, draws=1000):
    """The wrong instrument: bootstrap each function's block times separately, ratio of medians."""
    base = np.array([b for b, _ in comparison.pair_seconds[name]])
    other = np.array([o for _, o in comparison.pair_seconds[name]])
    rng = np.random.default_rng(0)
    meds = [np.median(rng.choice(base, base.size)) / np.median(rng.choice(other, other.size)) for _ in range(draws)]
    return np.percentile(meds, [2.5, 97.5])


def test_three_percent_slower_is_slower_and_a_copy_is_not():
    host = PlantedHost()
    c = _compare(host, {"original": 1 * MS, "null control": 1 * MS, "copy": 1 * MS, "slower": 1.03 * MS})
    assert c.stop_reason == timing.CONVERGED
    assert c.null.verdict == verdicts.NO_DIFFERENCE and c.null.low >= 0.98 and c.null.high <= 1.02
    slower = c.candidates["slower"]
    assert slower.verdict == verdicts.SLOWER
    assert slower.ratio == pytest.approx(1 / 1.03, abs=0.005)  # speed ratio: below 1 when slower
    assert slower.high < 1.0 and slower.pairs == c.rounds
    assert c.candidates["copy"].verdict == verdicts.NO_DIFFERENCE
    assert c.candidates["copy"].low <= 1.0 <= c.candidates["copy"].high


def test_three_percent_faster_is_faster_with_a_ratio_above_one():
    host = PlantedHost(seed=1)
    c = _compare(host, {"original": 1 * MS, "null control": 1 * MS, "faster": 1 / 1.03 * MS})
    assert c.candidates["faster"].verdict == verdicts.FASTER
    assert c.candidates["faster"].low > 1.0
    assert c.seconds_per_call["faster"] < c.seconds_per_call["original"]


def test_unpaired_bootstrap_cannot_decide_what_pairing_decides():
    """The negative control: on the same planted timings, ignoring the pairing straddles 1."""
    host = PlantedHost()
    c = _compare(host, {"original": 1 * MS, "null control": 1 * MS, "slower": 1.03 * MS})
    assert c.candidates["slower"].verdict == verdicts.SLOWER
    low, high = _unpaired_interval(c, "slower")
    assert low < 1.0 < high, "the planted host must be noisy enough that only pairing decides"


def test_a_noise_generator_is_too_noisy_to_tell_rather_than_a_verdict():
    host = PlantedHost(jitter=0.8, seed=2)
    c = _compare(host, {"original": 1 * MS, "null control": 1 * MS, "slower": 1.03 * MS}, budget_s=1.0)
    assert c.stop_reason == timing.BUDGET
    assert c.elapsed_s >= 1.0
    assert not (0.98 <= c.null.low and c.null.high <= 1.02)
    assert c.null.verdict == verdicts.TOO_NOISY
    assert c.candidates["slower"].verdict == verdicts.TOO_NOISY


def test_even_a_large_difference_is_not_called_when_the_null_control_is_out_of_its_band():
    host = PlantedHost(jitter=0.8, seed=3)
    c = _compare(host, {"original": 1 * MS, "null control": 1 * MS, "half": 2 * MS}, budget_s=1.0)
    assert c.candidates["half"].high < 0.9  # the ratio itself is plain
    assert c.candidates["half"].verdict == verdicts.TOO_NOISY


def test_stop_rule_says_converged_budget_or_max_pairs():
    quiet = _compare(PlantedHost(), {"original": 1 * MS, "null control": 1 * MS}, target_halfwidth=0.01)
    assert quiet.stop_reason == timing.CONVERGED
    assert quiet.null.halfwidth <= 0.01 and 40 <= quiet.rounds < 3000
    capped = _compare(PlantedHost(jitter=0.8), {"original": 1 * MS, "null control": 1 * MS}, max_pairs=50)
    assert capped.stop_reason == timing.MAX_PAIRS and capped.rounds == 50
    tight = _compare(PlantedHost(), {"original": 1 * MS, "null control": 1 * MS}, target_halfwidth=1e-6, budget_s=2.0)
    assert tight.stop_reason == timing.BUDGET and tight.null.halfwidth > 1e-6


def test_pairs_interleave_and_alternate_their_order_after_a_warm_up():
    host = PlantedHost()
    c = _compare(host, {"original": 1 * MS, "null control": 1 * MS}, warmup=2, min_pairs=4, max_pairs=4)
    warm, timed = host.calls[:20], host.calls[20:]
    assert warm == ["original"] * 10 + ["null control"] * 10  # 2 warm-up blocks of 5 calls each
    blocks = [timed[i] for i in range(0, len(timed), 6)]  # 1 untimed lead-in call + 5 timed per block
    assert all(len(set(timed[i : i + 6])) == 1 for i in range(0, len(timed), 6))
    assert blocks == ["original", "null control", "null control", "original"] * 2
    assert c.rounds == 4 and len(c.pair_seconds["null control"]) == 4


def test_verdict_rule_and_json():
    assert verdicts.speed_ratio_verdict(0.95, 0.97, 0.99, 1.01) == verdicts.SLOWER
    assert (
        verdicts.speed_ratio_verdict(0.95, 0.995, 0.99, 1.01) == verdicts.NO_DIFFERENCE
    )  # overlaps the null's interval
    assert verdicts.speed_ratio_verdict(1.03, 1.05, 0.97, 1.01) == verdicts.TOO_NOISY  # the null is out of its band
    c = _compare(PlantedHost(), {"original": 1 * MS, "null control": 1 * MS, "copy": 1 * MS})
    j = c.to_json()
    assert set(j["candidates"]["copy"]) == {"ratio", "low", "high", "pairs", "verdict"}
    assert j["stop_reason"] == c.stop_reason and j["null"]["pairs"] == c.rounds
    with pytest.raises(ValueError):
        timing.compare({"a": lambda: None}, "a", "a")


def test_the_baseline_in_every_pair_gets_no_warm_cache_advantage_over_its_copy():
    """The baseline runs in every pair, so it often follows itself; on a host where a call after
    another function's costs more (a cold cache), only the untimed lead-in call keeps its copy
    (the null control) level with it. Negative control: without it the null control is off."""
    costs = {"original": 1 * MS, "null control": 1 * MS, "converted": 1 * MS}
    fair = _compare(PlantedHost(cold=5.0), costs)
    for r in (fair.null, fair.candidates["converted"]):
        assert r.verdict == verdicts.NO_DIFFERENCE and r.low <= 1.0 <= r.high
    unfair = _compare(PlantedHost(cold=5.0), costs, lead_in=0)
    # both copies of the same cost read slower than the baseline: the instrument's own bias
    assert unfair.null.high < 1.0 and unfair.candidates["converted"].high < 1.0


def _placed_copies(host, name: str, cost: float, biases):
    """Copies of one function, each with its own steady bias (where its buffers landed in memory)."""
    return [host.fn(name, cost * b) for b in biases]


def test_copies_rotated_average_out_a_steady_placement_bias_that_one_copy_a_side_cannot():
    """Two sessions of one onnxruntime graph differ by ~2 % for a whole run. Planted: every copy of a
    function is steadily off by one of ±2.5 %, drawn alike for every side. With one copy a side the null
    control reads the two copies' bias (outside ±2 %: too noisy); rotated through four copies a side,
    the same instrument sees the spread of placements and decides — and a 4 % slower function is
    still called slower (its copies drawn from the same biases)."""
    biases = {"original": (1.0, 1.025, 0.975, 1.0), "null control": (1.025, 0.975, 1.025, 0.975)}
    biases["slower"] = (0.975, 1.0, 1.025, 1.025)
    cost = {"original": 1 * MS, "null control": 1 * MS, "slower": 1.04 * MS}
    kw = {"calls_per_sample": 5, "budget_s": 120.0, "min_pairs": 40, "max_pairs": 3000}

    host = PlantedHost(jitter=0.002)
    one = {name: host.fn(name, cost[name] * b[1]) for name, b in biases.items()}  # copy 1 of each
    c1 = timing.compare(one, "original", "null control", clock=host.clock, **kw)
    assert c1.null.verdict == verdicts.TOO_NOISY and c1.null.low > 1.02  # the one bias, read as noise
    assert c1.candidates["slower"].verdict == verdicts.TOO_NOISY

    host = PlantedHost(jitter=0.002)
    many = {name: _placed_copies(host, name, cost[name], b) for name, b in biases.items()}
    c4 = timing.compare(many, "original", "null control", clock=host.clock, **kw)
    assert c4.replicas == {"original": 4, "null control": 4, "slower": 4}
    assert c4.null.verdict == verdicts.NO_DIFFERENCE and 0.98 <= c4.null.low <= c4.null.high <= 1.02
    assert c4.candidates["slower"].verdict == verdicts.SLOWER
    assert c4.candidates["slower"].ratio == pytest.approx(1 / 1.04, abs=0.015)


def test_every_pair_of_copies_meets_equally_often():
    copies = {"a": ["a0", "a1", "a2"], "b": ["b0", "b1"]}
    met = [tuple(timing._copies_for_pair(copies, "a", "b", k).values()) for k in range(12)]
    assert {m: met.count(m) for m in set(met)} == {(f"a{i}", f"b{j}"): 2 for i in range(3) for j in range(2)}
    assert timing._copies_for_pair(copies, "a", "a", 4) == {"a": "a1"}  # the baseline alone rotates too


def test_calls_a_block_per_function_keep_the_ratio_per_call_and_the_rounds_short():
    """A composite ten times slower than the baseline, run 1 call a block against the baseline's 10:
    the ratio is still per call (×0.1; an instrument that compared whole blocks would read ×1), and
    the same budget holds several times the rounds that 10 calls of it a block allow."""
    kw = {"budget_s": 1.0, "min_pairs": 10_000, "max_pairs": 10_000}  # the budget decides the rounds

    host = PlantedHost(swing=0.1, jitter=0.002)
    fns = {"original": host.fn("o", 1 * MS), "null control": host.fn("n", 1 * MS), "slow": host.fn("s", 10 * MS)}
    calls = {"original": 10, "null control": 10, "slow": 1}
    mixed = timing.compare(fns, "original", "null control", calls_per_sample=calls, clock=host.clock, **kw)
    assert mixed.candidates["slow"].ratio == pytest.approx(0.1, rel=0.02)
    assert mixed.calls_per_function == calls and mixed.calls_per_sample == 10
    assert mixed.seconds_per_call["slow"] == pytest.approx(10 * MS, rel=0.15)

    host = PlantedHost(swing=0.1, jitter=0.002)
    fns = {"original": host.fn("o", 1 * MS), "null control": host.fn("n", 1 * MS), "slow": host.fn("s", 10 * MS)}
    same = timing.compare(fns, "original", "null control", calls_per_sample=10, clock=host.clock, **kw)
    assert same.candidates["slow"].ratio == pytest.approx(0.1, rel=0.02)
    assert mixed.rounds > 2.5 * same.rounds


def test_a_difference_must_outreach_the_null_control_on_either_side():
    """bench decode, kjv-neox, beside a burner: converted 1.001–1.013 with the null control at
    0.981–0.995. Two identical copies differed by up to 1.9 % in that run, so 0.1–1.3 % is not a
    difference; the rule that compared the candidate with the null's near end only called it faster."""
    assert verdicts.speed_ratio_verdict(1.001, 1.013, 0.981, 0.995) == verdicts.NO_DIFFERENCE
    assert verdicts.speed_ratio_verdict(1.020, 1.030, 0.981, 0.995) == verdicts.FASTER  # beyond the null's 1.9 % reach
    assert verdicts.speed_ratio_verdict(0.987, 0.999, 1.005, 1.019) == verdicts.NO_DIFFERENCE  # the mirror image
    assert verdicts.speed_ratio_verdict(0.970, 0.980, 1.005, 1.019) == verdicts.SLOWER
    assert verdicts.speed_ratio_verdict(1.006, 1.013, 0.995, 1.000) == verdicts.FASTER  # the null's 0.5 %, outreached
    assert verdicts.speed_ratio_verdict(1.001, 1.013, 1.0, 1.0) == verdicts.FASTER  # no null (1, 1): 1 is the yardstick


class FavouringHost(PlantedHost):
    """A host on which a function runs faster the more of the recent calls were its own (what stays
    in a shared cache that other work keeps evicting): a lead-in call does not undo it."""

    def __init__(self, *, favour=0.2, window=60, **kw):
        super().__init__(**kw)
        self.favour, self.window = favour, window

    def fn(self, name: str, cost: float):
        def call():
            recent = self.calls[-self.window :]
            share = recent.count(name) / len(recent) if recent else 0.0
            self.calls.append(name)
            self.now += cost * (1 - self.favour * share) * self.slowness() * self.rng.lognormvariate(0.0, self.jitter)

        return call


def test_balanced_rounds_give_the_baseline_slot_no_advantage_that_the_star_round_does():
    """#43: in the default round the baseline runs in every pair, twice as often as each of two others;
    on a host that favours the function run most (planted), identical copies in the candidate slots
    both read slower than the baseline (the role swap showed it: whichever model was the baseline read
    faster). Balanced rounds run every pair once, so every function runs equally often: the null
    control and an identical candidate read 1 and a 5 % slower candidate is still called slower.
    Negative control: the default round on the same host."""
    costs = {"original": 1 * MS, "null control": 1 * MS, "copy": 1 * MS}
    kw = {"budget_s": 120.0, "jitter": 0.002}
    star = _compare(FavouringHost(jitter=kw["jitter"], swing=0.1), costs, budget_s=kw["budget_s"])
    assert star.null.high < 0.99 and star.candidates["copy"].high < 0.99  # the slot's advantage, read as a cost
    fair = _compare(FavouringHost(jitter=kw["jitter"], swing=0.1), costs, budget_s=kw["budget_s"], balanced=True)
    assert fair.balanced and not star.balanced
    for r in (fair.null, fair.candidates["copy"]):
        assert r.verdict == verdicts.NO_DIFFERENCE and r.low <= 1.0 <= r.high and abs(r.ratio - 1) < 0.01, r
    slower = dict(costs, copy=1.05 * MS)
    s = _compare(FavouringHost(jitter=kw["jitter"], swing=0.1), slower, budget_s=kw["budget_s"], balanced=True)
    assert s.candidates["copy"].verdict == verdicts.SLOWER
