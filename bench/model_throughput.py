"""Forward and training-step throughput of a converted model against its LayerNorm original.

A GPT-2-small-shaped model (GPT2Config defaults: 12 layers, 768 wide, 12 heads, 50257 vocab)
is built with random weights, copied, and the copy converted with
normswap.convert.convert_model(mode="exact"). Both are timed on the same random token batches,
alternating original/converted blocks so drift (clocks, other load) hits both equally.

    PYTHONPATH=. python bench/model_throughput.py --device cuda --out bench/results/model.json
    PYTHONPATH=. python bench/model_throughput.py --quick          # tiny model on CPU, seconds

Writes JSON (and a markdown table with --markdown). Exit 1 if the converted model does not
compute what the original does (exact mode must agree to rounding), 2 on a setup error.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device, fn, steps):
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def build(args, device, dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    if args.quick:
        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0, eos_token_id=0)
    else:
        config = GPT2Config()  # GPT-2 small: 12 × 768, 12 heads, 50257 vocab, 1024 positions
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # dropout would differ between the two
    torch.manual_seed(args.seed)
    original = GPT2LMHeadModel(config).to(device=device, dtype=dtype)
    converted = copy.deepcopy(original)
    from normswap.convert import convert_model

    convert_model(converted, mode="exact")
    return config, original, converted


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 (CUDA default) or float32 (CPU default)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per block")
    p.add_argument("--blocks", type=int, default=None, help="alternating original/converted blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model, small batch: a smoke run")
    p.add_argument("--out", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    batch = args.batch or (2 if args.quick else (16 if cuda else 2))
    seq = args.seq or (32 if args.quick else (1024 if cuda else 128))
    steps = args.steps or (3 if args.quick else (10 if cuda else 3))
    blocks = args.blocks or (2 if args.quick else 5)

    from normswap.kernels import backend_for

    config, original, converted = build(args, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)

    result = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "model": "gpt2-small (random init)" if not args.quick else "gpt2-tiny (random init)",
        "layers": config.n_layer, "hidden": config.n_embd, "batch": batch, "seq": seq,
        "tokens_per_step": batch * seq, "steps_per_block": steps, "blocks": blocks,
        "normswap_backend": backend_for(device),
        "norm_modules_converted": sum(type(m).__name__ == "RMSNorm" for m in converted.modules()),
    }

    # the conversion is exact: check it on this very batch before timing anything
    original.eval(), converted.eval()
    with torch.no_grad():
        a = original(ids).logits.float()
        b = converted(ids).logits.float()
    diff = (a - b).abs().max().item()
    scale = a.abs().max().item()
    result["max_abs_logit_diff"] = diff
    result["logit_scale"] = scale
    tol = (2e-2 if dtype != torch.float32 else 1e-4) * max(scale, 1.0)
    result["equivalent"] = diff <= tol

    def fwd(model):
        def f():
            with torch.no_grad():
                model(ids)

        return f

    def train_step(model, opt):
        def f():
            out = model(ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return f

    runs = {}
    for name, model in (("original", original), ("converted", converted)):
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        runs[name] = {"forward": fwd(model), "train_step": train_step(model, opt)}
    samples = {name: {"forward": [], "train_step": []} for name in runs}
    peak = {name: {} for name in runs}
    for name, r in runs.items():  # warm up (kernel compiles, allocator, optimizer state)
        for kind in ("forward", "train_step"):
            r[kind]()
            r[kind]()
    for blk in range(blocks):
        order = ["original", "converted"] if blk % 2 == 0 else ["converted", "original"]
        for kind in ("forward", "train_step"):
            for name in order:
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                samples[name][kind].append(_timed(device, runs[name][kind], steps))
                if cuda:
                    peak[name][kind] = max(peak[name].get(kind, 0), torch.cuda.max_memory_allocated(device))
    tokens = batch * seq
    result["results"] = {}
    for name in runs:
        result["results"][name] = {}
        for kind in ("forward", "train_step"):
            t = statistics.median(samples[name][kind])
            result["results"][name][kind] = {
                "median_s": t, "tokens_per_s": tokens / t,
                "peak_mem_gib": peak[name].get(kind, 0) / 2**30 if cuda else None,
            }
    result["speedup"] = {
        kind: result["results"]["original"][kind]["median_s"] / result["results"]["converted"][kind]["median_s"]
        for kind in ("forward", "train_step")
    }

    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        _write(args.out, text)
    md = markdown(result)
    if args.markdown:
        _write(args.markdown, md)
    sys.stdout.write(md)
    if not result["equivalent"]:
        print(f"converted model differs from the original: max |Δlogit| = {diff:.3g} (tolerance {tol:.3g})", file=sys.stderr)
        return 1
    return 0


def markdown(r) -> str:
    lines = [
        f"{r['model']} on {r['device_name']} ({r['dtype']}), batch {r['batch']} × seq {r['seq']}, "
        f"normswap backend {r['normswap_backend']}, {r['norm_modules_converted']} norms converted; "
        f"max |Δlogit| {r['max_abs_logit_diff']:.3g} (logit scale {r['logit_scale']:.3g})",
        "",
        "| model | forward tok/s | train step tok/s | peak mem fwd / train (GiB) |",
        "|---|---|---|---|",
    ]
    for name in ("original", "converted"):
        x = r["results"][name]
        mem = (f"{x['forward']['peak_mem_gib']:.2f} / {x['train_step']['peak_mem_gib']:.2f}"
               if x["forward"]["peak_mem_gib"] is not None else "—")
        lines.append(f"| {name} | {x['forward']['tokens_per_s']:,.0f} | {x['train_step']['tokens_per_s']:,.0f} | {mem} |")
    lines.append(f"| speedup (converted ÷ original time⁻¹) | {r['speedup']['forward']:.3f}× | {r['speedup']['train_step']:.3f}× | |")
    return "\n".join(lines) + "\n"


def _write(path, text):
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ImportError as e:  # e.g. normswap.convert missing in this build
        print(f"model_throughput: cannot run: {e}", file=sys.stderr)
        sys.exit(2)
