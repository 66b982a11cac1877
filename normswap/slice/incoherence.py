"""The incoherence rotation: the stream turned by a seeded random orthogonal matrix before int8.

Why. Dynamic int8 quantizes a matmul's input with one scale per tensor (per token row at best), so
a stream coordinate that carries far more energy than the rest sets the scale and every other
coordinate keeps a few of the 256 levels. PCA (slice) makes this worse on purpose: it orders the
kept width by energy, the first coordinates the loudest. A random orthogonal turn spreads every
direction's energy over all coordinates (QuaRot, Ashkboos et al. 2024, with a randomised Hadamard;
a Haar-random orthogonal matrix has the same effect at any width, and the widths here, 767 or 576,
are no powers of two). Folded into the weights like every rotation of slice, it adds nothing at
run time and is exact in exact arithmetic: the float32 model before quantization computes what
the unrotated one computes (``rotation_check.compare`` checks it before a graph is written).

Two cases, one rotation of the RMSNorm stream, no width deleted:

- an exact conversion (not sliced): the slice machinery at k = d − 1 with a random basis of u⊥
  (slice/basis.random_basis): only the all-ones direction goes, which an exact conversion's stream
  never uses, so this *is* the conversion, turned;
- a sliced model: its stream is already k wide and carries no all-ones direction; every tensor the
  sliced config lists in ``slice.stream_dims`` is turned by a k × k random orthogonal Z along those
  axes, and a tied head's adapter (remote_code._SlicedTiedHead) by Zᵀ·R·Z and Zᵀ·g. Its norms have
  no γ of their own (slice refuses one) or a uniform gain, both of which commute with Z.

A LayerNorm original is not rotated: LayerNorm centres its input, which a rotation does not commute
with (convert it first); what cannot be rotated is refused in one line (stream.py's reasons).
"""

from __future__ import annotations

import copy

import torch

from normswap.errors import NormswapError
from normswap.slice import basis as bases
from normswap.slice.rotate import contract

KIND = "random orthogonal (Haar), seeded"


def can_rotate(model) -> bool:
    """Whether ``model`` is a normswap exact conversion or a sliced model (the streams this rotates)."""
    block = getattr(model.config, "normswap", None)
    return (
        isinstance(block, dict)
        and bool(block.get("format_version"))
        and (bool(block.get("slice")) or block.get("mode") == "exact")
    )


def incoherence_rotate(model, seed: int = 0):
    """A new model: ``model`` (an exact conversion or a sliced model, left as it was) with its stream
    turned by a seeded random orthogonal matrix inside its kept width. One line when it cannot be."""
    block = getattr(model.config, "normswap", None)
    if not can_rotate(model):
        raise NormswapError(
            "the incoherence rotation needs an exact normswap conversion or a sliced model; this model's norms "
            "are not RMSNorms over a rotatable stream (a LayerNorm original is quantized without it)"
        )
    if block.get("slice"):
        return _rotate_sliced(model, seed)
    from normswap.slice.model import rotate_model
    from normswap.slice.stream import stream_map

    stream = stream_map(model)
    d = stream.hidden_size
    turned = rotate_model(model, stream, bases.random_basis(d, seed), d - 1, fraction=0.0, basis="random")
    turned.config.normswap["slice"]["incoherence"] = {"kind": KIND, "seed": int(seed)}
    return turned


def _rotate_sliced(model, seed: int):
    block = model.config.normswap
    info = block["slice"]
    k = int(info["width"])
    z = bases.random_orthogonal(k, seed)
    unit = set(block.get("stream_writers", {}).get("unit_scales", []))
    state = model.state_dict()
    new = copy.deepcopy(model)
    params = dict(new.named_parameters(remove_duplicate=False)) | dict(new.named_buffers())
    done = set()
    with torch.no_grad():
        for key, axes in info["stream_dims"].items():
            if key in unit:  # layer scales held at ones: elementwise ones commute with every rotation
                continue
            target = params.get(key)
            if target is None:
                raise NormswapError(f"the sliced config names {key}, which the model does not hold")
            if id(target) in done:  # a tied table listed under two names turns once
                continue
            t = state[key].detach().to(torch.float64).cpu()
            for axis in axes:
                t = contract(t, int(axis), z)
            target.copy_(t.to(target.dtype))
            done.add(id(target))
        adapter = info.get("head_adapter")
        if isinstance(adapter, dict):
            head = new.get_submodule(adapter["head"])
            r = head.adapter.detach().to(torch.float64).cpu()
            g = head.adapter_u.detach().to(torch.float64).cpu()
            head.adapter.copy_((z.T @ r @ z).to(head.adapter.dtype))
            head.adapter_u.copy_((z.T @ g).to(head.adapter_u.dtype))
        for name in block.get("norms", {}):
            w = getattr(new.get_submodule(name), "weight", None)
            if isinstance(w, torch.Tensor) and float(w.max() - w.min()) > 1e-6 * float(w.abs().max()):
                raise NormswapError(f"cannot turn the sliced stream: {name} keeps a γ that is not uniform")
    new.config.normswap = copy.deepcopy(block)
    new.config.normswap["slice"]["incoherence"] = {"kind": KIND, "seed": int(seed)}
    return new


def coordinate_energy(model, batches) -> dict:
    """How the stream's energy (the second moments every norm reads) spreads over its coordinates:
    {max_share, mean_share, max_over_mean}. A planted outlier reads max_over_mean ≫ 1; after the
    incoherence rotation it is near 1 (what the bench and tests show)."""
    from normswap.slice.calibrate import collect_moments

    names = list(block_norms(model))
    moments, _ = collect_moments(model, list(batches), names)
    diag = torch.diagonal(sum(moments.values()))
    share = diag / diag.sum()
    return {
        "max_share": float(share.max()),
        "mean_share": float(share.mean()),
        "max_over_mean": float(share.max() / share.mean()),
    }


def block_norms(model) -> list[str]:
    return list(model.config.normswap.get("norms", {}))
