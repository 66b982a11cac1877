"""Sizes a config.json declares, checked before anything is built or allocated from them.

A model is built from its config before its weights are read, so a config's numbers decide
how much is allocated: ``n_layer: 1000000`` beside weights for 2 layers used to build layers
until memory ran out, a ``normswap`` block declaring a norm of 3e9 elements made ``eval ppl``
ask for 12 GB, and ``n_embd: 0`` ended in a ZeroDivisionError. Two checks, both cheap:

* :func:`check_declared` (every config, when it is read): each structural size -- layers,
  widths, heads, vocabulary, and each norm's ``hidden_size`` in the ``normswap`` block -- must be
  a whole number above zero; it is refused by name otherwise.
* :func:`check_against_weights` (before a model is built for weights): the sizes must be
  backed by the weights' shapes, read from the safetensors headers (nothing allocated): no more
  layers than the weights index, no width, head count or vocabulary larger than the largest
  dimension of any stored tensor, and a norm that stores a weight exactly as wide as it.
  Exact agreement of every shape is checked afterwards, on the meta-device model
  (``convert.inputs.match``) or by transformers' loader; these bounds only keep what is built
  before that check proportional to the weights.

The key names are transformers' own config attributes (and their common aliases across
families); they are the generic vocabulary of configs, not facts about one architecture.
"""

from __future__ import annotations

import re
from pathlib import Path

from normswap.errors import NormswapError

LAYER_KEYS = (
    "n_layer",
    "n_layers",
    "num_layers",
    "num_hidden_layers",
    "encoder_layers",
    "decoder_layers",
    "num_encoder_layers",
    "num_decoder_layers",
)
WIDTH_KEYS = (
    "n_embd",
    "hidden_size",
    "d_model",
    "n_inner",
    "intermediate_size",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "d_ff",
    "vocab_size",
    "head_dim",
    "d_kv",
)
HEAD_KEYS = (
    "n_head",
    "n_heads",
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "multi_query_group_num",
)
OTHER_KEYS = ("n_positions", "max_position_embeddings", "n_ctx")  # must be positive; not backed by a tensor (rotary)


def _sizes(raw: dict, path: str = ""):
    """(dotted key, value) of every structural size in ``raw`` and its nested configs."""
    for key, value in raw.items():
        where = f"{path}{key}"
        if isinstance(value, dict) and key != "normswap":
            yield from _sizes(value, where + ".")
        elif key in LAYER_KEYS + WIDTH_KEYS + HEAD_KEYS + OTHER_KEYS and value is not None:
            yield where, key, value


ZERO_MEANS_DERIVED = ("head_dim",)  # some configs (glm5_next) write 0 for "hidden_size // heads"


def _whole_positive(value, zero_ok: bool = False) -> bool:
    """A whole number above zero, or a list of them (per-stage sizes of vision backbones);
    an integral float (1200.0) counts as whole."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_whole_positive(v, zero_ok) for v in value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (float("inf"),):
        return False
    return float(value).is_integer() and (value > 0 or (zero_ok and value == 0))


def _largest(value) -> int:
    return int(max(value)) if isinstance(value, (list, tuple)) else int(value)


def _norm_records(raw: dict) -> dict:
    block = raw.get("normswap")
    norms = block.get("norms") if isinstance(block, dict) else None
    return norms if isinstance(norms, dict) else {}


def check_declared(raw: dict, label: str) -> None:
    """Refuse, by name, a structural size that is not a whole number above zero."""
    for where, key, value in _sizes(raw):
        if not _whole_positive(value, zero_ok=key in ZERO_MEANS_DERIVED):
            raise NormswapError(f"{label}/config.json: {where} is {value!r}; it must be a whole number above zero")
    for name, rec in _norm_records(raw).items():
        size = rec.get("hidden_size") if isinstance(rec, dict) else None
        if not _whole_positive(size):
            raise NormswapError(
                f"{label}/config.json: the normswap block declares norm {name} with hidden_size "
                f"{size!r}; it must be a whole number above zero (the file is damaged)"
            )


def check_against_weights(raw: dict, shapes: dict, label: str) -> None:
    """Refuse sizes the weights (``{tensor name: shape}``, from file headers) cannot back."""
    if not shapes:
        return
    largest = max((int(d) for shape in shapes.values() for d in shape), default=0)
    indexed: dict = {}
    for name in shapes:
        for m in re.finditer(r"(?:^|\.)(\d+)\.", name):
            prefix = name[: m.start(1)]
            indexed[prefix] = max(indexed.get(prefix, 0), int(m.group(1)) + 1)
    layers = max(indexed.values(), default=0)
    for where, key, value in _sizes(raw):
        value = _largest(value)
        if key in LAYER_KEYS and value > max(layers, 1):
            raise NormswapError(
                f"{label}/config.json: {where} is {value:,} but the weights hold at most {layers} layers: "
                "the config does not belong to these weights; nothing was written"
            )
        if key in WIDTH_KEYS + HEAD_KEYS and value > largest:
            raise NormswapError(
                f"{label}/config.json: {where} is {value:,} but no tensor in the weights has a dimension "
                f"that large (largest: {largest:,}): the config does not belong to these weights; nothing was written"
            )
    for name, rec in _norm_records(raw).items():
        size = int(rec["hidden_size"])
        stored = shapes.get(f"{name}.weight") or shapes.get(f"{name}.bias")
        if (stored is not None and tuple(stored) != (size,)) or size > largest:
            have = (
                f"its stored weight has shape {list(stored)}"
                if stored is not None
                else f"the largest tensor dimension is {largest:,}"
            )
            raise NormswapError(
                f"{label}/config.json: the normswap block declares norm {name} with hidden_size {size:,} but "
                f"{have}: the config does not belong to these weights; nothing was written"
            )


def safetensors_shapes(directory) -> dict:
    """{tensor name: shape} from a checkpoint directory's safetensors headers (nothing else is read);
    empty when it has none (.bin weights are checked by the loader instead)."""
    from normswap.checkpoint.tensor_source import SafetensorsFiles, weight_files

    directory = Path(directory)
    fmt, files = weight_files(directory)
    if fmt != "safetensors":
        return {}
    source = SafetensorsFiles(directory, files)
    try:
        return {k: shape for k, (_, shape) in source.specs.items()}
    finally:
        source.close()
