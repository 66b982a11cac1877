"""`normswap bench`: the benchmark commands' options; each calls its benchmark in normswap/benchmarks/.

kernels (norm_kernels.py), decode (decode.py), onnx (onnx_runtime.py), slice (slicing.py), serve (serve.py),
convert (conversion.py). Every one prints its result as one JSON object on stdout with --json and writes it
to a file with --save FILE (decode/onnx/slice once spelled that --json FILE: answered with the new spelling).
"""

from __future__ import annotations

import json
import os
import sys

import click

from normswap.benchmarks.conversion import FAMILIES
from normswap.benchmarks.slicing import DEFAULT_FRACTIONS, GPT2_SMALL_SHAPE
from normswap.cli.options import (
    DtypeChoice,
    OutputFile,
    canonical_dtype,
    device_option,
    json_option,
    onnx_norm_op_option,
    option,
    save_option,
    target_option,
)
from normswap.devices import resolve_device
from normswap.errors import NormswapError
from normswap.publish import atomic_write_text, check_output_file


@click.group()
def bench():
    """Benchmarks: the RMSNorm kernels, and converted or sliced models against their originals (decode,
    onnx, slice, convert)."""


def _run_saving(run, *, save, as_json, models=(), **kwargs):
    """Run a benchmark that writes its result to ``json_out``: to ``save`` when given, and with
    --json also printed on stdout as one JSON object (its per-model lines then go to stderr).

    ``--json FILE`` is the old spelling of --save FILE: a MODEL ending in .json after --json is that
    old spelling, refused with the new one rather than timed as a model."""
    import tempfile
    from pathlib import Path

    old = [m for m in models if as_json and str(m).endswith(".json") and not Path(m).is_dir()]
    if old:
        raise NormswapError(f"--json is a flag (the result as JSON on stdout); write it to a file with --save {old[0]}")
    if not as_json:
        return run(models, json_out=save, echo=click.echo, **kwargs)
    with tempfile.TemporaryDirectory(prefix="normswap-bench-") as tmp:  # private (0700)
        path = save or os.path.join(tmp, "result.json")
        run(models, json_out=path, echo=lambda m: click.echo(m, err=True), **kwargs)
        click.echo(Path(path).read_text().strip())


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
    names = [canonical_dtype(d) for d in text.split(",") if d.strip()]
    bad = [d for d in names if d not in allowed]
    if bad:
        raise NormswapError(f"--dtypes: {', '.join(bad)} not one of {', '.join(allowed)}")
    return names


