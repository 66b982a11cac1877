"""Apply a conversion plan to a model in memory."""

from __future__ import annotations

import torch
from torch import nn

from normswap.architectures import family_for_config
from normswap.checkpoint.remote_code import apply_normswap_structure
from normswap.convert import ops
from normswap.convert.plan import ConvertOptions, Plan, build_plan, is_layernorm, is_rmsnorm
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


def transform_state_dict(plan: Plan, fetch, keys, out_dtype_of) -> dict:
    """New tensors for every output key, from the plan; ``keys`` are the source keys to carry."""
    out = {}
    dropped = set(plan.drop)
    for key in keys:
        if key in dropped and key not in plan.derivations:
            continue
        op = plan.derivations.get(key)
        out[key] = fetch(key) if op is None else ops.compute(op, fetch).to(out_dtype_of(key))
    for key, op in plan.derivations.items():  # new tensors (added biases, reset γ)
        if key not in out:
            out[key] = ops.compute(op, fetch).to(out_dtype_of(key))
    return out


def convert_model(model, *, mode="auto", gamma=None, beta=None, untie=False, family=None, dtype=None) -> Plan:
    """Convert ``model`` (a transformers model with LayerNorms) in place; return the plan.

    Afterwards the model holds normswap RMSNorm modules, ``model.config.normswap`` describes the
    new structure, and ``normswap.checkpoint.write.save_checkpoint`` writes it in a form stock
    transformers reloads. ``dtype`` casts the result (default: keep each tensor's dtype).
    """
    config = model.config
    check_convertible(model, config)
    fam = family if family is not None else family_for_config(config)
    options = ConvertOptions(mode=mode, gamma=gamma, beta=beta, untie=untie)
    plan = build_plan(fam, model, config, options)

    source = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}

    def fetch(key):
        if key in source:
            return source[key]
        if key in plan.aliases and plan.aliases[key] in source:
            return source[plan.aliases[key]]
        raise NormswapError(f"tensor {key} is missing from the model")

    ref = next(iter(source.values()))
    new_sd = transform_state_dict(plan, fetch, list(source), lambda k: (source[k].dtype if k in source else ref.dtype) if dtype is None else dtype)

    with torch.no_grad():
        apply_normswap_structure(model, plan.block)
        if dtype is not None:
            model.to(dtype)
        missing, unexpected = model.load_state_dict(new_sd, strict=False)
        # buffers that are not persistent never show up in a state dict; anything else is a bug
        missing = [k for k in missing if k in dict(model.named_parameters())]
        if missing or unexpected:
            raise NormswapError(f"internal error: converted weights do not fit the new module tree (missing {missing[:3]}, unexpected {unexpected[:3]})")
    plan.block["source_model_type"] = config.model_type
    plan.block["source_class"] = type(model).__name__
    config.normswap = plan.block
    if plan.block["untied"]:
        config.tie_word_embeddings = False
    _assert_no_residual_layernorm(model, plan)
    return plan


def _assert_no_residual_layernorm(model, plan):
    left = {item["module"] for item in plan.block["left_alone"]}
    for name, module in model.named_modules():
        if is_layernorm(module) and name not in left:
            raise NormswapError(f"internal error: LayerNorm {name} survived the conversion")


def count_parameters(model: nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
