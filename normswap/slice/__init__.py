"""`normswap slice`: rotate an exact conversion's residual stream onto its principal directions and
delete the least-used share of its width.

- ``slice_checkpoint(src, out, options=None, *, force=False, device="cpu", progress=None, **fields)``
  (pipeline.py): `normswap slice SRC OUT` end to end; returns the ``--json`` summary.
- ``slice_model(model, calibration_batches, fraction, *, basis="pca", seed=0, round_to=8)``
  (model.py): in memory, on a converted model; returns a ``SliceResult``.
- ``calibration_batches(tokenizer, data_spec, tokens, seq_len, seed)`` (calibrate.py): calibration
  token blocks from the training split of ``data_spec``.
"""

__all__ = ["SliceOptions", "SliceResult", "calibration_batches", "slice_checkpoint", "slice_model"]


def __getattr__(name):
    # Imported on first use, so that `normswap.slice.config` (read by the CLI's --help) does not pull in torch.
    if name == "SliceOptions":
        from normswap.slice.config import SliceOptions

        return SliceOptions
    if name in ("slice_model", "SliceResult"):
        from normswap.slice import model

        return getattr(model, name)
    if name == "calibration_batches":
        from normswap.slice.calibrate import calibration_batches

        return calibration_batches
    if name == "slice_checkpoint":
        from normswap.slice.sliced_checkpoint import slice_checkpoint

        return slice_checkpoint
    raise AttributeError(f"module 'normswap.slice' has no attribute {name!r}")
