"""`normswap bench onnx`: the ONNX export of a converted model against the exported original, in
onnxruntime on CPU, converted ÷ original forward tokens/s, with a null control.

Each MODEL is a source checkpoint (converted here, exact mode, then both exported with
``normswap export --format onnx``, all in a temporary directory) or ``ORIGINAL=CONVERTED``: two
directories ``normswap export --format onnx`` already wrote. Without MODEL: a GPT-2-small-shaped
model built from its config (random init, the shipped kjv-gpt2 tokenizer; no hub).

Before anything is timed, every converted graph must give the original graph's outputs on the same
token ids (max |Δ log-prob| <= --tolerance), else the command stops with one line. The graphs run
in onnxruntime CPU sessions (evaluate/onnx_model.py) timed interleaved by evaluate/speed.py, with
the original's graph loaded a second time as the null control; each ratio's interval and verdict
follow evaluate/stats.py ("too noisy to tell" when the null control misses its band). The JSON
also records the load average before and after, onnxruntime's graph optimisation level and which
norm ops onnxruntime's optimised graph holds (whether it fused the norms; detected, not assumed).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import click

from normswap.errors import NormswapError

NORM_OP_CHOICES = ("rmsnormalization", "simplified")


def _graphs(spec: str | None, scratch: Path, norm_ops, say) -> tuple[str, dict]:
    """(what was measured, {graph name: ONNX directory}) for one MODEL; "original" first."""
    from normswap.export.onnx import is_onnx_dir

    if "=" in spec:
        original, converted = spec.split("=", 1)
        for path in (original, converted):
            if not is_onnx_dir(path):
                raise NormswapError(f"bench onnx: {path!r} is not a directory `normswap export --format onnx` wrote")
        return spec, {"original": Path(original), "converted": Path(converted)}
    from normswap.convert.pipeline import convert_checkpoint
    from normswap.export import run_export

    if spec is None:  # no MODEL given
        from normswap.assets.models import GPT2_SMALL, write_gpt2_shaped

        say("building a GPT-2-small-shaped model from its config (random init)")
        write_gpt2_shaped(scratch / "source", GPT2_SMALL)
        spec = str(scratch / "source")
    say(f"converting {spec} (exact)")
    convert_checkpoint(spec, scratch / "converted", mode="exact")
    dirs = {"original": scratch / "onnx-original"}
    say("exporting the original to ONNX")
    run_export(spec, dirs["original"], "onnx")
    for op in norm_ops:
        dirs[f"converted ({op})"] = scratch / f"onnx-converted-{op}"
        say(f"exporting the converted model to ONNX ({op})")
        run_export(str(scratch / "converted"), dirs[f"converted ({op})"], "onnx", norm_op=op)
    return spec, dirs


def _match(models: dict, ids, tolerance: float) -> dict:
    """Max |Δ log-prob| of every graph against the original graph on the same ids; one line if any misses."""
    from normswap.export.onnx import run_session

    ref = run_session(models["original"].session, ids).double().log_softmax(-1)
    diffs = {}
    for name, m in models.items():
        got = run_session(m.session, ids).double().log_softmax(-1)
        diffs[name] = float((got - ref).abs().max()) if got.shape == ref.shape else float("inf")
        if not diffs[name] <= tolerance:
            raise NormswapError(
                f"bench onnx: the {name} graph ({m.path}) does not match the original graph: max |Δ log-prob| "
                f"{diffs[name]:.3g} > {tolerance:.3g}; nothing was timed"
            )
    return diffs


def measure_onnx(spec, dirs: dict, *, repeats, threads, batch, seq_len, min_time, tolerance, scratch, progress):
    import torch

    from normswap.evaluate.config import SpeedConfig
    from normswap.evaluate.onnx_model import OnnxModel
    from normswap.evaluate.speed import measure_speed_run
    from normswap.evaluate.stats import interval
    from normswap.export.onnx import OPTIMIZATION_LEVEL, optimised_norm_ops
    from normswap.model_facts import context_length

    models = {name: OnnxModel(d, threads=threads) for name, d in dirs.items()}
    again = OnnxModel(dirs["original"], threads=threads)  # the null control: the same graph, a second session
    vocab = int(models["original"].config.vocab_size)
    seq_len = min(seq_len, context_length(models["original"]) or seq_len)  # as speed.py clamps it
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    diffs = _match(models, ids, tolerance)
    fused = {name: optimised_norm_ops(Path(d) / "model.onnx", scratch) for name, d in dirs.items()}
    cfg = SpeedConfig(
        repeats=repeats, warmup=2, min_time=min_time, batch_size=batch, seq_len=seq_len, kinds=("forward",)
    )
    run = measure_speed_run(list(models.items()), cfg, progress, null_control=("null control", again))
    samples = {name: row["speed_setup"]["samples"]["forward"] for name, row in run["models"].items()}
    samples["null control"] = run["null_control"]["speed_setup"]["samples"]["forward"]
    null = interval(samples["null control"], samples["original"])
    return {
        "model": spec,
        "graphs": {
            name: {
                "path": str(d),
                "norm_nodes": models[name].export.get("norm_nodes"),
                "optimised_norm_ops": fused[name],
                "max_abs_logprob_diff_vs_original": diffs[name],
            }
            for name, d in dirs.items()
        },
        "batch": batch,
        "seq_len": seq_len,
        "repeats": repeats,
        "threads": threads,
        "graph_optimization_level": OPTIMIZATION_LEVEL,
        "machine": run["machine"],
        "forward_tokens_per_second": {k: statistics.median(v) for k, v in samples.items()},
        "over_original": {
            name: interval(samples[name], samples["original"], null) for name in samples if name != "original"
        },
        "null_control_over_original": null,
        "samples": samples,
    }


def _lines(r: dict) -> list[str]:
    tps = r["forward_tokens_per_second"]
    out = [
        f"{r['model']}: onnxruntime CPU, {r['threads']} threads, {r['graph_optimization_level']}, "
        f"batch {r['batch']} x {r['seq_len']} tokens, {r['repeats']} repeats; load "
        f"{r['machine']['load_before']} -> {r['machine']['load_after']}"
    ]
    for name, g in r["graphs"].items():
        ops = ", ".join(f"{k} x{v}" for k, v in g["optimised_norm_ops"].items()) or "no norm op"
        line = f"  {name}: {tps[name]:.1f} tokens/s, runs {ops}"
        if name != "original":
            c = r["over_original"][name]
            line += (
                f"; /original x{c['median']:.3f} [{c['low']:.3f}-{c['high']:.3f}] ({c['verdict']}); "
                f"max |Δ log-prob| {g['max_abs_logprob_diff_vs_original']:.2g}"
            )
        out.append(line)
    n = r["null_control_over_original"]
    out.append(f"  null control: x{n['median']:.3f} [{n['low']:.3f}-{n['high']:.3f}]")
    return out


@click.command("onnx")
@click.argument("models", nargs=-1)
@click.option("--repeats", type=click.IntRange(5), default=15, show_default=True, help="Interleaved repeats.")
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True, help="onnxruntime intra-op threads.")
@click.option("--batch", type=click.IntRange(1), default=1, show_default=True, help="Sequences per forward.")
@click.option("--seq-len", type=click.IntRange(1), default=128, show_default=True, help="Tokens per sequence.")
@click.option("--min-time", type=click.FloatRange(0.0), default=1.0, show_default=True, help="Seconds per measurement.")
@click.option(
    "--onnx-norm-op",
    "norm_ops",
    type=click.Choice(NORM_OP_CHOICES),
    multiple=True,
    help="How the converted model's norms are exported (as `normswap export --onnx-norm-op`); repeatable; "
    "default: both, each timed against the original.",
)
@click.option(
    "--tolerance",
    type=click.FloatRange(0.0),
    default=1e-4,
    show_default=True,
    help="Time nothing unless every converted graph matches the original graph to this max |Δ log-prob|.",
)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the results here.")
def onnx(models, repeats, threads, batch, seq_len, min_time, norm_ops, tolerance, json_out):
    """ONNX forward speed in onnxruntime (CPU), exported converted ÷ exported original, with a null control
    (MODEL: a source to convert and export, or ORIGINAL_ONNX=CONVERTED_ONNX; default: a GPT-2-small-shaped
    model built from its config)."""
    import torch  # not at import time: `normswap bench --help` must not load torch

    from normswap.export.onnx import require_packages
    from normswap.progress import Heartbeat, stderr_lines

    require_packages()
    torch.set_num_threads(threads)
    import onnxruntime

    results = []
    with (
        tempfile.TemporaryDirectory(prefix="normswap-bench-onnx-") as tmp,
        Heartbeat(stderr_lines("[normswap bench onnx] ")) as beat,
    ):
        for i, spec in enumerate(models or (None,)):
            scratch = Path(tmp) / str(i)
            scratch.mkdir()
            name, dirs = _graphs(spec, scratch, norm_ops or NORM_OP_CHOICES, beat.say)
            r = measure_onnx(
                name,
                dirs,
                repeats=repeats,
                threads=threads,
                batch=batch,
                seq_len=seq_len,
                min_time=min_time,
                tolerance=tolerance,
                scratch=scratch,
                progress=beat.update,
            )
            results.append(r)
            click.echo("\n".join(_lines(r)))
    if json_out:
        from normswap.publish import atomic_write_json

        atomic_write_json(
            Path(json_out),
            {"onnx": results, "onnxruntime": onnxruntime.__version__, "torch": torch.__version__},
            indent=1,
        )
