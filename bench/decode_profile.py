#!/usr/bin/env python3
"""Where a converted model's per-token decode time goes, against its original: a torch.profiler
op-level table of greedy decode at batch 1 through the KV cache (normswap/benchmarks/decode_timing.py's loop),
original and converted profiled in the same run, each after a warm-up, one thread.

    python bench/decode_profile.py ORIGINAL CONVERTED [--steps 64] [--rounds 5] [--rows 25] [--md OUT.md]

Each table row is one op (aten op; normswap's C++ norm is a pybind call the profiler does not
see, only the aten ops it runs inside): calls per token and self CPU µs per token, the median
over ``--rounds`` profiles taken alternately of the two models (a busy machine's stalls land on
single ops of single rounds). The profiler's own per-op overhead inflates every op alike, so the tables
say *which* ops a conversion adds or removes and their share, not absolute speed (normswap bench
decode measures that, without a profiler).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import normswap  # noqa: E402
from normswap.benchmarks.decode_timing import decode_seconds  # noqa: E402


def op_table(model, prompt, steps):
    """{op name: (calls per token, self µs per token)} and the profiled µs per token."""
    decode_seconds(model, prompt, steps)  # warm-up: lazy init, kernel choice, allocator
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode_seconds(model, prompt, steps)
    # the prompt's forward is inside the profile too; subtract it with a prompt-only profile
    with profile(activities=[ProfilerActivity.CPU]) as pre:
        decode_seconds(model, prompt, 0)
    rows = {}
    for ev in prof.key_averages():
        rows[ev.key] = [ev.count, ev.self_cpu_time_total]
    for ev in pre.key_averages():
        if ev.key in rows:
            rows[ev.key][0] -= ev.count
            rows[ev.key][1] -= ev.self_cpu_time_total
    table = {k: (c / steps, us / steps) for k, (c, us) in rows.items() if c > 0}
    return table, sum(us for _, us in table.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("original")
    ap.add_argument("converted")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    models = {
        "original": normswap.load_model(args.original).eval(),
        "converted": normswap.load_model(args.converted).eval(),
    }
    vocab = int(models["original"].config.vocab_size)
    prompt = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0))
    rounds = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            rounds[name].append(op_table(model, prompt, args.steps)[0])
    tables, totals = {}, {}
    for name, seen in rounds.items():
        ops = {k for t in seen for k in t}
        tables[name] = {
            k: (
                statistics.median(t.get(k, (0, 0))[0] for t in seen),
                statistics.median(t.get(k, (0, 0))[1] for t in seen),
            )
            for k in ops
        }
        totals[name] = sum(us for _, us in tables[name].values())
    keys = sorted(
        set(tables["original"]) | set(tables["converted"]),
        key=lambda k: -max(tables["original"].get(k, (0, 0))[1], tables["converted"].get(k, (0, 0))[1]),
    )
    lines = [
        f"## {args.original} vs {args.converted}",
        "",
        f"Greedy decode, batch 1, {args.steps} tokens after an 8-token prompt, 1 thread, median of {args.rounds} "
        "rounds; per token, self CPU time under the profiler (sum of the per-op medians): "
        f"original {totals['original']:.0f} µs, converted {totals['converted']:.0f} µs "
        f"({totals['converted'] / totals['original']:.3f}×).",
        "",
        "| op | original calls | original µs | converted calls | converted µs | Δ µs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    changed = [
        k for k in keys if abs(tables["original"].get(k, (0, 0))[0] - tables["converted"].get(k, (0, 0))[0]) > 1e-9
    ]
    shown = keys[: args.rows] + [k for k in changed if k not in keys[: args.rows]]
    for k in shown:
        oc, ou = tables["original"].get(k, (0, 0))
        cc, cu = tables["converted"].get(k, (0, 0))
        mark = " (calls differ)" if k in changed else ""
        lines.append(f"| `{k}`{mark} | {oc:g} | {ou:.1f} | {cc:g} | {cu:.1f} | {cu - ou:+.1f} |")
    lines.append(
        f"| **all ops** | | {totals['original']:.0f} | | {totals['converted']:.0f} | "
        f"{totals['converted'] - totals['original']:+.0f} |"
    )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        with open(args.md, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
