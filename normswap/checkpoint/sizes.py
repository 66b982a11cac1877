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
  (``convert.tensor_match.match``) or by transformers' loader; these bounds only keep what is built
  before that check proportional to the weights.

Some sizes build things no weight backs, and are bounded by a declared cap instead:

* ``num_labels`` without an ``id2label`` naming them: transformers builds a dict of that many names
  while it reads the config (1e8 labels: tens of GB), so it is checked in the raw config.json dict,
  before any config class sees it (:func:`check_declared`), at most :data:`MAX_UNNAMED_LABELS`;
* layer counts: some configs build per-layer lists while they are read (``layer_types``), so at
  most :data:`MAX_LAYERS` in any config (the weights bound them again later), and at most
  :data:`MAX_LAYERS_WITHOUT_WEIGHTS` in a model built from a config alone;
* positions (``n_positions``, ``max_position_embeddings``, ...): some models build a table per
  position when they are built (GPT-J and CodeGen: ``n_positions × rotary_dim`` per layer; 2e8
  positions asked for ~25 GB), so at most :data:`MAX_POSITIONS` in any config, and the table a
  config implies (:func:`position_table_bytes`) must fit within the weights' own size or
  :data:`MAX_TABLE_BYTES`, whichever is larger (:func:`check_against_weights`,
  :func:`check_without_weights` for a model built from a config alone).
* the whole model a config alone builds: its parameters counted on the meta device
  (:func:`parameter_count`, nothing allocated) and refused before any is built when the copies a
  command needs would not fit in the memory available (:func:`check_fits`).

The key names are transformers' own config attributes (and their common aliases across
families); they are the generic vocabulary of configs, not facts about one architecture.
"""

from __future__ import annotations

import math
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
    "rotary_dim",
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
POSITION_KEYS = (  # must be positive; not backed by a tensor (rotary), so capped below
    "n_positions",
    "max_position_embeddings",
    "n_ctx",
    "max_positions",
    "max_source_positions",
    "max_target_positions",
)
OTHER_KEYS = POSITION_KEYS
HIDDEN_KEYS = ("n_embd", "hidden_size", "d_model")  # the width of a row of a sinusoidal position table

MAX_CONFIG_BYTES = 16 << 20  # the largest real config.json files (long id2label lists) are ~2 MB
MAX_UNNAMED_LABELS = 1 << 16  # labels without names: no real classifier head comes near
MAX_LAYERS = 1 << 20  # per-layer lists a config builds as it is read stay a few MB (the weights bound layers later)
MAX_LAYERS_WITHOUT_WEIGHTS = 1 << 12  # a model built from a config alone; real models stay under 200
MAX_POSITIONS = 1 << 24  # 16.7M; the longest real contexts are ~10M
MAX_TABLE_BYTES = 1 << 30  # a position table no larger than the weights, or than this


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


def _labels(raw: dict, path: str = ""):
    """(dotted key, num_labels, how many id2label names) of ``raw`` and its nested configs."""
    if "num_labels" in raw:
        names = raw.get("id2label")
        yield f"{path}num_labels", raw["num_labels"], len(names) if isinstance(names, dict) else 0
    for key, value in raw.items():
        if isinstance(value, dict) and key not in ("normswap", "id2label", "label2id"):
            yield from _labels(value, f"{path}{key}.")


def _where(label: str) -> str:
    """The file a label names: a config file itself, or a model directory's config.json."""
    return label if label.endswith(".json") else f"{label}/config.json"


def read_config(path, label: str) -> dict:
    """The raw dict of the config file ``path`` (a model's config.json, or a config file given as
    MODEL), read through normswap.bounded_load (a regular file, at most MAX_CONFIG_BYTES) and
    checked by :func:`check_declared` before any config class is made from it."""
    from normswap import bounded_load

    raw = bounded_load.load_json(path, what="a model's config", max_bytes=MAX_CONFIG_BYTES, follow=True)
    if not isinstance(raw, dict):
        raise NormswapError(f"{_where(label)} is not a JSON object; a model's config is one")
    check_declared(raw, label)
    return raw


