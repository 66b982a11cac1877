"""Probe (not a bench command): does the eval forward decide on a slow host, by batch and threads?

kjv-gpt2 original against its exact conversion (made by `normswap demo --out /tmp/demo-new`), with
the original loaded a second time as the null control, timed by normswap.evaluate.speed (the eval
report's code) for the forward alone: `python3 forward_probe.py BATCH BUDGET_S THREADS`.
"""

import json
import sys
import time

import torch

import normswap
from normswap.evaluate.config import SpeedConfig
from normswap.evaluate.speed import measure_speed_run

batch, budget, threads = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
models = [
    ("original", normswap.load_model("normswap:kjv-gpt2")),
    ("exact", normswap.load_model("/tmp/demo-new/models/exact")),
]
cfg = SpeedConfig(batch_size=batch, seq_len=128, speed_budget=budget, min_time=0.02, kinds=("forward",))
start = time.time()
run = measure_speed_run(models, cfg, null_control=("null", normswap.load_model("normswap:kjv-gpt2")))
t = run["timing"]["forward"]
print(
    json.dumps(
        {
            "batch": batch,
            "budget_s": budget,
            "threads": threads,
            "seconds": round(time.time() - start, 1),
            "pairs": t["rounds"],
            "calls_per_block": t["calls_per_sample"],
            "stop": t["stop_reason"],
            "null": run["null_control"]["speed_setup"]["paired"]["forward"],
            "exact": run["models"]["exact"]["speed_setup"]["paired"]["forward"],
            "load": [run["machine"]["load_before"], run["machine"]["load_after"]],
        }
    )
)