@bench.command("kernels")
@device_option()
@click.option(
    "--dtypes",
    default=None,
    help="Comma list of float32,float16,bfloat16 (default: float32,bfloat16 on CPU; bfloat16 on CUDA).",
)
@click.option(
    "--shapes",
    default=None,
    help="Comma list of ROWSxHIDDEN (default: CPU 16384x256..2048x4096; CUDA 4096-16384 x 768-8192).",
)
@click.option("--repeats", type=int, default=None, help="The most interleaved pairs per row (default 400; --quick 20).")
@option(
    "--row-seconds",
    "budget",
    aliases=("--budget",),
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
@click.option(
    "--modes",
    type=click.Choice(["fwd", "fwd+bwd", "both"]),
    default="both",
    show_default=True,
    help="Time the forward, the forward+backward, or both.",
)
@click.option("--no-residual", is_flag=True, help="Skip the fused residual-add rows.")
@click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice).")
@click.option("--quick", is_flag=True, help="Two small shapes, fp32, short budgets (a smoke run, seconds).")
@option(
    "--save",
    "out_path",
    aliases=("--out",),
    type=OutputFile(),
    default=None,
    help="Also write the JSON result to this file.",
)
@click.option("--markdown", "md_path", type=OutputFile(), default=None, help="Also write the markdown table here.")
@click.option(
    "--jsonl",
    "jsonl_path",
    type=OutputFile(),
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
    for path, label in ((out_path, "--save"), (md_path, "--markdown")):
        if path:  # before any timing: a directory there, a dangling link, a missing parent is one line
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            check_output_file(path, force=True, label=label)
    from normswap.benchmarks import norm_kernels as bench_kernels

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


@bench.command("decode")
@click.argument("models", nargs=-1)
@click.option(
    "--repeats", type=click.IntRange(5), default=5000, show_default=True, help="The most interleaved pairs per model."
)
@click.option(
    "--new-tokens", type=click.IntRange(1), default=5, show_default=True, help="Decode steps per timed block."
)
@click.option(
    "--cache-tokens", type=click.IntRange(1), default=32, show_default=True, help="KV cache length every step sees."
)
@option(
    "--model-seconds",
    "budget",
    aliases=("--budget",),
    type=click.FloatRange(0),
    default=110.0,
    show_default=True,
    help="Seconds of decode-step pairs per model at most.",
)
@target_option(0.008)
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="torch threads (batch 1 decode).")
@click.option(
    "--replicas",
    type=click.IntRange(1, 16),
    default=3,
    show_default=True,
    help="Copies of each model (the null control's too), each on memory of its own, rotated pair by pair: one copy "
    "a side is one draw of where its memory landed, which moved identical copies 2-4 % apart here.",
)
@click.option(
    "--generate-tokens",
    type=click.IntRange(1),
    default=32,
    show_default=True,
    help="Tokens each timed generate() call produces (greedy, batch 1, after a --cache-tokens prompt).",
)
@option(
    "--generate-seconds",
    "generate_budget",
    aliases=("--generate-budget",),
    type=click.FloatRange(0),
    default=None,
    help="Seconds of generate() pairs per model at most, after the decode steps.  [default: --model-seconds]",
)
@click.option(
    "--generate/--no-generate", "with_generate", default=True, show_default=True, help="Also time generate() calls."
)
@save_option()
@json_option
def decode(
    models,
    repeats,
    new_tokens,
    cache_tokens,
    budget,
    target,
    threads,
    replicas,
    generate_tokens,
    generate_budget,
    with_generate,
    save,
    as_json,
):
    """Decode speed at batch 1, converted ÷ original, with a null control, timed in interleaved pairs
    (MODEL: a source to convert, or SOURCE=CONVERTED; default: the shipped models); then whole generate()
    calls the same way."""
    from normswap.benchmarks.decode import run_decode

    _run_saving(
        run_decode,
        models=models,
        save=save,
        as_json=as_json,
        repeats=repeats,
        new_tokens=new_tokens,
        cache_tokens=cache_tokens,
        budget=budget,
        target=target,
        threads=threads,
        replicas=replicas,
        generate_tokens=generate_tokens,
        generate_budget=(budget if generate_budget is None else generate_budget) if with_generate else None,
    )


# Defaults chosen so that the run decides on this project's busy 2-core machine: at 1 x 128
# tokens a GPT-2-small forward took 0.4 s (median; ~1 s mean beside a burner), so 241 s gave 42 pairs and
# a widest half-width of 0.041 against the 0.01 target (bench/README.md records the run). 32 tokens
# make a pair ~4x cheaper, and one converted graph (the default export) instead of two leaves two pairs a
# round instead of three. `--seq-len 128 --onnx-norm-op simplified --onnx-norm-op rmsnormalization` is
# the earlier setting.


def _option(name: str, kind, default, help: str, **kwargs):
    """A numeric option with its default shown (every tuning knob of this bench has that shape)."""
    return option(name, type=kind, default=default, show_default=True, help=help, **kwargs)


