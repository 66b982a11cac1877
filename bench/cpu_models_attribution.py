#!/usr/bin/env python3
"""Where a converted model's eager time goes beyond the norms: times the original, the converted
model, and the converted model with one of its conversion-added operations taken out (for
timing only: without them it is no longer exact), interleaved, forward and per-token decode.

The operations a conversion can add besides the norms themselves come from the converted
config's ``normswap`` block: runtime centring hooks (``centered_outputs`` / ``centered_inputs``,
where a tied embedding cannot be centred in its weights) and biases added to readers that had
none (``added_biases``, β folded into e.g. an LM head). The ratio of a stripped variant to the
converted model is what that operation costs.

    python bench/cpu_models_attribution.py ORIGINAL CONVERTED [--repeats 25] [--json OUT]

Run under the heavy lock (it measures time). Output: one line per variant and kind with the
median per-call time and the median paired ratio original ÷ variant (≥ 1: variant faster) with
[min, max] over the repeats.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import normswap  # noqa: E402
from normswap.benchmarks.decode_timing import decode_seconds  # noqa: E402


def strip_hooks(model):
    from torch import nn

    from normswap.checkpoint.remote_code import _CenteredEmbedding

    for m in model.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
        if type(m) is _CenteredEmbedding:  # a tied table centres itself (no hook since #26)
            m.__class__ = nn.Embedding
    return model


def strip_added_biases(model, block):
    for name in block.get("added_biases", {}):
        try:
            model.get_submodule(name).bias = None
        except AttributeError:
            pass
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("original")
    ap.add_argument("converted")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    orig = normswap.load_model(args.original).eval()
    conv = normswap.load_model(args.converted).eval()
    block = conv.config.normswap
    variants = {"original": orig, "converted": conv}
    if block.get("centered_outputs") or block.get("centered_inputs"):
        variants["converted without centring hooks"] = strip_hooks(copy.deepcopy(conv))
    if block.get("added_biases"):
        variants["converted without added biases"] = strip_added_biases(copy.deepcopy(conv), block)
    g = torch.Generator().manual_seed(0)
    vocab = int(orig.config.vocab_size)
    batch = torch.randint(0, vocab, (2, 64), generator=g)
    prompt = torch.randint(0, vocab, (1, 8), generator=g)

    def forward(m):
        with torch.inference_mode():
            m(input_ids=batch, use_cache=False)

    def decode(m, steps=31):  # seconds per token
        return decode_seconds(m, prompt, steps) / steps

    for m in variants.values():
        for _ in range(3):
            forward(m)
            decode(m)
    names = list(variants)
    ms = {k: {"forward": [], "decode": []} for k in names}
    for r in range(args.repeats):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            m = variants[k]
            t = time.perf_counter()
            for _ in range(5):
                forward(m)
            ms[k]["forward"].append((time.perf_counter() - t) / 5 * 1e3)
            ms[k]["decode"].append(statistics.mean(decode(m) for _ in range(2)) * 1e3)
    result = {
        "original": args.original,
        "converted": args.converted,
        "repeats": args.repeats,
        "threads": 1,
        "forward": "batch 2 x 64 tokens, inference_mode",
        "decode": "per token, 31 steps after an 8-token prompt",
        "variants": {},
    }
    print(f"# {args.original} vs {args.converted}: {args.repeats} interleaved repeats, 1 thread")
    for kind in ("forward", "decode"):
        for k in names:
            ratios = sorted(o / v for o, v in zip(ms["original"][kind], ms[k][kind]))
            row = {
                "median_ms": statistics.median(ms[k][kind]),
                "ratio_median": statistics.median(ratios),
                "ratio_min": ratios[0],
                "ratio_max": ratios[-1],
                "samples_ms": ms[k][kind],
            }
            result["variants"].setdefault(k, {})[kind] = row
            print(
                f"{kind:8s} {k:34s} {row['median_ms']:8.3f} ms   original/variant {row['ratio_median']:.3f} "
                f"[{row['ratio_min']:.2f}, {row['ratio_max']:.2f}]"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
