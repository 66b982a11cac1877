"""Keep an exact conversion exact while it is fine-tuned (``finetune --keep-centred``, the default).

An exact conversion computes LayerNorm with RMSNorm because every tensor that writes the residual
stream was centred: the stream is zero-mean, and on a zero-mean vector the two norms agree. An
optimizer step moves those tensors off that subspace, and the fine-tuned model is then an RMSNorm
model that no LayerNorm computes: ``export --format stock`` fails verification. So after each
optimizer step the tensors convert centred are projected back (their per-output mean subtracted
over the d_model axis, the layer scales convert set to ones set back to ones): a projected
gradient step onto the subspace where the model still equals a LayerNorm model.

Which tensors, and along which axis, is what convert recorded in the checkpoint's config
(``normswap.stream_writers``, convert/plan.py); nothing is re-derived here.
"""

from __future__ import annotations

import torch

from normswap.convert.stream_record import stream_writers
from normswap.errors import NormswapError


class Centring:
    """The projection onto the zero-mean stream: call it after every optimizer step."""

    def __init__(self, tensors: list[tuple[str, torch.nn.Parameter, int]], unit: list[tuple[str, torch.nn.Parameter]]):
        self.tensors, self.unit = tensors, unit

    @torch.no_grad()
    def __call__(self) -> None:
        for _, p, dim in self.tensors:
            p.sub_(p.mean(dim=dim, keepdim=True, dtype=torch.float64).to(p.dtype))
        for _, p in self.unit:
            p.fill_(1.0)

    def describe(self) -> dict:
        """What the fine-tune's manifest records about it."""
        return {"zero_mean_tensors": len(self.tensors), "unit_scales": len(self.unit)}


def keep_centred(model, config, *, enabled: bool, distributed_type: str = "NO") -> Centring | None:
    """The projection for ``model`` (before any wrapping), or None when there is nothing to keep:
    not an exact conversion, or ``--no-keep-centred``. Refuses, in one line, what it cannot do."""
    record = stream_writers(getattr(config, "normswap", None))
    if record is None or not enabled:
        return None
    if not record:
        raise NormswapError(
            "this exact conversion does not record its residual-stream writers (converted by an older normswap): "
            "reconvert it to fine-tune it exportably, or pass --no-keep-centred (then export it with --format onnx)"
        )
    if "FSDP" in str(distributed_type).upper():
        raise NormswapError(
            "--keep-centred needs whole weight matrices, which FSDP shards: run under torchrun (DDP) or one process, "
            "or pass --no-keep-centred (then export it with --format onnx)"
        )
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [k for k in [*record.get("zero_mean", {}), *record.get("unit_scales", [])] if k not in params]
    if missing:
        raise NormswapError(
            f"the conversion record names {missing[0]}, which the model does not have: "
            "reconvert it, or pass --no-keep-centred"
        )
    tensors = [(k, params[k], int(dim)) for k, dim in record.get("zero_mean", {}).items()]
    unit = [(k, params[k]) for k in record.get("unit_scales", [])]
    return Centring(tensors, unit)