@bench.command("onnx")
@click.argument("models", nargs=-1)
@_option("--repeats", click.IntRange(5), 30, "At least this many pairs.")
@_option(
    "--timing-seconds", click.FloatRange(1.0), 300.0, "Seconds of timing at most (all pairs).", aliases=("--budget",)
)
@_option("--target", click.FloatRange(0.001), 0.01, "Stop once each interval's half-width (null's too) is this.")
@_option("--threads", click.IntRange(1), 1, "onnxruntime intra-op threads.")
@_option(
    "--sessions",
    click.IntRange(1, 8),
    5,
    "onnxruntime sessions per graph (the null control's its own), timed in rotation: one session's memory "
    "placement is a steady bias of ~1-3 %, which N sessions a side average out (fewer when they would not fit "
    "in half the free memory; a GPT-2-small session holds ~0.85 GB).",
)
@_option("--batch", click.IntRange(1), 1, "Sequences per forward.")
@_option("--seq-len", click.IntRange(1), 32, "Tokens per sequence.")
@_option("--min-time", click.FloatRange(0.0), 0.1, "Seconds per timed block (calls calibrated from one; 0: one call).")
@onnx_norm_op_option(multiple=True, default_help="default: simplified (export's default), timed against the original")
@_option(
    "--tolerance",
    click.FloatRange(0.0),
    1e-4,
    "Time nothing unless every converted graph matches the original graph to this max |Δ log-prob|.",
)
@save_option()
@json_option
def onnx(
    models, timing_seconds, repeats, target, threads, sessions, batch, seq_len, min_time, norm_ops, tolerance, save,
    as_json,
):  # fmt: skip
    """ONNX forward speed in onnxruntime (CPU), exported converted ÷ exported original, with a null control
    (MODEL: a source to convert and export, or ORIGINAL_ONNX=CONVERTED_ONNX; default: a GPT-2-small-shaped
    model built from its config)."""
    from normswap.benchmarks.onnx_runtime import run_onnx

    _run_saving(
        run_onnx,
        models=models,
        save=save,
        as_json=as_json,
        repeats=repeats,
        budget=timing_seconds,
        target=target,
        threads=threads,
        sessions=sessions,
        batch=batch,
        seq_len=seq_len,
        min_time=min_time,
        norm_ops=norm_ops,
        tolerance=tolerance,
    )


@bench.command("convert")
@click.option(
    "--params",
    type=click.FloatRange(1),
    default=1.4e9,
    show_default=True,
    help="Parameters of the synthetic checkpoint (its width and depth follow the family's released sizes).",
)
@click.option(
    "--shards", type=click.IntRange(1), default=5, show_default=True, help="Safetensors files it is split in."
)
@click.option(
    "--dtype",
    type=DtypeChoice(["bfloat16", "float16", "float32"]),
    default="bfloat16",
    show_default=True,
    help="Dtype of its weights (bf16/fp16/fp32 accepted).",
)
@click.option(
    "--family",
    type=click.Choice(sorted(FAMILIES)),
    default="gpt_neox",
    show_default=True,
    help="Architecture of the checkpoint.",
)
@click.option(
    "--mode",
    type=click.Choice(["auto", "exact", "approx"]),
    default="auto",
    show_default=True,
    help="convert --mode for both timed conversions.",
)
@click.option(
    "--rounds",
    type=click.IntRange(1),
    default=2,
    show_default=True,
    help="Rounds of the three steps (cp -r, convert --no-verify, convert), interleaved; medians over rounds.",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    default=None,
    help="Existing directory the checkpoint and outputs are built in (default: the temporary directory).",
)
@click.option("--keep", is_flag=True, help="Keep the work directory (its path is in the result).")
@click.option(
    "--save",
    type=OutputFile(),
    default=None,
    help="Also write the JSON result to this file (a NAME without .json: NAME.json and NAME.md).",
)
@click.option(
    "--markdown",
    "md_path",
    type=OutputFile(),
    default=None,
    help="Also write the markdown table to this file.",
)
@json_option
def convert(params, shards, dtype, family, mode, rounds, workdir, keep, save, md_path, as_json):
    """Time `cp -r`, `convert --no-verify` and `convert` of a synthetic sharded checkpoint, each step its
    own process (wall time and peak RSS), interleaved in rounds; prints the table (or --json)."""
    from pathlib import Path

    from normswap.benchmarks.conversion import bench_convert, markdown

    saves = {}
    if save and not save.endswith(".json"):  # the name-without-suffix form bench convert had before
        saves = {Path(save + ".json"): "json", Path(save + ".md"): "md"}
    elif save:
        saves[Path(save)] = "json"
    if md_path:
        saves[Path(md_path)] = "md"
    for path in saves:  # before any work: a directory there, or a file inside the work directory
        check_output_file(path, force=True, reads=[("the work directory", workdir)], label="--save")
    # every setting spelled out (defaults too): the command that reproduces the run
    setting = dict(params=f"{params:g}", shards=shards, dtype=dtype, family=family, mode=mode, rounds=rounds)
    result = bench_convert(
        params=params,
        shards=shards,
        dtype=dtype,
        family=family,
        mode=mode,
        rounds=rounds,
        workdir=workdir,
        keep=keep,
        progress=lambda msg: click.echo(f"normswap bench convert: {msg}", err=True),
        command=" ".join(["normswap bench convert", *(f"--{k} {v}" for k, v in setting.items())]),
    )
    md = markdown(result)
    for path, kind in saves.items():
        # a fresh file renamed into place: a planted link is replaced, not followed
        atomic_write_text(path, json.dumps(result, indent=2) + "\n" if kind == "json" else md)
    click.echo(json.dumps(result, indent=2) if as_json else md, nl=not md.endswith("\n") or as_json)


