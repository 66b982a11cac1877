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

from normswap.evaluate import throughput
from normswap.evaluate.throughput import SpeedConfig, measure_speed

COST = 1e-3  # virtual seconds every forward call takes
DELAY = 50e-3  # virtual seconds added to each forward call of the slowed model


def test_forward_speed_follows_a_known_slowdown(monkeypatch):
    clock = VirtualClock()
    monkeypatch.setattr(throughput, "time", clock)
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


NORM_COST = 1e-4  # virtual seconds each norm-layer call takes


def _norms_cost(model, clock, seconds):
    from normswap.model_facts import norm_modules

    for _, module in norm_modules(model):
        module.register_forward_pre_hook(lambda module, args, s=seconds: clock.advance(s))


def test_time_in_norms_follows_the_norm_layers_not_the_forward(monkeypatch):
    """The norm time is the norm layers' own work, timed by the instrument with the null control: a
    model whose norms cost half is credited half the norm time ("lower", and the 7-64 % claim
    reproduced); a model slowed everywhere *but* its norms keeps the same norm time (its claim not
    reproduced) and only its share of the forward falls; the twin is no difference."""
    from normswap.evaluate.speed_intervals import ratio_intervals
    from normswap.report.claims import claim_verdict

    clock = VirtualClock()
    monkeypatch.setattr(throughput, "time", clock)
    base = tiny_model("gpt2")  # 2 blocks × (ln_1, ln_2) + ln_f: 5 norm calls a forward
    twin, lighter, elsewhere = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    for model in (base, twin, lighter, elsewhere):
        model.register_forward_pre_hook(lambda module, args: clock.advance(COST))
    for model in (base, twin, elsewhere):
        _norms_cost(model, clock, NORM_COST)
    _norms_cost(lighter, clock, NORM_COST / 2)
    elsewhere.register_forward_pre_hook(lambda module, args: clock.advance(DELAY))
    cfg = SpeedConfig(batch_size=2, seq_len=16, repeats=25, warmup=1, min_time=0.0, kinds=("norm_share",))
    run = throughput.measure_speed_run(
        [("base", base), ("lighter", lighter), ("elsewhere", elsewhere)], cfg, null_control=("twin", twin)
    )
    out, null = run["models"], run["null_control"]
    assert set(out["base"]["tokens_per_second"]) == {"forward"}  # the share's denominator, timed alongside
    norm_ms = {name: out[name]["norm_time"]["norm_ms_per_forward"] for name in out}
    assert norm_ms["base"] == pytest.approx(5 * NORM_COST * 1e3, rel=1e-9)  # the replay, not the forward
    assert norm_ms["lighter"] == pytest.approx(norm_ms["base"] / 2, rel=1e-9)
    assert norm_ms["elsewhere"] == pytest.approx(norm_ms["base"], rel=1e-9)
    assert null["norm_time"]["norm_ms_per_forward"] == pytest.approx(norm_ms["base"], rel=1e-9)
    share = {name: out[name]["norm_time_share"] for name in out}
    assert share["base"] == pytest.approx(5 * NORM_COST / (COST + 5 * NORM_COST), rel=1e-9)
    assert share["elsewhere"] == pytest.approx(5 * NORM_COST / (COST + DELAY + 5 * NORM_COST), rel=1e-9)

    rows = {name: {"name": name, **s} for name, s in out.items()}
    null_ivs = ratio_intervals({"name": "twin", **null}, rows["base"])
    assert null_ivs["norm_ms_per_forward"]["verdict"] == "no measurable difference"
    ivs = {name: ratio_intervals(rows[name], rows["base"], null_ivs)["norm_ms_per_forward"] for name in rows}
    assert ivs["base"] is None
    assert ivs["lighter"]["median"] == pytest.approx(0.5, rel=1e-9) and ivs["lighter"]["verdict"] == "lower"
    assert ivs["elsewhere"]["median"] == pytest.approx(1.0, rel=1e-9)
    assert ivs["elsewhere"]["verdict"] == "no measurable difference"
    # the quoted claim (at least 7 % less time in norms), both ways
    assert claim_verdict(ivs["lighter"], at_most=0.93) == "reproduced"
    assert claim_verdict(ivs["elsewhere"], at_most=0.93) == "not reproduced"
