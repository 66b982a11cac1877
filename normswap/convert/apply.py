"""Convert a model that is already in memory (the Python API), through the same path as files."""

from __future__ import annotations

import torch

from normswap.architectures import resolve_family
from normswap.convert.execute import TensorDict, execute, prepare
from normswap.convert.inputs import match
from normswap.convert.plan import ConvertOptions, Plan, is_layernorm, is_rmsnorm
from normswap.convert.source import StateDict
from normswap.errors import NormswapError


def check_convertible(model, config) -> None:
    """Refuse models that have nothing to convert, before looking up a family."""
    block = getattr(config, "normswap", None)
    if isinstance(block, dict) and block.get("format_version"):
        raise NormswapError("nothing to convert: this checkpoint was already converted by normswap")
    modules = list(model.modules())
    if not any(is_layernorm(m) for m in modules):
        if any(is_rmsnorm(m) for m in modules):
            raise NormswapError(f"nothing to convert: {type(model).__name__} already uses RMSNorm")
        raise NormswapError(f"nothing to convert: {type(model).__name__} has no LayerNorm")


def convert_model(model, *, mode="auto", gamma=None, beta=None, untie=False, family=None, dtype=None, device="cpu") -> Plan:
    """Convert ``model`` (a transformers model with LayerNorms) in place; return the plan.

    Afterwards the model holds normswap RMSNorm modules, ``model.config.normswap`` describes the
    new structure, and ``normswap.checkpoint.write.save_checkpoint`` writes it in a form stock
    transformers reloads. ``dtype`` casts the result (default: keep each tensor's dtype). The
    tensors are computed exactly as `normswap convert` computes them from files.
    """
    config = model.config
    check_convertible(model, config)
    fam = family if family is not None else resolve_family(config, type(model))
    source = StateDict(model.state_dict())
    inputs = match(model, source, type(model).__name__)
    conv = prepare(model, inputs, fam, ConvertOptions(mode=mode, gamma=gamma, beta=beta, untie=untie), dtype)
    sink = TensorDict(conv.specs)
    execute(conv, sink, device=device)
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(sink.tensors, strict=False)
    # tied duplicates are written once; buffers that are not persistent never show up in a state dict
    params = dict(model.named_parameters(remove_duplicate=True))
    missing = [k for k in missing if k in params]
    if missing or unexpected:
        raise NormswapError(f"internal error: converted weights do not fit the new module tree (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return conv.plan
