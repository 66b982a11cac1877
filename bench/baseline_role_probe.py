"""Probe (#43): does the instrument favour whichever model is its baseline?

After every timed model got memory of its own (evaluate/throughput.own_memory), `bench decode` read an
identical copy of kjv-gpt2 and the null control alike, both ~4 % slower than the baseline. This
times one decode step of three identical models (the original, a copy of its directory, the
original loaded again) by normswap/timing.py in three designs, beside one CPU burner:
  star          the instrument's default round: the baseline in every pair (it runs twice as often);
  lead-in3      the same with three untimed lead-in calls a block instead of one;
  balanced      timing.compare(balanced=True): every pair of functions once a round;
  own-balanced  the same written out here (the first probe, before the instrument had it).
    python bench/baseline_role_probe.py OUT.json [--budget 30] [--designs star,balanced,...]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--budget", type=float, default=30.0)
    ap.add_argument("--designs", default="star,lead-in3,own-balanced,star", help="comma-separated, run in order")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from normswap import timing
    from normswap.checkpoint.load import load_model
    from normswap.evaluate.config import SpeedConfig
    from normswap.evaluate.throughput import ModelBench, machine_load

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    shutil.copytree(Path(__file__).resolve().parents[1] / "normswap/assets/models/kjv-gpt2", tmp / "copy")
    cfg = SpeedConfig(prompt_len=32, new_tokens=2, kinds=("generate",))
    specs = {"original": "normswap:kjv-gpt2", "copy": str(tmp / "copy"), "null": "normswap:kjv-gpt2"}
    benches = {n: ModelBench(n, load_model(s).eval(), cfg) for n, s in specs.items()}
    fns = {n: (lambda b=b: [b._decode_step() for _ in range(5)]) for n, b in benches.items()}
    out = {"load_before": machine_load()["load_average"], "designs": {}}
    for i, design in enumerate(args.designs.split(",")):
        key = f"{i + 1} {design}"
        if design == "own-balanced":
            res = balanced(fns, "original", args.budget)
        else:
            lead = 3 if design == "lead-in3" else 1
            cmp = timing.compare(fns, "original", "null", calls_per_sample=1, budget_s=args.budget,
                                 target_halfwidth=0.002, lead_in=lead, max_pairs=100000,
                                 balanced=design == "balanced")  # fmt: skip
            res = {n: cmp[n].to_json() for n in ("copy", "null")} | {"pairs": cmp.rounds}
        out["designs"][key] = res
        print(key, json.dumps(res), flush=True)
    out["load_after"] = machine_load()["load_average"]
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    shutil.rmtree(tmp)


def balanced(fns, baseline, budget):
    """Every unordered pair once a round, shuffled, order alternating; ratios vs the baseline."""
    import time

    from normswap import timing
    from normswap.stats.bootstrap import median_interval

    names = list(fns)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    got = {n: [] for n in names if n != baseline}
    rng, start, r = random.Random(0), time.perf_counter(), 0
    while time.perf_counter() - start < budget:
        rng.shuffle(pairs)
        for a, b in pairs:
            first, second = (a, b) if r % 2 == 0 else (b, a)
            t = {k: timing._block(fns[k], 1, time.perf_counter, None, 1) for k in (first, second)}
            if baseline in t:
                other = a if b == baseline else b
                got[other].append(t[baseline] / t[other])
        r += 1
    out = {"pairs": r}
    for n, ratios in got.items():
        med, lo, hi = median_interval(ratios)
        out[n] = {"ratio": med, "low": lo, "high": hi, "pairs": len(ratios)}
    return out


if __name__ == "__main__":
    main()
