"""Convert a model in memory, in place, with a family already chosen.

The family lookup lives one level up (`apply.convert_model`). `convert_tiny` is the converter the
family check (normswap/architectures/family_check.py) is given: it converts a tiny instance with each
description discovery produces, the same way `normswap convert` computes the tensors.
"""

from __future__ import annotations

import torch

from normswap.checkpoint.tensor_source import StateDict
from normswap.convert.config import ConvertOptions
from normswap.convert.execute import TensorDict, execute, prepare
from normswap.convert.plan import Plan
from normswap.convert.tensor_match import match
from normswap.errors import NormswapError
from normswap.model_facts import is_layernorm, is_rmsnorm


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


def convert_with_family(model, family, options: ConvertOptions, *, dtype=None, device="cpu") -> Plan:
    """Convert ``model`` in place with ``family``, exactly as `normswap convert` computes the
    tensors from files; return the plan."""
    source = StateDict(model.state_dict())
    inputs = match(model, source, type(model).__name__)
    conv = prepare(model, inputs, family, options, dtype)
    sink = TensorDict(conv.specs)
    execute(conv, sink, device=device)
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(sink.tensors, strict=False)
    # tied duplicates are written once; buffers that are not persistent never show up in a state dict
    params = dict(model.named_parameters(remove_duplicate=True))
    missing = [k for k in missing if k in params]
    if missing or unexpected:
        raise NormswapError(
            "internal error: converted weights do not fit the new module tree "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    return conv.plan


def convert_tiny(model, family, mode: str) -> None:
    """``model`` converted in place with ``family`` in ``mode`` ("exact" or "approx"): the converter
    architectures.family_check checks a family with. In exact mode a model with nothing to convert is
    refused first (NormswapError)."""
    if mode == "exact":
        check_convertible(model, model.config)
    convert_with_family(model, family, ConvertOptions(mode=mode))
