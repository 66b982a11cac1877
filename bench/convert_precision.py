"""How far is convert's 16-bit arithmetic from the all-float64 path? (the precision policy in convert/ops.py)

For 16-bit outputs convert computes element-wise in float32 and reduces in float64; the reference
computes everything in float64. Both round once to the output dtype at the end. This script
converts the same models both ways (the real execution path, ``execute.execute`` with and without
``compute=float64``) and counts, over every tensor that the conversion computes (pass-through
tensors are byte copies and cannot differ), how many output elements differ and by how many
units in the last place (ulps) of the output dtype.

Models: the two shipped reference models (trained weights: normswap:kjv-gpt2, normswap:kjv-neox),
each as a bfloat16 and a float16 checkpoint and as float32 weights written to bfloat16, and a
randomly initialised GPT-NeoX at hidden 1024 (the widths of real checkpoints make the
reductions longer).

    python bench/convert_precision.py --save results/convert-precision-20261130T1806Z/convert-precision
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path

import torch

from normswap.architectures import family_for_config
from normswap.benchmarks.saved_result import save_and_print
from normswap.checkpoint.tensor_source import StateDict
from normswap.convert import execute
from normswap.convert.config import ConvertOptions
from normswap.convert.tensor_match import match


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in ulps of their 16-bit dtype (bit patterns mapped to a monotone integer line)."""
    ia, ib = (t.contiguous().view(torch.int16).to(torch.int32) for t in (a, b))
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


def converted(model_factory, out_dtype, compute):
    model = model_factory()
    inputs = match(model, StateDict(model.state_dict()), type(model).__name__)
    conv = execute.prepare(model, inputs, family_for_config(model.config), ConvertOptions(mode="exact"), out_dtype)
    sink = execute.TensorDict(conv.specs)
    execute.execute(conv, sink, compute=compute)
    ops = {
        k: conv.plan.derivations[w.value_key]["op"]
        for k, w in conv.writes.items()
        if w.value_key in conv.plan.derivations
    }
    return {k: sink.tensors[k] for k in ops}, ops


def measure(name, model_factory, out_dtype) -> dict:
    fast, kinds = converted(model_factory, out_dtype, None)
    ref, _ = converted(model_factory, out_dtype, torch.float64)
    by_op: dict = {}
    for key, t in ref.items():
        d = ulps(fast[key], t)
        row = by_op.setdefault(kinds[key], {"elements": 0, "differ": 0, "max_ulps": 0})
        row["elements"] += t.numel()
        row["differ"] += int((d > 0).sum())
        row["max_ulps"] = max(row["max_ulps"], int(d.max()) if d.numel() else 0)
    total = sum(r["elements"] for r in by_op.values())
    differ = sum(r["differ"] for r in by_op.values())
    return {
        "model": name,
        "output_dtype": str(out_dtype).replace("torch.", ""),
        "computed_elements": total,
        "differ": differ,
        "differ_fraction": differ / total if total else 0.0,
        "max_ulps": max(r["max_ulps"] for r in by_op.values()),
        "by_op": by_op,
    }


def cases():
    from transformers import AutoModelForCausalLM

    from normswap.assets.models import model_path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test suite's tiny models
    from helpers import tiny_model

    def shipped(name, dtype):
        return lambda: AutoModelForCausalLM.from_pretrained(str(model_path(name)), dtype=dtype).eval()

    for name in ("kjv-gpt2", "kjv-neox"):
        yield f"{name} (bfloat16 checkpoint)", shipped(name, torch.bfloat16), torch.bfloat16
        yield f"{name} (float16 checkpoint)", shipped(name, torch.float16), torch.float16
        yield f"{name} (float32 weights written as bfloat16)", shipped(name, torch.float32), torch.bfloat16

    def random_neox():
        return tiny_model(
            "gpt_neox",
            0,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=2,
            num_attention_heads=16,
            vocab_size=8192,
        ).to(torch.bfloat16)

    yield "random GPT-NeoX, hidden 1024 (bfloat16 checkpoint)", random_neox, torch.bfloat16


def markdown(result) -> str:
    lines = [
        "# convert: 16-bit arithmetic policy against the all-float64 path",
        "",
        f"{result['date']} · torch {result['torch']} · `{result['command']}`",
        "",
        "Elements of every computed tensor (centred embeddings, folded/centred weights, folded biases); "
        "pass-through tensors are byte copies and excluded.",
        "",
        "| model | output | computed elements | differ | fraction | max ulps |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['model']} | {r['output_dtype']} | {r['computed_elements']:,} | {r['differ']:,} | "
            f"{r['differ_fraction']:.2e} | {r['max_ulps']} |"
        )
    lines += ["", "By op (all models together):", "", "| op | elements | differ | max ulps |", "|---|---:|---:|---:|"]
    merged: dict = {}
    for r in result["results"]:
        for op, row in r["by_op"].items():
            m = merged.setdefault(op, {"elements": 0, "differ": 0, "max_ulps": 0})
            m["elements"] += row["elements"]
            m["differ"] += row["differ"]
            m["max_ulps"] = max(m["max_ulps"], row["max_ulps"])
    for op, m in sorted(merged.items()):
        lines.append(f"| {op} | {m['elements']:,} | {m['differ']:,} | {m['max_ulps']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save", default=None, help="write SAVE.json and SAVE.md")
    args = ap.parse_args(argv)
    results = []
    for name, factory, dtype in cases():
        print(f"convert_precision: {name}", file=sys.stderr, flush=True)
        results.append(measure(name, factory, dtype))
    result = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "command": "python bench/convert_precision.py" + (f" --save {args.save}" if args.save else ""),
        "results": results,
    }
    md = markdown(result)
    return save_and_print(args.save, result, md)


if __name__ == "__main__":
    sys.exit(main())
