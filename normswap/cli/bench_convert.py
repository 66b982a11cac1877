"""`normswap bench convert`: a thin entry point to bench/convert.py (a source checkout's benchmark)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import click

from normswap.errors import NormswapError

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "convert.py"


@click.command(
    "convert", context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}
)
@click.pass_context
def convert(ctx):
    """Time `cp -r`, `convert --no-verify` and `convert` on a synthetic sharded checkpoint
    (bench/convert.py; --help for options)."""
    if not SCRIPT.is_file():
        raise NormswapError(
            f"normswap bench convert runs bench/convert.py from a source checkout; not found at {SCRIPT}"
        )
    spec = importlib.util.spec_from_file_location("normswap_bench_convert", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ctx.exit(module.main(list(ctx.args)))
