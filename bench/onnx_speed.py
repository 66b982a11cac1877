#!/usr/bin/env python3
"""ONNX export of a GPT-2-small-shaped converted model against the exported original, in onnxruntime
on CPU (issue #25): forward throughput, interleaved, with a null control, and whether outputs match.

    python bench/onnx_speed.py --work W --prepare-only      # untimed: models and exports
    flock /work/bench.lock python bench/onnx_speed.py --work W --save bench/results/onnx-gpt2-small-STAMP

Builds the source (bench/make_gpt2_source.py: 12 layers, width 768, random init, kjv tokenizer),
converts it (`normswap convert`), and exports with `normswap export --format onnx`: the original
(LayerNorm -> LayerNormalization), the converted model with RMSNormalization (opset 23) and with
onnxruntime's SimplifiedLayerNormalization. Sessions: onnxruntime CPU, all graph optimisations,
--threads intra-op threads. The null control is the original's graph in a second session
("original_copy"): the spread of its ratio is what the machine's noise alone gives.
Each repeat times every session once (rotated order); a session's number is the median
tokens/s over repeats, a ratio the median of per-repeat ratios to the original.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from saved_result import save_and_print  # noqa: E402


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _timed(sess, ids, calls: int) -> float:
    from normswap.export.onnx import run_session

    t0 = time.perf_counter()
    for _ in range(calls):
        run_session(sess, ids)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="directory for the models (default: a temporary one)")
    ap.add_argument("--tiny", action="store_true", help="2 layers, width 64 (a dry run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds per measurement (sets the calls)")
    ap.add_argument("--save", default=None)
    ap.add_argument(
        "--prepare-only",
        action="store_true",
        help="build, convert and export into --work, then stop (untimed: run it outside the bench lock)",
    )
    args = ap.parse_args(argv)
    import torch

    from normswap.convert.pipeline import convert_checkpoint
    from normswap.export import run_export
    from normswap.export.onnx import run_session, session

    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="onnx-bench-"))
    src, conv = work / "source", work / "converted"
    if not src.exists():
        subprocess.run(
            [sys.executable, str(ROOT / "bench" / "make_gpt2_source.py"), str(src)] + (["--tiny"] if args.tiny else []),
            check=True,
        )
    if not conv.exists():
        convert_checkpoint(str(src), conv)
    graphs = {
        "original": (src, "rmsnormalization"),
        "converted_rmsnormalization": (conv, "rmsnormalization"),
        "converted_simplified": (conv, "simplified"),
    }
    exported = {}
    for name, (path, op) in graphs.items():
        dest = work / f"onnx-{name}"
        if not dest.exists():
            run_export(str(path), dest, "onnx", norm_op=op)
        exported[name] = dest
    if args.prepare_only:
        return 0
    sessions = {name: session(d / "model.onnx", threads=args.threads) for name, d in exported.items()}
    sessions["original_copy"] = session(exported["original"] / "model.onnx", threads=args.threads)  # null control
    vocab = 4096
    ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))

    # outputs: each converted graph against the original graph, on the same ids, in log-probs
    ref = run_session(sessions["original"], ids).double().log_softmax(-1)
    match = {
        name: float((run_session(s, ids).double().log_softmax(-1) - ref).abs().max()) for name, s in sessions.items()
    }

    load_before = _uptime()
    calls = {}
    for name, s in sessions.items():  # warm-up, and calls per measurement
        _timed(s, ids, 2)
        calls[name] = max(1, round(args.min_time / (_timed(s, ids, 1))))
    names = list(sessions)
    samples = {n: [] for n in names}
    for r in range(args.repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            samples[n].append(ids.numel() * calls[n] / _timed(sessions[n], ids, calls[n]))
    load_after = _uptime()
    base = samples["original"]
    rows = {}
    for n in names:
        ratios = [a / b for a, b in zip(samples[n], base)]
        rows[n] = {
            "tokens_per_second": statistics.median(samples[n]),
            "ratio_to_original": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "calls_per_measurement": calls[n],
            "max_abs_logprob_diff_vs_original": match[n],
            "samples": samples[n],
        }
    import onnxruntime

    result = {
        "what": "onnxruntime CPU forward throughput of ONNX exports (normswap export --format onnx), GPT-2-small shape",
        "command": "flock /work/bench.lock python bench/onnx_speed.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "shape": "tiny (2 layers, width 64)"
        if args.tiny
        else "GPT-2 small (12 layers, width 768, 12 heads, vocab 4096)",
        "threads": args.threads,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "repeats": args.repeats,
        "onnxruntime": onnxruntime.__version__,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "uptime_before": load_before,
        "uptime_after": load_after,
        "norm_nodes": {
            n: (__import__("json").loads((exported[n] / "normswap_manifest.json").read_text())["export"]["norm_nodes"])
            for n in exported
        },
        "models": rows,
    }
    md = [
        f"# ONNX export speed (onnxruntime {onnxruntime.__version__}, CPU, {args.threads} threads)",
        "",
        f"{result['shape']}; forward of batch {args.batch} x {args.seq_len} tokens; "
        f"{args.repeats} interleaved repeats; "
        "ratio = median of per-repeat ratios to the original's graph [min-max]; `original_copy` is the null control "
        "(the same graph in a second session).",
        "",
        f"Load: before `{load_before}`; after `{load_after}`",
        "",
        "| graph | norm nodes | tokens/s | ratio to original | max abs Δ log-prob vs original |",
        "|---|---|---:|---:|---:|",
    ]
    for n in names:
        row = rows[n]
        nodes = result["norm_nodes"].get(n if n != "original_copy" else "original")
        md.append(
            f"| {n} | {', '.join(f'{k} x{v}' for k, v in nodes.items())} | {row['tokens_per_second']:,.0f} | "
            f"{row['ratio_to_original']:.3f} [{row['ratio_min']:.3f}-{row['ratio_max']:.3f}] | "
            f"{row['max_abs_logprob_diff_vs_original']:.2g} |"
        )
    md.append("")
    return save_and_print(args.save, result, "\n".join(md) + "\n")


if __name__ == "__main__":
    sys.exit(main())
