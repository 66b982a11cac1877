"""Convert a model that is already in memory (the Python API), through the same path as files."""

from __future__ import annotations

from normswap.architectures.family_check import resolve_family
from normswap.convert.config import ConvertOptions
from normswap.convert.inplace import check_convertible, convert_tiny, convert_with_family
from normswap.convert.plan import Plan

__all__ = ["check_convertible", "convert_model"]


def convert_model(
    model, *, mode="auto", gamma=None, beta=None, untie=False, family=None, dtype=None, device="cpu"
) -> Plan:
    """Convert ``model`` (a transformers model with LayerNorms) in place; return the plan.

    Afterwards the model holds normswap RMSNorm modules, ``model.config.normswap`` describes the
    new structure, and ``normswap.checkpoint.write.save_checkpoint`` writes it in a form stock
    transformers reloads. ``dtype`` casts the result (default: keep each tensor's dtype). The
    tensors are computed exactly as `normswap convert` computes them from files.
    """
    config = model.config
    check_convertible(model, config)
    fam = family if family is not None else resolve_family(config, type(model), convert=convert_tiny)
    options = ConvertOptions(mode=mode, gamma=gamma, beta=beta, untie=untie)
    return convert_with_family(model, fam, options, dtype=dtype, device=device)
