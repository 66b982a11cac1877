"""`normswap bench kernels`: time LayerNorm, torch's RMSNorm and normswap's RMSNorm side by side.

A thin entry point: the benchmark itself is bench/norm_kernels.py of the source checkout this normswap
was imported from (benchmarks are not part of the installed package)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import click

from normswap.cli.options import device_option, json_option, target_option
from normswap.devices import resolve_device
from normswap.errors import NormswapError
from normswap.publish import atomic_write_text, check_output_file


def _parse_shapes(text):
    if not text:
        return None
    shapes = []
    for part in text.split(","):
        try:
            rows, hidden = part.lower().strip().split("x")
            shapes.append((int(rows), int(hidden)))
        except ValueError:
            raise NormswapError(f"--shapes: {part!r} is not ROWSxHIDDEN (e.g. 8192x4096)") from None
        if shapes[-1][0] < 1 or shapes[-1][1] < 1:
            raise NormswapError(f"--shapes: {part!r} must have positive sizes")
    return shapes


def _parse_dtypes(text):
    if not text:
        return None
    allowed = ("float32", "float16", "bfloat16")
    names = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in names if d not in allowed]
    if bad:
        raise NormswapError(f"--dtypes: {', '.join(bad)} not one of {', '.join(allowed)}")
    return names


def load_bench_script(name: str):
    """bench/<name>.py of the checkout next to this normswap package, as a module."""
    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    if not path.is_file():
        raise NormswapError(f"benchmarks run from a source checkout: {path} not found")
    key = f"normswap_bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@click.command("kernels")
@device_option()
@click.option(
    "--dtypes", default=None, help="Comma list of float32,float16,bfloat16 (default: fp32,bf16 on CPU; bf16 on CUDA)."
)
@click.option(
    "--shapes",
    default=None,
    help="Comma list of ROWSxHIDDEN (default: CPU 16384x256..2048x4096; CUDA 4096-16384 x 768-8192).",
)
@click.option("--repeats", type=int, default=None, help="The most interleaved pairs per row (default 400; --quick 20).")
@click.option(
    "--budget",
    type=click.FloatRange(0),
    default=None,
    help="Seconds of pairs per row at most (default 4; --quick 0.5): the stop rule's time budget.",
)
@click.option(
    "--deadline",
    type=click.FloatRange(0),
    default=None,
    help="Seconds for the whole benchmark: a row that would end past it (judged by the longest of its "
    "kind so far) is skipped and listed, and the tables of the rows done are written.",
)
@target_option(0.01, "every speed ratio of a row")
@click.option("--modes", type=click.Choice(["fwd", "fwd+bwd", "both"]), default="both", show_default=True)
@click.option("--no-residual", is_flag=True, help="Skip the fused residual-add rows.")
@click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice).")
@click.option("--quick", is_flag=True, help="Two small shapes, fp32, short budgets (a smoke run, seconds).")
@click.option("--out", "out_path", default=None, help="Also write the JSON result to this file.")
@click.option("--markdown", "md_path", default=None, help="Also write the markdown table to this file.")
@click.option(
    "--jsonl",
    "jsonl_path",
    default=None,
    help="Append each case to this file as one JSON line the moment it is measured.",
)
@click.option("--no-tiny", is_flag=True, help="Skip the per-call rows at tiny shapes (1 and 4 rows).")
@json_option
def kernels(
    device, dtypes, shapes, repeats, budget, deadline, target, modes, no_residual, threads, quick, out_path,
    md_path, jsonl_path, no_tiny, as_json,
):  # fmt: skip
    """Median time, GB/s and ratio to LayerNorm for each norm implementation, forward and
    forward+backward (on CUDA also the share of the measured device copy bandwidth), timed in
    interleaved pairs against LayerNorm with a null control (normswap/timing.py)."""
    for path, label in ((out_path, "--out"), (md_path, "--markdown")):
        if path:  # before any timing: a directory there, a dangling link, a missing parent is one line
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            check_output_file(path, force=True, label=label)
    bench_kernels = load_bench_script("norm_kernels")
    dev = resolve_device(device)
    if repeats is not None and repeats < 1:
        raise NormswapError("--repeats must be at least 1")
    mode_list = ("fwd", "fwd+bwd") if modes == "both" else (modes,)
    if threads is not None:
        if threads < 1:
            raise NormswapError("--threads must be at least 1")
        import torch

        torch.set_num_threads(threads)

    def progress(kind, row):
        if kind in ("tiny", "host_path") and not as_json:
            what = f"{row['mode']} per call" if kind == "tiny" else "host path of a CUDA call (kernel stubbed)"
            click.echo(
                f"{row['rows']}x{row['hidden']} {row['dtype']} {what}: "
                + ", ".join(f"{k} {v['median_us']:.2f} µs" for k, v in row["impls"].items()),
                err=True,
            )
        elif not as_json:
            ln = "layer_norm" if row["variant"] == "plain" else "add_layer_norm"
            parts = ", ".join(
                f"{k} {v['median_ms']:.3f} ms ({v['vs_layer_norm']:.2f}×)" for k, v in row["impls"].items() if k != ln
            )
            click.echo(
                f"{row['rows']}x{row['hidden']} {row['dtype']} {row['variant']} {row['mode']}: "
                f"{ln} {row['impls'][ln]['median_ms']:.3f} ms; {parts}; null control x{row['null']['ratio']:.3f} "
                f"[{row['null']['low']:.3f}-{row['null']['high']:.3f}] ({row['null']['verdict']}), "
                f"{row['null']['pairs']} pairs, stopped: {row['null']['stop_reason']}",
                err=True,
            )

    result = bench_kernels.run_benchmark(
        dev,
        dtypes=_parse_dtypes(dtypes),
        shapes=_parse_shapes(shapes),
        repeats=repeats,
        budget=budget,
        deadline=deadline,
        target=target,
        modes=mode_list,
        residual=not no_residual,
        quick=quick,
        progress=progress,
        tiny=not no_tiny,
        jsonl=jsonl_path,
    )
    md = bench_kernels.format_markdown(result)
    for path, text in ((out_path, json.dumps(result, indent=2) + "\n"), (md_path, md)):
        if path:
            atomic_write_text(path, text)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        sys.stdout.write(md)