def check_declared(raw: dict, label: str) -> None:
    """Refuse, by name, a structural size that is not a whole number above zero, and a count that
    would build a container or table past its cap (run on the raw config.json dict, before any
    config class is made from it)."""
    for where, key, value in _sizes(raw):
        if not _whole_positive(value, zero_ok=key in ZERO_MEANS_DERIVED):
            raise NormswapError(f"{_where(label)}: {where} is {value!r}; it must be a whole number above zero")
        if key in LAYER_KEYS and _largest(value) > MAX_LAYERS:
            raise NormswapError(
                f"{_where(label)}: {where} is {_largest(value):,}; normswap accepts at most {MAX_LAYERS:,} "
                "layers (configs build per-layer lists as they are read)"
            )
        if key in POSITION_KEYS and _largest(value) > MAX_POSITIONS:
            raise NormswapError(
                f"{_where(label)}: {where} is {_largest(value):,}; normswap accepts at most {MAX_POSITIONS:,} "
                "positions (some models build a table per position when they are built)"
            )
    for where, value, named in _labels(raw):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise NormswapError(f"{_where(label)}: {where} is {value!r}; it must be a whole number")
        if value > max(named, MAX_UNNAMED_LABELS):
            raise NormswapError(
                f"{_where(label)}: {where} is {value:,} with {named:,} named in id2label; at most "
                f"{MAX_UNNAMED_LABELS:,} labels without names (transformers builds a name for each "
                "while it reads the config)"
            )
    for name, rec in _norm_records(raw).items():
        size = rec.get("hidden_size") if isinstance(rec, dict) else None
        if not _whole_positive(size):
            raise NormswapError(
                f"{_where(label)}: the normswap block declares norm {name} with hidden_size "
                f"{size!r}; it must be a whole number above zero (the file is damaged)"
            )
    for name, size in _added_biases(raw).items():
        if not _whole_positive(size):
            raise NormswapError(
                f"{_where(label)}: the normswap block declares added_biases[{name!r}] = {size!r}; it must be a "
                "whole number above zero (the file is damaged)"
            )
    _check_slice(raw, label)


def _added_biases(raw: dict) -> dict:
    block = raw.get("normswap")
    added = block.get("added_biases") if isinstance(block, dict) else None
    return added if isinstance(added, dict) else {}


MAX_SLICED_TENSORS = 1 << 16  # tensors a sliced config narrows: the deepest real models list far fewer


def _check_slice(raw: dict, label: str) -> None:
    """A sliced checkpoint's stream width (``normswap.slice``): a whole number above zero and no wider
    than the stream it was cut from (the model is built at the original width and only narrowed),
    its list of narrowed tensors a mapping of bounded length to lists of axes."""
    block = raw.get("normswap")
    info = block.get("slice") if isinstance(block, dict) else None
    if info is None:
        return
    where = f"{_where(label)}: normswap.slice"
    if not isinstance(info, dict):
        raise NormswapError(f"{where} is not an object (the file is damaged)")
    width, hidden = info.get("width"), info.get("hidden_size")
    whole = all(isinstance(v, int) and _whole_positive(v) for v in (width, hidden))  # not a list: one stream
    if not whole or width > hidden:
        raise NormswapError(
            f"{where} declares width {width!r} of hidden_size {hidden!r}; the width must be a whole number "
            "from 1 to the hidden size (the file is damaged)"
        )
    dims = info.get("stream_dims")
    if not isinstance(dims, dict) or len(dims) > MAX_SLICED_TENSORS:
        raise NormswapError(f"{where}.stream_dims must be a mapping of at most {MAX_SLICED_TENSORS:,} tensors")
    for key, axes in dims.items():
        if not (isinstance(axes, list) and 0 < len(axes) <= 8 and all(isinstance(a, int) for a in axes)):
            raise NormswapError(f"{where}.stream_dims[{key!r}] must be a short list of axes, got {axes!r}")
    for name, rec in _norm_records(raw).items():
        if isinstance(rec, dict) and rec.get("hidden_size") != width:
            raise NormswapError(
                f"{where}: norm {name} declares hidden_size {rec.get('hidden_size')!r}, not the sliced width {width}"
            )