@bench.command("slice")
@click.option("--fraction", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.25,
              show_default=True, help="Speed: the share of the stream's width deleted.")  # fmt: skip
@click.option("--layers", type=click.IntRange(1), default=GPT2_SMALL_SHAPE["layers"], show_default=True,
              help="Speed: blocks of the GPT-2 shape timed.")  # fmt: skip
@click.option("--width", type=click.IntRange(2), default=GPT2_SMALL_SHAPE["width"], show_default=True,
              help="Speed: its residual stream's width before slicing.")  # fmt: skip
@click.option("--heads", type=click.IntRange(1), default=GPT2_SMALL_SHAPE["heads"], show_default=True,
              help="Speed: its attention heads.")  # fmt: skip
@click.option("--vocab", type=click.IntRange(2), default=GPT2_SMALL_SHAPE["vocab"], show_default=True,
              help="Speed: its vocabulary.")  # fmt: skip
@click.option("--seq-len", type=click.IntRange(1), default=128, show_default=True, help="Forward: tokens at batch 1.")
@click.option("--cache-tokens", type=click.IntRange(1), default=32, show_default=True, help="Decode: the KV cache.")
@click.option("--new-tokens", type=click.IntRange(1), default=5, show_default=True, help="Decode steps a block.")
@option("--forward-seconds", "budget", aliases=("--budget",), type=click.FloatRange(0), default=90.0,
        show_default=True, help="Seconds of forward pairs per comparison (two) at most.")  # fmt: skip
@option("--decode-seconds", "decode_budget", aliases=("--decode-budget",), type=click.FloatRange(0), default=40.0,
        show_default=True, help="Seconds of decode pairs per comparison (two) at most.")  # fmt: skip
@click.option("--repeats", type=click.IntRange(1), default=2000, show_default=True,
              help="Rounds per comparison at most.")  # fmt: skip
@target_option(0.01)
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="torch threads.")
@click.option("--calibration-tokens", type=click.IntRange(1), default=None,
              help="Tokens the rotations are fitted on (speed: 1,024 random ids; quality: 32,768 of the "
              "training split).")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed (calibration ids, random basis).")
@click.option("--quality", is_flag=True,
              help="Perplexity on the held-out books per basis and fraction instead of speed.")  # fmt: skip
@click.option("--model", "models", multiple=True, help="Quality: the models (default: the shipped ones).")
@click.option("--fractions", default=",".join(str(f) for f in DEFAULT_FRACTIONS), show_default=True,
              help="Quality: the fractions, comma-separated.")  # fmt: skip
@click.option("--eval-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="Quality: score this many tokens of the held-out books (0: all of them).")  # fmt: skip
@click.option("--shape-parameters/--no-shape-parameters", default=True, show_default=True,
              help="Quality: also count the parameters of the GPT-2 shape (--layers ...) at every "
              "fraction.")  # fmt: skip
@click.option("--speed-json", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Quality: a speed run's saved result (--save), whose ratios join the curve "
              "(slice_curve.speed).")  # fmt: skip
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), default=None,
              help="Quality: draw slice_curve.png (perplexity, speed by fraction) into this folder.")  # fmt: skip
@save_option()
@json_option
def slice_bench(save, as_json, **options):
    """Sliced models against the exact conversion and the LayerNorm original: speed of a GPT-2 shape
    (forward and decode at batch 1, null controls, the per-layer design beside it), or with --quality the
    perplexity of each basis at each fraction on the shipped models, with parameter counts."""
    from normswap.benchmarks.slicing import run_slice

    _run_saving(lambda models, **kw: run_slice(models=models, **kw), save=save, as_json=as_json, **options)


