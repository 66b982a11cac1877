#!/usr/bin/env python3
"""What a checkpoint's byte layout costs at run time: the same model's greedy decode with every
weight placed on a 64-byte boundary and with every weight 56 bytes past one, interleaved.

transformers memory-maps safetensors weights, so a tensor's address modulo 64 is its offset in
the file modulo 64; ``safetensors`` pads its header to 8 bytes only, so where the data section
starts modulo 64 is down to the header's length. normswap's shard writer pads to 64 (and puts the
tensors of whole 64-byte multiples first). This script measures why: one model loaded once, its
weights copied into two placements (same bits, only the alignment differs), per-token decode of
a batch through the KV cache timed for each in alternating order.

    python bench/weights_alignment.py MODEL [--repeats 20] [--new-tokens 32] [--save PREFIX]

MODEL is anything `normswap eval` accepts (a directory, normswap:kjv-gpt2). Run under the heavy
lock (it measures time). It also reports where MODEL's own weights sit (address modulo 64).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from normswap.benchmarks.decode_timing import decode_seconds  # noqa: E402
from normswap.benchmarks.saved_result import save_and_print  # noqa: E402
from normswap.checkpoint.load import load_model  # noqa: E402

OFF_LINE = 56  # bytes past a 64-byte boundary: where safetensors' 8-byte padding can leave data


def placed(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``t`` whose first byte sits ``offset`` bytes past a 64-byte boundary."""
    n = t.numel() * t.element_size()
    buf = torch.empty(n + 128, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 64 + offset
    return buf[start : start + n].view(t.dtype).view(t.shape).copy_(t)


def with_weights_at(model, offset: int):
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():  # tied parameters are one object: placed once, still tied
            p.data = placed(p.data, offset)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save", help="write PREFIX.json and PREFIX.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model = load_model(args.model).eval()
    as_loaded = sorted({p.data_ptr() % 64 for p in model.parameters()})
    # a second aligned copy is the null control: how far two identical placements differ
    variants = {
        "aligned (0)": with_weights_at(model, 0),
        f"off a line ({OFF_LINE})": with_weights_at(model, OFF_LINE),
        "aligned (0), second copy": with_weights_at(model, 0),
    }
    del model
    gen = torch.Generator().manual_seed(0)
    vocab = next(iter(variants.values())).config.vocab_size
    ids = torch.randint(0, vocab, (args.batch_size, args.prompt_len), generator=gen)
    names = list(variants)
    for name in names:  # warm-up: allocator, first calls
        decode_seconds(variants[name], ids, args.new_tokens - 1)
    seconds = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds[name].append(decode_seconds(variants[name], ids, args.new_tokens - 1))

    def paired(other):  # time of ``other`` over the first aligned copy's, per repeat
        ratios = [o / a for a, o in zip(seconds[names[0]], seconds[other])]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        return {
            "median": statistics.median(ratios),
            "q1": q1,
            "q3": q3,
            "min": min(ratios),
            "max": max(ratios),
            "per_repeat": ratios,
        }

    steps = args.new_tokens - 1
    result = {
        "command": "python bench/weights_alignment.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s)",
        "load_average": os.getloadavg(),
        "model": args.model,
        "weights_as_loaded_mod_64": as_loaded,
        "setup": {
            "batch_size": args.batch_size,
            "prompt_len": args.prompt_len,
            "decode_steps": steps,
            "repeats": args.repeats,
        },
        "ms_per_step": {name: statistics.median(s) * 1000 / steps for name, s in seconds.items()},
        "time_over_first_aligned": {name: paired(name) for name in names[1:]},
    }
    md = (
        f"# Weight alignment and decode time — {args.model}\n\n"
        f"Command: `{result['command']}`\n\n"
        f"{result['when']} · {result['machine']} · load average {[round(x, 2) for x in result['load_average']]}\n\n"
        f"The model's weights as loaded (memory-mapped) sit at address mod 64 = {as_loaded}. Three copies of the "
        f"same weights, two on 64-byte boundaries and one {OFF_LINE} bytes past them; per-token greedy decode "
        f"(batch {args.batch_size}, prompt {args.prompt_len}, {steps} steps, KV cache), {args.repeats} repeats in "
        "alternating order.\n\n"
        "| weights | ms per decode step (median) |\n|---|---:|\n"
        + "".join(f"| {name} | {ms:.2f} |\n" for name, ms in result["ms_per_step"].items())
        + "\nTime ÷ the first aligned copy's time, paired per repeat (> 1: slower; the second aligned copy is the "
        "null control, what two identical placements differ by):\n\n"
        "| weights | median | quartiles | min, max |\n|---|---:|---|---|\n"
        + "".join(
            f"| {name} | **{r['median']:.3f}** | [{r['q1']:.3f}, {r['q3']:.3f}] | {r['min']:.3f}, {r['max']:.3f} |\n"
            for name, r in result["time_over_first_aligned"].items()
        )
    )
    return save_and_print(args.save, result, md)


if __name__ == "__main__":
    raise SystemExit(main())
