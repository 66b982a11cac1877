"""`normswap eval speed` measures the model it names: a known slowdown shows up in full.

A sanity range on the ratio of a model to its own copy (0.2-5) passes for almost any timing code,
a wrong one included. Here one of two identical models is made slower by a known sleep per
forward call; the measured per-call time must grow by that much, and the untouched twin must not.
"""

from __future__ import annotations

import copy
import time

import torch
from helpers import tiny_model

from normswap.evaluate.speed import SpeedConfig, measure_speed

DELAY = 50e-3  # seconds added to each forward call of the slowed model (well above this shared machine's noise)


def test_forward_speed_follows_a_known_slowdown():
    base = tiny_model("gpt2")
    twin, slowed = copy.deepcopy(base), copy.deepcopy(base)
    slowed.register_forward_pre_hook(lambda module, args: time.sleep(DELAY))
    cfg = SpeedConfig(batch_size=2, seq_len=16, repeats=5, warmup=1, min_time=0.0, max_calls=3, kinds=("forward",))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # an OpenMP region waiting on a descheduled thread (a shared machine) costs ms
    try:
        out = measure_speed([("base", base), ("twin", twin), ("slowed", slowed)], cfg)
    finally:
        torch.set_num_threads(threads)
    tokens = cfg.batch_size * cfg.seq_len
    per_call = {name: tokens / out[name]["tokens_per_second"]["forward"] for name in out}
    assert per_call["slowed"] - min(per_call["base"], per_call["twin"]) >= 0.8 * DELAY, per_call
    # negative control: the identical, untouched twin is not slowed by anything like the delay
    assert abs(per_call["twin"] - per_call["base"]) < DELAY / 2, per_call
