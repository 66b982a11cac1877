"""`normswap export`: a checkpoint in another format, verified against it before it is published.

    export_checkpoint(src, dest, fmt, ...) -> Path     # the Python API (the CLI and the matrix use it)
    run_export(src, dest, fmt, ...) -> dict             # the same, returning the export record
    verify_export(src, dest, fmt) -> dict               # the publishing check again, on an existing DEST

Formats: ``stock`` (stock.py: the source's own architecture, LayerNorm with γ = 1, β = 0) and
``onnx`` (onnx.py: an ONNX graph whose norms are onnxruntime's fused (Skip)SimplifiedLayerNormalization
or ONNX's RMSNormalization, validated by onnxruntime; a
stock LayerNorm checkpoint exports too, as the baseline).
"""

from __future__ import annotations

from pathlib import Path

from normswap.errors import NormswapError
from normswap.export.norm_ops import DEFAULT_ONNX_NORM_OP, ONNX_NORM_OPS  # noqa: F401  (re-exported for the CLI)

FORMATS = ("stock", "onnx")
# max |Δ log-prob| an export may show against its checkpoint: another runtime (ONNX Runtime) rounds otherwise
EXPORT_TOLERANCE = 1e-4


def run_export(
    src,
    dest,
    fmt: str,
    *,
    force=False,
    untie=False,
    tolerance=EXPORT_TOLERANCE,
    max_shard_size="5GB",
    norm_op=DEFAULT_ONNX_NORM_OP,
    progress=None,
) -> dict:
    """Export the checkpoint ``src`` to ``dest`` in ``fmt``; published only when verified. Returns
    the export record (also in DEST's normswap_manifest.json)."""
    from normswap.export.open_checkpoint import local_model_dir
    from normswap.overlap import check_disjoint
    from normswap.publish import check_output_path, output_lock, publish_dir, staging_dir

    if fmt not in FORMATS:
        raise NormswapError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "onnx":
        from normswap.export.onnx import require_packages

        require_packages()  # before anything is read or locked
    src_dir = local_model_dir(src, "the checkpoint")
    check_disjoint([("the checkpoint", src_dir)], [(f"DEST {dest}", dest)], advice="choose another DEST")
    dest = check_output_path(dest, force=force, reads=[src_dir], label="DEST")
    from normswap.checkpoint.load import optional_tokenizer

    optional_tokenizer(str(src_dir))  # before any work: a refused tokenizer refuses the export, never carried
    with output_lock(dest), staging_dir(dest) as tmp:
        if fmt == "stock":
            from normswap.export.stock import write_stock

            record = write_stock(
                src_dir, tmp, untie=untie, max_shard_size=max_shard_size, tolerance=tolerance, say=progress
            )
        else:
            from normswap.export.onnx import write_onnx

            record = write_onnx(src_dir, tmp, tolerance=tolerance, norm_op=norm_op, say=progress)
        publish_dir(tmp, dest, force=force)
    record["out"] = str(dest)
    return record


def export_checkpoint(src, dest, fmt: str, **kwargs) -> Path:
    """``run_export`` returning DEST's path."""
    return Path(run_export(src, dest, fmt, **kwargs)["out"])


def verify_export(src, dest, fmt: str, *, tolerance=EXPORT_TOLERANCE) -> dict:
    """The check ``run_export`` made before publishing, run again on an existing ``dest``: the stock
    export against ``src`` in float64, or the ONNX graph in onnxruntime against ``src`` in PyTorch.
    Returns {metric, dtype, max_abs_diff, threshold, passed, ...}."""
    from normswap.export.open_checkpoint import local_model_dir, open_checkpoint

    src_dir, dest_dir = local_model_dir(src, "the checkpoint"), Path(dest)
    if fmt == "stock":
        from normswap.export.compare import compare_models

        with (
            open_checkpoint(src_dir, f"the checkpoint {src}") as a,
            open_checkpoint(dest_dir, "the stock export", files_only=True) as b,
        ):
            return compare_models(a, b, tolerance=tolerance)
    if fmt == "onnx":
        from normswap.checkpoint.load import load_model, optional_tokenizer
        from normswap.export.onnx import MODEL_FILE, require_packages, validate

        require_packages()
        tokenizer = optional_tokenizer(str(src_dir))
        return validate(load_model(str(src_dir)), dest_dir / MODEL_FILE, tokenizer, tolerance=tolerance)
    raise NormswapError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")


__all__ = ["FORMATS", "run_export", "export_checkpoint", "verify_export"]
