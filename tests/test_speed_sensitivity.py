"""`normswap eval speed` measures the model it names: a known slowdown shows up in full.

A sanity range on the ratio of a model to its own copy (0.2-5) passes for almost any timing code,
a wrong one included. Here one of three identical models costs a known extra time per forward
call; the measured per-call time must grow by exactly that much, and the untouched twin (the null
control) must measure exactly like the base.

The clock is a virtual one that advances only when a model runs (each forward call adds a known
cost): a wall clock on a shared machine adds noise of the size of any threshold a test could
afford, so a threshold would either flake or be too loose to catch a wrong attribution. What is
tested is the timing code itself: which calls it times, how many, and which model it credits.
"""

from __future__ import annotations

import copy

import pytest
from helpers import VirtualClock, tiny_model

from normswap.evaluate import speed
from normswap.evaluate.speed import SpeedConfig, measure_speed

COST = 1e-3  # virtual seconds every forward call takes
DELAY = 50e-3  # virtual seconds added to each forward call of the slowed model


def test_forward_speed_follows_a_known_slowdown(monkeypatch):
    clock = VirtualClock()
    monkeypatch.setattr(speed, "time", clock)
    base = tiny_model("gpt2")
    twin, slowed = copy.deepcopy(base), copy.deepcopy(base)
    for model in (base, twin, slowed):
        model.register_forward_pre_hook(lambda module, args: clock.advance(COST))
    slowed.register_forward_pre_hook(lambda module, args: clock.advance(DELAY))
    # min_time 2.5 ms: a block is 3 calls of the base (the baseline sets the block for every model,
    # so that each pair compares the same work), so the per-call division is exercised too
    cfg = SpeedConfig(
        batch_size=2, seq_len=16, repeats=25, warmup=1, min_time=2.5 * COST, max_calls=3, kinds=("forward",)
    )
    out = measure_speed([("base", base), ("twin", twin), ("slowed", slowed)], cfg)
    assert {name: out[name]["speed_setup"]["calls_per_measurement"]["forward"] for name in out} == {
        "base": 3,
        "twin": 3,
        "slowed": 3,
    }
    tokens = cfg.batch_size * cfg.seq_len
    per_call = {name: tokens / out[name]["tokens_per_second"]["forward"] for name in out}
    assert per_call["slowed"] == pytest.approx(COST + DELAY, rel=1e-9), per_call
    assert per_call["base"] == pytest.approx(COST, rel=1e-9), per_call
    # null control: the identical, untouched twin measures exactly like the base
    assert per_call["twin"] == pytest.approx(per_call["base"], rel=1e-9), per_call
    # the paired ratios credit the slowdown to the slowed model, and the twin is no difference
    paired = {name: out[name]["speed_setup"]["paired"]["forward"] for name in ("twin", "slowed")}
    assert paired["slowed"]["ratio"] == pytest.approx(COST / (COST + DELAY), rel=1e-9)
    assert paired["slowed"]["verdict"] == "slower" and paired["twin"]["verdict"] == "no measurable difference"
    assert "paired" in out["base"]["speed_setup"] and not out["base"]["speed_setup"]["paired"]