def _configs(raw: dict):
    """``raw`` and every config nested in it (a text_config, an encoder ...)."""
    yield raw
    for key, value in raw.items():
        if isinstance(value, dict) and key not in ("normswap", "id2label", "label2id"):
            yield from _configs(value)


def position_table_bytes(raw: dict) -> int:
    """The largest per-position table ``raw`` implies, in float32 bytes: positions × rotary_dim ×
    layers where a ``rotary_dim`` is declared (such models keep a sin/cos table in every attention
    layer), else positions × the hidden width (one sinusoidal table)."""
    best = 0
    for sub in _configs(raw):

        def size(keys, sub=sub):
            return max((_largest(sub[k]) for k in keys if _whole_positive(sub.get(k))), default=0)

        positions = size(POSITION_KEYS)
        if size(("rotary_dim",)):
            row = size(("rotary_dim",)) * max(size(LAYER_KEYS), 1)
        else:
            row = size(HIDDEN_KEYS)
        best = max(best, positions * row * 4)
    return best


def _check_table(raw: dict, budget: int, label: str, backing: str) -> None:
    table = position_table_bytes(raw)
    if table > budget:
        raise NormswapError(
            f"{_where(label)}: its positions imply a position table of {table / 2**30:,.1f} GiB, more than "
            f"{backing}: lower max_position_embeddings/n_positions (or rotary_dim); nothing was built"
        )


def check_without_weights(raw: dict, label: str) -> None:
    """For a model built from a config alone (random initialisation): its position table at most
    MAX_TABLE_BYTES."""
    for where, key, value in _sizes(raw):
        if key in LAYER_KEYS and _largest(value) > MAX_LAYERS_WITHOUT_WEIGHTS:
            raise NormswapError(
                f"{_where(label)}: {where} is {_largest(value):,}; a model built from a config alone has at most "
                f"{MAX_LAYERS_WITHOUT_WEIGHTS:,} layers"
            )
    _check_table(raw, MAX_TABLE_BYTES, label, f"the {MAX_TABLE_BYTES / 2**30:g} GiB normswap builds from a config")


def parameter_count(config, model_class) -> int:
    """The parameters ``model_class.from_config(config)`` would hold, counted on the meta device:
    every tensor is a shape without storage, so a hostile config costs nothing to measure."""
    import copy

    import torch

    with torch.device("meta"):
        model = model_class.from_config(copy.deepcopy(config))
    return sum(p.numel() for p in model.parameters())


def check_fits(need_bytes: int, available_bytes: int, label: str, what: str) -> None:
    """Refuse, before anything is built, ``what`` needing more than the memory available."""
    if need_bytes > available_bytes:
        raise NormswapError(
            f"{_where(label)}: {what} needs ~{need_bytes / 2**30:,.1f} GiB but {available_bytes / 2**30:,.1f} GiB "
            "of memory is available; nothing was built"
        )


def check_against_weights(raw: dict, shapes: dict, label: str) -> None:
    """Refuse sizes the weights (``{tensor name: shape}``, from file headers) cannot back."""
    if not shapes:
        return
    elements = sum(math.prod(int(d) for d in shape) for shape in shapes.values())
    budget = max(4 * elements, MAX_TABLE_BYTES)
    _check_table(
        raw,
        budget,
        label,
        f"the weights' own size in float32 or 1 GiB, whichever is larger ({budget / 2**30:,.1f} GiB)",
    )
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
                f"{_where(label)}: {where} is {value:,} but the weights hold at most {layers} layers: "
                "the config does not belong to these weights; nothing was written"
            )
        if key in WIDTH_KEYS + HEAD_KEYS and value > largest:
            raise NormswapError(
                f"{_where(label)}: {where} is {value:,} but no tensor in the weights has a dimension "
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
                f"{_where(label)}: the normswap block declares norm {name} with hidden_size {size:,} but "
                f"{have}: the config does not belong to these weights; nothing was written"
            )
    _check_block_against_weights(raw, shapes, label, largest)


