"""`normswap bench decode`: per-token decode at batch 1, converted ÷ original, with a null control.

Each MODEL is a source (converted here, exact mode, into a temporary directory) or
``SOURCE=CONVERTED`` (a conversion you already have); without MODEL, the shipped models. For
each, the original, the converted model and the original loaded a second time (the null control)
decode greedily through the KV cache, one sequence, interleaved repeats (evaluate/speed.py); the
ratio is converted ÷ original tokens per second with its interval and verdict under the rule of
evaluate/stats.py, beside the null control's own interval.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import click

from normswap.errors import NormswapError

SHIPPED = ("normswap:kjv-gpt2", "normswap:kjv-neox")


def _pair(spec: str, scratch: Path, say) -> tuple[str, str]:
    if "=" in spec:
        source, converted = spec.split("=", 1)
        return source, converted
    from normswap.convert.pipeline import convert_checkpoint

    out = scratch / f"converted-{len(list(scratch.iterdir()))}"
    say(f"converting {spec} (exact) into a temporary directory")
    convert_checkpoint(spec, out, mode="exact")
    return spec, str(out)


def measure_decode(source: str, converted: str, *, repeats: int, new_tokens: int, progress=None) -> dict:
    """One pair's decode benchmark: tokens/s medians, the converted ÷ original ratio and the null
    control's, each an interval of per-repeat paired ratios (evaluate/stats.py)."""
    from normswap.checkpoint.load import load_model
    from normswap.evaluate.config import SpeedConfig
    from normswap.evaluate.speed import measure_speed_run
    from normswap.evaluate.stats import interval

    original = load_model(source).eval()
    again = load_model(source).eval()
    conv = load_model(converted).eval()
    cfg = SpeedConfig(repeats=repeats, warmup=2, new_tokens=new_tokens, prompt_len=8, kinds=("generate",))
    run = measure_speed_run(
        [("original", original), ("converted", conv)], cfg, progress, null_control=("null control", again)
    )
    samples = {name: row["speed_setup"]["samples"]["decode"] for name, row in run["models"].items()}
    samples["null control"] = run["null_control"]["speed_setup"]["samples"]["decode"]
    null = interval(samples["null control"], samples["original"])
    return {
        "source": source,
        "converted": converted,
        "batch": 1,
        "prompt_tokens": 8,
        "decode_tokens": new_tokens - 1,
        "repeats": repeats,
        "machine": run["machine"],
        "decode_tokens_per_second": {k: statistics.median(v) for k, v in samples.items()},
        "converted_over_original": interval(samples["converted"], samples["original"], null),
        "null_control_over_original": null,
        "samples": samples,
    }


def _line(r: dict) -> str:
    c, n = r["converted_over_original"], r["null_control_over_original"]
    tps = r["decode_tokens_per_second"]
    return (
        f"{r['source']}: decode {tps['original']:.1f} -> {tps['converted']:.1f} tokens/s, converted/original "
        f"x{c['median']:.3f} [{c['low']:.3f}-{c['high']:.3f}] ({c['verdict']}); null control x{n['median']:.3f} "
        f"[{n['low']:.3f}-{n['high']:.3f}]; load {r['machine']['load_before']} -> {r['machine']['load_after']}"
    )


@click.command("decode")
@click.argument("models", nargs=-1)
@click.option("--repeats", type=click.IntRange(5), default=30, show_default=True, help="Interleaved repeats per model.")
@click.option(
    "--new-tokens", type=click.IntRange(2), default=64, show_default=True, help="Tokens generated per repeat."
)
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="torch threads (batch 1 decode).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the results here.")
def decode(models, repeats, new_tokens, threads, json_out):
    """Decode speed at batch 1, converted ÷ original, with a null control (MODEL: a source to convert,
    or SOURCE=CONVERTED; default: the shipped models)."""
    import torch  # not at import time: `normswap bench --help` must not load torch

    from normswap.progress import Heartbeat, stderr_lines

    torch.set_num_threads(threads)
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="normswap-bench-decode-") as tmp,
        Heartbeat(stderr_lines("[normswap bench decode] ")) as beat,
    ):
        for spec in models or SHIPPED:
            source, converted = _pair(spec, Path(tmp), beat.say)
            if not Path(converted).is_dir() and not converted.startswith("normswap:"):
                raise NormswapError(f"bench decode: converted model {converted!r} is not a directory")
            results.append(
                measure_decode(source, converted, repeats=repeats, new_tokens=new_tokens, progress=beat.update)
            )
            click.echo(_line(results[-1]))
    if json_out:
        from normswap.publish import atomic_write_json

        atomic_write_json(Path(json_out), {"decode": results, "threads": threads}, indent=1)
