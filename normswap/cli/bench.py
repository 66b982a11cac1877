"""`normswap bench`: benchmark groups (kernels, decode, onnx, slice; convert lives in its own module)."""

from __future__ import annotations

import importlib

import click


@click.group()
def bench():
    """Benchmarks: the RMSNorm kernels, and converted models against their originals (decode, convert, onnx)."""


def _register():
    from normswap.cli.bench_decode import decode
    from normswap.cli.bench_kernels import kernels
    from normswap.cli.bench_onnx import onnx
    from normswap.cli.bench_slice import slice_bench

    bench.add_command(kernels)
    bench.add_command(decode)
    bench.add_command(onnx)
    bench.add_command(slice_bench)
    # `bench convert` is owned by another module; absent in some builds, so import it guarded
    try:
        mod = importlib.import_module("normswap.cli.bench_convert")
    except ModuleNotFoundError as e:
        if e.name != "normswap.cli.bench_convert":
            raise
        return
    cmd = getattr(mod, "convert", None)
    if cmd is not None:
        bench.add_command(cmd, "convert")


_register()
