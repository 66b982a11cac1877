"""`normswap bench convert`: copy vs streaming vs in-memory conversion of a synthetic checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import click

from normswap.cli.options import json_option


@click.command("convert")
@click.option("--params", type=float, default=1.4e9, show_default=True, help="Parameter count of the synthetic checkpoint.")
@click.option("--shards", type=int, default=4, show_default=True, help="Number of safetensors files it is written in.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True, help="Its dtype.")
@click.option("--family", type=click.Choice(["gpt_neox", "gpt2", "opt", "bloom", "falcon"]), default="gpt_neox", show_default=True)
@click.option("--mode", type=click.Choice(["auto", "exact", "approx"]), default="auto", show_default=True, help="Conversion mode.")
@click.option("--in-memory/--no-in-memory", "in_memory", default=None,
              help="Also time the in-memory path (default: when it fits in half the available memory).")
@click.option("--workdir", type=click.Path(file_okay=False, exists=True), default=None,
              help="Where to build the checkpoint and outputs (default: the system temp dir).")
@click.option("--keep", is_flag=True, help="Keep the checkpoint and outputs (their directory is printed).")
@click.option("--save", "save", type=click.Path(dir_okay=False), default=None,
              help="Also write the result to SAVE.json and SAVE.md (e.g. bench/results/convert-1.4b).")
@json_option
def convert(params, shards, dtype, family, mode, in_memory, workdir, keep, save, as_json):
    """Time `cp`, streaming and in-memory conversion of a synthetic sharded checkpoint (separate processes)."""
    from normswap.convert.bench import bench_convert, markdown

    say = (lambda m: None) if as_json else (lambda m: click.echo(f"normswap: {m}", err=True))
    result = bench_convert(params=params, shards=shards, dtype=dtype, family=family, mode=mode, workdir=workdir, keep=keep,
                           in_memory="auto" if in_memory is None else in_memory, progress=say)
    md = markdown(result)
    if save:
        Path(save + ".json").write_text(json.dumps(result, indent=2) + "\n")
        Path(save + ".md").write_text(md)
    click.echo(json.dumps(result, indent=2) if as_json else md)


if __name__ == "__main__":  # usable before `normswap bench` registers it
    convert()