@bench.command("serve")
@click.option("--part", type=click.Choice(["both", "speed", "quality"]), default="both", show_default=True,
              help="speed: the GPT-2-small shape timed in onnxruntime; quality: held-out perplexity.")  # fmt: skip
@_option("--threads", click.IntRange(1), 1, "onnxruntime intra-op threads (and torch's).")
@_option("--prefill-tokens", click.IntRange(1), 128, "Prefill: the prompt's tokens at batch 1.", aliases=("--seq-len",))
@_option("--past-tokens", click.IntRange(1), 128, "Decode: tokens in the key/value cache each timed step reads.")
@_option("--sessions", click.IntRange(1, 8), 1, "Speed: onnxruntime sessions a graph, rotated (null's its own).")
@click.option("--kinds", default="decode,prefill", show_default=True, help="Speed: which kinds, comma-separated.")
@click.option("--only", default=None, help="Speed: time only these graphs beside the original (comma-separated).")
@click.option("--balanced", is_flag=True, help="Speed: rounds of every pair (timing.compare(balanced=True)).")
@_option("--kind-seconds", click.FloatRange(1.0), 80.0, "Seconds of pairs per kind at most.", aliases=("--budget",))
@_option("--target", click.FloatRange(0.001), 0.01, "Stop once each interval's half-width (null's too) is this.")
@_option("--repeats", click.IntRange(5), 20, "At least this many rounds per kind.")
@_option("--min-time", click.FloatRange(0.0), 0.1, "Seconds per timed block (calls calibrated from one).")
@_option("--fraction", click.FloatRange(0, 1, min_open=True, max_open=True), 0.25, "The sliced variant's fraction.")
@_option("--seed", int, 0, "Seed of the random init, the calibration and the incoherence rotation.")
@click.option("--model", "models", multiple=True, help="Quality: the models (default: the shipped ones).")
@_option("--calibration-tokens", click.IntRange(1), 32768, "Quality: tokens the slice's PCA is fitted on.")
@_option("--eval-tokens", click.IntRange(0), 0, "Quality: score this many held-out tokens (0: all of them).")
@click.option("--graphs", "graphs_dir", type=click.Path(file_okay=False), default=None,
              help="Speed: keep the exported graphs in this folder, and reuse them when it holds them (a timed "
              "run then only times).")  # fmt: skip
@click.option("--save", type=click.Path(dir_okay=False), default=None, help="Also write the JSON result here.")
@json_option
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
def serve(part, threads, prefill_tokens, past_tokens, sessions, kinds, only, balanced, kind_seconds, target, repeats,
          min_time, fraction, seed, models, calibration_tokens, eval_tokens, graphs_dir, save, as_json,
          quiet):  # fmt: skip
    """The served model side by side: original, conversion and sliced, float32 and int8 (conversion and sliced
    int8 with and without the incoherence rotation), in onnxruntime on CPU: decode (one step on the key/value
    cache) and prefill tokens/s of the generation graphs against the original's float32 graph with a null
    control, and held-out perplexity of every variant."""
    from normswap.benchmarks.serve import SPEED_GRAPHS, run_serve

    kind_list = [k.strip() for k in kinds.split(",") if k.strip()]
    bad = [k for k in kind_list if k not in ("decode", "prefill")]
    if bad or not kind_list:
        raise NormswapError(f"--kinds: {', '.join(bad) or 'nothing'} not one of decode, prefill")
    only_list = [n.strip() for n in only.split(",") if n.strip()] if only else None
    bad = [n for n in only_list or () if n not in SPEED_GRAPHS]
    if bad:
        raise NormswapError(f"--only: {', '.join(bad)} not one of {', '.join(SPEED_GRAPHS)}")
    say = (lambda m: None) if quiet else (lambda m: click.echo(f"normswap bench serve: {m}", err=True))
    run_serve(
        part=part, threads=threads, seq_len=prefill_tokens, past_tokens=past_tokens, budget=kind_seconds, target=target,
        min_pairs=repeats, block_s=min_time, fraction=fraction, seed=seed, models=list(models),
        calibration_tokens=calibration_tokens, eval_tokens=eval_tokens, graphs_dir=graphs_dir, kinds=kind_list,
        save=save, as_json=as_json, say=say, echo=click.echo, sessions=sessions, balanced=balanced, only=only_list,
    )  # fmt: skip
