"""Find the normalisation layers of a model, whatever class implements them.

A converted checkpoint loaded through its remote code may carry its own fallback class named
``RMSNorm`` rather than ``normswap.modules.RMSNorm``, and families bring ``LlamaRMSNorm``,
``T5LayerNorm`` and the like; so layers are recognised by class name, not by isinstance.
"""

from __future__ import annotations

from torch import nn


def is_norm_module(module: nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("Norm") or name in ("LayerNorm", "RMSNorm")


def norm_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) for every norm layer, in module order, outermost only.

    A norm nested in another norm (a wrapper) would be counted twice by timing hooks, so only
    the outermost one is kept.
    """
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not is_norm_module(module):
            continue
        if any(name.startswith(prefix + ".") for prefix, _ in found):
            continue
        found.append((name, module))
    return found


def norm_kind(module: nn.Module) -> str:
    name = type(module).__name__
    if "RMS" in name.upper() or name == "T5LayerNorm":
        return "rms"
    if "LayerNorm" in name:
        return "layer"
    return "other"


def hidden_size_of(module: nn.Module) -> int | None:
    for attr in ("normalized_shape", "hidden_size"):
        value = getattr(module, attr, None)
        if isinstance(value, (tuple, list)) and value:
            return int(value[-1])
        if isinstance(value, int):
            return value
    weight = getattr(module, "weight", None)
    if weight is not None:
        return int(weight.shape[-1])
    return None
