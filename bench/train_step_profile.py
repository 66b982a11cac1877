#!/usr/bin/env python3
"""Where a converted model's training step spends what its original's does not: one fine-tune step
(forward + backward + AdamW) of an original GPT-2-shaped checkpoint and of its exact conversion,
profiled two ways, no clock compared across models:

- Python calls a step (``sys.setprofile``: frames entered), by function, the conversion's extra ones listed;
- ATen operators a step (torch.profiler, CPU): calls by operator, the differences listed.

    python bench/train_step_profile.py ORIGINAL CONVERTED [--batch 8 --seq 128] > out.txt
    python bench/train_step_profile.py DIR/orig DIR/conv --make 4,256,4   # write both first: a GPT-2 of
        4 layers, width 256, 4 heads (GPT-2 small's head size), its norms' γ/β randomised (random init
        has γ=1, β=0, which a conversion drops), converted exactly
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from normswap.checkpoint.load import load_model  # noqa: E402
from normswap.evaluate.kinds import training_loss  # noqa: E402


def _step(model, opt, ids):
    training_loss(model, ids).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def python_calls(model, ids) -> collections.Counter:
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    model.train()
    _step(model, opt, ids)  # lazy state (AdamW's moments, kernel decisions) out of the way
    calls = collections.Counter()

    def prof(frame, event, arg):
        if event == "call":
            code = frame.f_code
            calls[f"{code.co_filename.split('site-packages/')[-1].split('wt-fast/')[-1]}:{code.co_name}"] += 1

    sys.setprofile(prof)
    try:
        _step(model, opt, ids)
    finally:
        sys.setprofile(None)
    return calls


def aten_ops(model, ids) -> tuple[collections.Counter, dict]:
    from torch.profiler import ProfilerActivity, profile

    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    model.train()
    _step(model, opt, ids)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        _step(model, opt, ids)
    counts, self_us = collections.Counter(), collections.Counter()
    for e in p.key_averages():
        counts[e.key] += e.count
        self_us[e.key] += e.self_cpu_time_total
    return counts, self_us


def _diff(a: collections.Counter, b: collections.Counter, top: int) -> list[str]:
    keys = set(a) | set(b)
    rows = sorted(((b[k] - a[k], k) for k in keys if a[k] != b[k]), key=lambda r: (-abs(r[0]), r[1]))
    return [f"  {d:+7d}  {k}  ({a[k]} -> {b[k]})" for d, k in rows[:top]]


def make(original: str, converted: str, shape: str) -> None:
    from normswap.assets.models import write_gpt2_shaped
    from normswap.convert.pipeline import convert_checkpoint

    layers, width, heads = (int(v) for v in shape.split(","))
    write_gpt2_shaped(original, dict(n_layer=layers, n_embd=width, n_head=heads, n_positions=1024))
    model = load_model(original)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                p.copy_(
                    (0.5 + 1.5 * torch.rand(p.shape, generator=gen))
                    if name.endswith("weight")
                    else 0.2 * torch.randn(p.shape, generator=gen) + 0.1
                )
    model.save_pretrained(original)
    convert_checkpoint(original, converted, mode="exact")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("original")
    ap.add_argument("converted")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--make", metavar="LAYERS,WIDTH,HEADS", default=None, help="write ORIGINAL and CONVERTED first")
    args = ap.parse_args(argv)
    if args.make:
        make(args.original, args.converted, args.make)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    models = {"original": load_model(args.original), "converted": load_model(args.converted)}
    vocab = int(models["original"].config.vocab_size)
    ids = torch.randint(0, vocab, (args.batch, args.seq))
    py = {k: python_calls(m, ids) for k, m in models.items()}
    ops = {k: aten_ops(m, ids) for k, m in models.items()}
    print(f"one training step (forward + backward + AdamW), batch {args.batch} x {args.seq}, 1 thread")
    print(f"{args.original} vs {args.converted}")
    print()
    print(
        "Python calls a step: original {}, converted {}".format(
            sum(py["original"].values()), sum(py["converted"].values())
        )
    )
    print("\n".join(_diff(py["original"], py["converted"], args.top)))
    print()
    (oc, ous), (cc, cus) = ops["original"], ops["converted"]
    print(f"ATen operator calls a step: original {sum(oc.values())}, converted {sum(cc.values())}")
    print("\n".join(_diff(oc, cc, args.top)))
    print()
    print("self CPU time a step by operator (one profiled step each; not a paired timing, a pointer):")
    top = sorted(set(ous) | set(cus), key=lambda k: -max(ous[k], cus[k]))[: args.top]
    for k in top:
        print(f"  {k:<45} original {ous[k] / 1e3:9.2f} ms   converted {cus[k] / 1e3:9.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