def _stored_as(shapes: dict, key: str, want: tuple, label: str, field: str) -> None:
    """The tensor ``key`` is stored with shape ``want``: what normswap's loader builds for ``field``."""
    stored = shapes.get(key)
    if stored is None or tuple(int(d) for d in stored) != want:
        have = f"the weights store it as {list(stored)}" if stored is not None else "the weights hold no such tensor"
        raise NormswapError(
            f"{_where(label)}: the normswap block's {field} builds {key} of shape {list(want)}, but {have}: "
            "the config does not belong to these weights; nothing was built"
        )


def _check_block_against_weights(raw: dict, shapes: dict, label: str, largest: int) -> None:
    """Every tensor normswap's loader (checkpoint/remote_code.py) builds from sizes in the normswap block
    alone is stored in the weights at that size: an added bias, and a sliced model's width and head
    adapter (k × k). A few bytes of JSON otherwise asked for any size: 2 GB for one added bias, 160 GB
    for a head adapter 200,000 wide beside weights 32 wide."""
    for name, size in _added_biases(raw).items():
        _stored_as(shapes, f"{name}.bias", (int(size),), label, f"added_biases[{name!r}]")
    block = raw.get("normswap")
    info = block.get("slice") if isinstance(block, dict) else None
    if not isinstance(info, dict):
        return
    width = int(info["width"])  # a whole number from 1 to hidden_size (check_declared)
    if width > largest:
        raise NormswapError(
            f"{_where(label)}: normswap.slice.width is {width:,} but no tensor in the weights has a dimension that "
            f"large (largest: {largest:,}): the config does not belong to these weights; nothing was built"
        )
    for key, axes in info.get("stream_dims", {}).items():
        stored = shapes.get(key)
        if stored is not None and any(not -len(stored) <= a < len(stored) or stored[a] != width for a in axes):
            raise NormswapError(
                f"{_where(label)}: normswap.slice.stream_dims narrows {key} to width {width:,} along axes {axes}, "
                f"but the weights store it as {list(stored)}: the config does not belong to these weights; "
                "nothing was built"
            )
    adapter = info.get("head_adapter")
    if adapter is not None:
        head = adapter.get("head") if isinstance(adapter, dict) else None
        if not isinstance(head, str):
            raise NormswapError(f"{_where(label)}: normswap.slice.head_adapter names no head (the file is damaged)")
        _stored_as(shapes, f"{head}.adapter", (width, width), label, "slice.head_adapter")
        _stored_as(shapes, f"{head}.adapter_u", (width,), label, "slice.head_adapter")


def weight_shapes(directory) -> dict:
    """{tensor name: shape} of a checkpoint directory's weights, without reading them: the safetensors
    headers (safetensors checks each tensor's bytes lie in the file), or for ``.bin`` files their
    memory-mapped tensors, each checked to be backed by bytes the file holds
    (``tensor_source.check_backed``: a 16 KB file of expanded views declaring 3.3B parameters is
    refused here). Empty when the directory holds no weights."""
    from normswap.checkpoint.tensor_source import SafetensorsFiles, bin_shapes, weight_files

    directory = Path(directory)
    fmt, files = weight_files(directory)
    if fmt == "bin":
        return bin_shapes(files, str(directory))
    if fmt != "safetensors":
        return {}
    source = SafetensorsFiles(directory, files)
    try:
        return {k: shape for k, (_, shape) in source.specs.items()}
    finally:
        source.close()
