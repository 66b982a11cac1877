#!/usr/bin/env python3
"""Training step and forward, converted ÷ original, with a null control: the instrument of
`normswap eval speed` (evaluate/throughput.py's ModelBench and compare_kind: interleaved pairs, balanced
rounds, every model on memory of its own) for these two kinds only, so that a GPT-2-small-sized model
fits a few minutes.

    python bench/train_forward_pairs.py ORIGINAL CONVERTED [--batch 8 --seq 128 --budget 120 --json OUT]

A training step is forward + backward + AdamW at lr 0 (the weights stay as loaded); forward is an
inference forward of the same batch. Prints one line per kind; --json writes the comparisons.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from normswap.checkpoint.load import load_model  # noqa: E402
from normswap.evaluate.config import SpeedConfig  # noqa: E402
from normswap.evaluate.throughput import ModelBench, compare_kind, machine_load  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("original")
    ap.add_argument("converted")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--budget", type=float, default=120.0, help="seconds of pairs per kind at most")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kinds", default="train_step,forward")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kinds = tuple(args.kinds.split(","))
    cfg = SpeedConfig(
        repeats=400, warmup=1, kinds=kinds, speed_budget=args.budget, target_halfwidth=0.01, min_time=0.02
    )
    cfg.batch_size, cfg.seq_len = args.batch, args.seq
    specs = {"original": args.original, "converted": args.converted, "null control": args.original}
    benches = [ModelBench(name, load_model(spec).eval(), cfg) for name, spec in specs.items()]
    out = {"batch": args.batch, "seq": args.seq, "threads": args.threads, "load_before": machine_load()}
    for kind in kinds:
        cmp = compare_kind(benches, kind, cfg, "original", "null control", balanced=True)
        c, n = cmp["converted"], cmp.null
        print(
            f"{kind}: converted/original x{c.ratio:.3f} [{c.low:.3f}-{c.high:.3f}] ({c.verdict}); null control "
            f"x{n.ratio:.3f} [{n.low:.3f}-{n.high:.3f}] ({n.verdict}); {cmp.rounds} pairs of {cmp.calls_per_sample} "
            f"call(s), stopped: {cmp.stop_reason} after {cmp.elapsed_s:.0f} s",
            flush=True,
        )
        out[kind] = cmp.to_json(samples=True) | {"converted": c.to_json(), "null control": n.to_json()}
    out["load_after"] = machine_load()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
