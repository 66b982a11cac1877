"""Facts about a model that several stages read, each read one way only.

Which modules are normalisation layers (and of which kind), their ε, how a weight matrix is laid
out, how long a sequence the model takes, its embedding modules. Convert, discovery, the
checkpoint writer, the fine-tune and the evaluation all ask these questions; answering them in
one low module means a new family's spelling (``Conv1D``, ``T5LayerNorm``, ``n_ctx``) is taught
once and every stage agrees.

Norm layers are recognised by class name, not by isinstance: families bring their own classes
(``LlamaRMSNorm``, ``OlmoLayerNorm``, ``T5LayerNorm``), and a converted checkpoint loaded through its
remote code may carry its own fallback class named ``RMSNorm`` rather than
``normswap.modules.RMSNorm``.
"""

from __future__ import annotations

from torch import nn

# config keys that hold the longest sequence a model accepts, in the order families use them
CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "seq_length",
    "max_seq_len",
    "max_sequence_length",
    "max_target_positions",
)
# module attributes that hold a norm's ε
EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps")


# -- normalisation layers -------------------------------------------------------------------------


def norm_kind(module: nn.Module) -> str | None:
    """``"rms"``, ``"layer"``, ``"other"`` (BatchNorm, GroupNorm, ...) or None for a module that is
    not a normalisation layer.

    T5's ``T5LayerNorm`` computes RMSNorm under a LayerNorm name, so it is ``"rms"``.
    """
    name = type(module).__name__
    # "rmsnorm" as one word: a model class named Normswap... must not read as RMS
    if "rmsnorm" in name.lower() or name == "T5LayerNorm":
        return "rms"
    if isinstance(module, nn.LayerNorm) or name.endswith("LayerNorm"):
        return "layer"
    if name.endswith("Norm"):
        return "other"
    return None


def is_norm(module: nn.Module) -> bool:
    return norm_kind(module) is not None


def is_layernorm(module: nn.Module) -> bool:
    """nn.LayerNorm or a family's own LayerNorm class (OlmoLayerNorm, CohereLayerNorm, ...)."""
    return norm_kind(module) == "layer"


def is_rmsnorm(module: nn.Module) -> bool:
    return norm_kind(module) == "rms"


def norm_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) for every norm layer, in module order, outermost only.

    A norm nested in another norm (a wrapper) would be counted twice by timing hooks and trained
    twice, so only the outermost one is kept.
    """
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not is_norm(module):
            continue
        if any(name.startswith(prefix + ".") for prefix, _ in found):
            continue
        found.append((name, module))
    return found


def declared_eps(module: nn.Module) -> float | None:
    """The ε a norm module declares (None when it names none)."""
    for attr in EPS_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def hidden_size_of(module: nn.Module) -> int | None:
    """The width a norm normalises over (None when the module does not say)."""
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


# -- weights ------------------------------------------------------------------------------------


def layout_of(module: nn.Module) -> str | None:
    """How a weight matrix is laid out: ``linear`` is [out, in], GPT-2's ``conv1d`` is [in, out],
    ``embedding`` is [vocab, hidden]; None for any other module."""
    if type(module).__name__ == "Conv1D":
        return "conv1d"
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return None


def input_embeddings(model: nn.Module) -> nn.Module | None:
    return _optional_call(model, "get_input_embeddings")


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The LM head (None where the class has none)."""
    return _optional_call(model, "get_output_embeddings")


def _optional_call(model, method):
    # CLIPModel and others define the accessor but raise from it
    try:
        return getattr(model, method)() if hasattr(model, method) else None
    except (NotImplementedError, AttributeError):
        return None


# -- the config ---------------------------------------------------------------------------------


def sub_config(config, *names):
    """The first of ``config``'s sub-configs named ``names`` (``text_config``, ...), else ``config``."""
    for n in names:
        sub = getattr(config, n, None)
        if sub is not None and hasattr(sub, "to_dict"):
            return sub
    return config


def context_length(model_or_config) -> int | None:
    """The longest sequence the model accepts, from whichever key its family uses (a multimodal
    model's text config first); None when it names none (XLNet's -1 means "no limit")."""
    config = sub_config(getattr(model_or_config, "config", model_or_config), "text_config")
    for attr in CONTEXT_KEYS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
