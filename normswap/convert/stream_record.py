"""What keeps an exact conversion exact, read back by the stages that come after convert.

convert/plan.py records, in an exact conversion's config (``normswap.stream_writers``), every
tensor it centred (with the axis the mean is taken over) and the layer scales it set to ones. The
fine-tune projects its steps back onto that record (finetune/centring.py) and the stock export
checks it before verifying (export/stock.py); neither re-derives it from the family data.
"""

from __future__ import annotations

# |mean| / rms above which a recorded tensor no longer counts as zero-mean, per unit of its dtype's
# machine epsilon: a centred tensor stored in 16 bits keeps a mean of a few ulps / sqrt(rows); one
# fine-tuned without the projection drifts by steps x learning rate, orders of magnitude more.
OFF_CENTRE_EPS = 8.0


def stream_writers(block) -> dict | None:
    """The record of an exact conversion's ``normswap`` config block; {} when an older normswap
    converted it without one; None when it is not an exact conversion."""
    if not isinstance(block, dict) or block.get("mode") != "exact":
        return None
    return block.get("stream_writers") or {}


def off_centre(tensors: dict, record: dict) -> tuple[str, float] | None:
    """(key, |mean| / rms) of the recorded tensor farthest from zero-mean, when it is beyond
    rounding (OFF_CENTRE_EPS); None when every recorded tensor (of those in ``tensors``) is centred."""
    import torch

    worst = None
    for key, dim in record.get("zero_mean", {}).items():
        t = tensors.get(key)
        if t is None:
            continue
        t64 = t.double()
        rms = float(t64.pow(2).mean().sqrt())
        ratio = float(t64.mean(dim=int(dim)).abs().max()) / rms if rms > 0 else 0.0
        if ratio > OFF_CENTRE_EPS * torch.finfo(t.dtype).eps and (worst is None or ratio > worst[1]):
            worst = (key, ratio)
    return worst
