"""Where an exact conversion's residual stream is written and read, from what the conversion recorded.

An exact conversion records, in its config's ``normswap`` block, every tensor it centred with the
axis of the mean (``stream_writers.zero_mean``: the writers' weights and biases, the embedding
tables, the stream's bias vectors), the layer scales it set to ones (``unit_scales``), the tables it
centres at run time instead (``centered_outputs``: a table tied to the head) and every norm with
the linears that read it. That record *is* the stream's map: the axis a writer was centred along
is the axis that carries the stream, and a reader takes the stream along its input axis. So the
rotation reads no family file and has no per-architecture code; whatever convert planned (curated
family or discovered), slice rotates.

What cannot be rotated is refused here, in one line, before any work: a norm that kept a γ or β
other than the tied head's final norm (γ does not commute with a rotation), a stream start no
module owns (run-time centring of an input or of a computed embedding), a reader or writer whose
weight normswap cannot lay out, and a conversion that is not exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.model_facts import layout_of, output_embeddings


@dataclass
class StreamMap:
    """The stream of one converted model: every tensor axis that carries it."""

    hidden_size: int
    writes: dict[str, int] = field(default_factory=dict)  # param key -> axis the stream is written along
    reads: dict[str, int] = field(default_factory=dict)  # reader weight key -> its input axis
    unit_scales: list[str] = field(default_factory=list)  # layer scales held at ones (λ folded into writers)
    norms: dict[str, dict] = field(default_factory=dict)  # norm name -> its record in the block
    tied_head: str | None = None  # the head module tied to a table the stream starts from
    tied_norm: str | None = None  # the final norm that feeds the tied head
    tied_table: str | None = None  # the tied table's weight key
    rotated_outputs: list[str] = field(default_factory=list)  # run-time centred tables that rotation replaces
    # tables a module computes at run time into a non-persistent buffer (XGLM's sinusoidal positions):
    # their rotated copy is stored in the sliced checkpoint, which reads it instead of computing it
    computed_tables: list[str] = field(default_factory=list)
    # a norm that starts the stream from the token table alone (BLOOM's word_embeddings_layernorm): its
    # output depends only on the token id, so the normalised table is precomputed (float64) and rotated
    # in place of the raw one; the tied head keeps its own rotated copy of the raw table (``head_copy``)
    embedding_norm: str | None = None
    embedding_table: str | None = None  # the raw table's weight key the norm reads
    head_copy: str | None = None  # the head's own weight key once untied

    def writes_and_reads(self, key: str) -> list[int]:
        """The axes of ``key`` that carry the stream (written, then read; a head's own copy of a table
        BLOOM's embedding norm reads reads the stream along its axis 1)."""
        axes = [axes[key] for axes in (self.writes, self.reads) if key in axes]
        return axes + [1] if key == self.head_copy and not axes else axes

    def stream_dims(self) -> dict[str, list[int]]:
        """{param key: axes narrowed from d to k} (the sliced config's ``slice.stream_dims``)."""
        dims: dict[str, list[int]] = {}
        for key, axis in list(self.writes.items()) + list(self.reads.items()):
            dims.setdefault(key, []).append(axis)
        for key in self.unit_scales:
            dims.setdefault(key, []).append(-1)
        if self.head_copy:
            dims.setdefault(self.head_copy, []).append(1)
        return dims


# modules whose output is a row of a table they compute themselves (no weight), by class name, with
# the buffer that holds the table: the whole output depends on the position alone, so the table can be
# stored and rotated like an embedding's
COMPUTED_TABLES = {"XGLMSinusoidalPositionalEmbedding": "weights"}


def computed_table(module) -> str | None:
    """The buffer name of ``module``'s computed table (``COMPUTED_TABLES``), or None."""
    attr = COMPUTED_TABLES.get(type(module).__name__) if module is not None else None
    table = getattr(module, attr, None) if attr else None
    return attr if isinstance(table, torch.Tensor) and table.dim() == 2 else None


def _block(model) -> dict:
    block = getattr(model.config, "normswap", None)
    if not isinstance(block, dict) or not block.get("format_version"):
        raise NormswapError(
            "this model is not a normswap conversion: convert it first (normswap.convert.convert_model in "
            "memory; `normswap slice` converts a LayerNorm original itself)"
        )
    return block


def stream_map(model) -> StreamMap:
    """The stream map of ``model`` (a normswap exact conversion in memory), or a one-line refusal."""
    block = _block(model)
    if block.get("slice"):
        raise NormswapError("this model is already sliced; slice the conversion it came from instead")
    if block.get("mode") != "exact":
        raise NormswapError(
            f"slice needs an exact conversion; this one is {block.get('mode')!r} (its RMSNorms read a stream "
            "that is not centred, so the all-ones direction is not free to delete): convert --mode exact"
        )
    record = block.get("stream_writers")
    if not isinstance(record, dict) or "zero_mean" not in record:
        raise NormswapError(
            "this conversion does not record its residual-stream writers (converted by an older normswap): reconvert it"
        )
    for key in ("centered_inputs",):
        if block.get(key):
            raise NormswapError(
                f"cannot rotate {block[key][0]}: the stream starts there without a module that owns the write "
                "(centred at run time), so no table or matrix can take the rotation"
            )
    modules = dict(model.named_modules())
    embedding_norm = _embedding_norm(model, block)
    for name, rec in block.get("norms", {}).items():
        if name != embedding_norm:
            _check_norm(name, rec, block)
    params = dict(model.named_parameters(remove_duplicate=False))
    stream = StreamMap(hidden_size=0)
    widths = set()
    for key, axis in record["zero_mean"].items():
        if key not in params:
            raise NormswapError(f"the conversion record names {key}, which the model does not have: reconvert it")
        stream.writes[key] = int(axis) % params[key].dim()
        widths.add(int(params[key].shape[int(axis)]))
    stream.unit_scales = [k for k in record.get("unit_scales", []) if k in params]
    head = output_embeddings(model)
    for name in block.get("centered_outputs", []):
        module = modules.get(name)
        if name == embedding_norm:  # precomputed into the table (below)
            stream.rotated_outputs.append(name)
            continue
        computed = computed_table(module)
        if computed is not None:  # a table computed at run time (XGLM's sinusoids): stored, rotated
            stream.writes[f"{name}.{computed}"] = 1
            stream.rotated_outputs.append(name)
            stream.computed_tables.append(f"{name}.{computed}")
            widths.add(int(getattr(module, computed).shape[1]))
            continue
        if not isinstance(module, nn.Embedding):
            raise NormswapError(
                f"cannot rotate {name}: its output is centred at run time (a computed embedding or a writer "
                "without a weight matrix), so no table or matrix can take the rotation"
            )
        stream.writes[f"{name}.weight"] = 1
        stream.rotated_outputs.append(name)
        widths.add(int(module.weight.shape[1]))
        if head is not None and head.weight is module.weight:
            stream.tied_table = f"{name}.weight"
    if embedding_norm is not None:
        stream.embedding_norm, stream.embedding_table = embedding_norm, stream.tied_table
        if stream.tied_table is not None and head is not None:
            stream.head_copy = f"{local_head_name(model, head)}.weight"
    for name, rec in block.get("norms", {}).items():
        if name == embedding_norm:
            continue
        stream.norms[name] = rec
        widths.add(int(rec["hidden_size"]))
        for reader in rec.get("readers", []):
            module = modules.get(reader)
            if module is None:
                raise NormswapError(f"the conversion names reader {reader}, which the model does not have")
            if head is not None and module is head and stream.tied_table is not None:
                stream.tied_head, stream.tied_norm = reader, name
                continue
            layout = layout_of(module)
            if layout not in ("linear", "conv1d"):
                raise NormswapError(
                    f"cannot rotate into {reader} ({type(module).__name__}): "
                    "only Linear and Conv1D readers are supported"
                )
            stream.reads[f"{reader}.weight"] = 1 if layout == "linear" else 0
    if len(widths) != 1:
        raise NormswapError(f"the stream's recorded tensors disagree on its width ({sorted(widths)}); reconvert it")
    stream.hidden_size = widths.pop()
    if not stream.writes or not stream.reads and stream.tied_head is None:
        raise NormswapError("the conversion records no stream writer or reader: nothing to rotate")
    overlap = set(stream.writes) & set(stream.reads)
    for key in overlap:
        if stream.writes[key] == stream.reads[key]:
            raise NormswapError(f"{key} both reads and writes the stream along one axis: cannot rotate it")
    return stream


def _embedding_norm(model, block: dict) -> str | None:
    """The norm that starts the stream from the token table alone, where its output can be precomputed
    per token: an embedding-role norm, centred at run time, whose only other stream start is the
    input embedding table (no position table added before it), or None."""
    norms = [n for n, rec in block.get("norms", {}).items() if rec.get("role") == "embedding"]
    if len(norms) != 1:
        return None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embed, nn.Embedding):
        return None
    names = {n for n, m in model.named_modules() if m is embed}
    starts = set(block.get("centered_outputs", []))
    return norms[0] if starts - {norms[0]} <= names and norms[0] in starts else None


def local_head_name(model, head) -> str:
    return next(n for n, m in model.named_modules() if m is head)


def _check_norm(name: str, rec: dict, block: dict) -> None:
    """A norm rotates only without γ and β of its own (γ of the tied head's final norm excepted:
    the head adapter takes it)."""
    if rec.get("role") == "embedding":
        raise NormswapError(
            f"cannot rotate {name}: a norm whose output starts the stream keeps its γ and β on the stream itself"
        )
    if rec.get("bias"):
        raise NormswapError(f"cannot rotate {name}: it keeps a β on the stream (--beta keep); convert with β folded")
    tied_head_norm = bool(block.get("tied")) and bool(rec.get("logits_bias") or _feeds_tied_head(rec, block))
    if rec.get("weight") and not tied_head_norm:
        raise NormswapError(
            f"cannot rotate {name}: its γ cannot be folded (it stays on the norm, and γ does not commute with "
            "a rotation); convert with γ folded"
        )


def _feeds_tied_head(rec: dict, block: dict) -> bool:
    return rec.get("role") == "final" and bool(block.get("tied"))
