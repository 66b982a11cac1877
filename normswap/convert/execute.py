"""Execute a conversion plan: source tensors in, converted tensors out, the same way for every source.

``prepare`` plans a conversion on a model skeleton (a meta-device model for files, the live model
for ``apply.convert_model``), rebuilds the converted module tree and lists what OUT holds:
every output key, the tensor whose value it carries, its dtype and shape. ``execute`` then
computes each output tensor from the source in row blocks (``ops.run``) and hands the blocks to a
sink: the shard files being filled in place, or a dict of tensors. Tensors passed through
unchanged in their file dtype are copied file to file without being cast.

Several tensors are in flight at once on a small thread pool: reads (``pread``), arithmetic
(torch releases the GIL) and writes (``pwrite``) of different tensors overlap. Each tensor's
arithmetic runs on one thread with torch's intra-op threading off, so a result does not depend
on the number of workers or on scheduling.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from normswap.checkpoint.remote_code import apply_normswap_structure
from normswap.convert import ops
from normswap.convert.config import ConvertOptions
from normswap.convert.plan import Plan, build_plan
from normswap.convert.release_memory import release_freed_memory
from normswap.convert.tensor_match import Inputs, tie_groups
from normswap.errors import NormswapError
from normswap.model_facts import is_layernorm


@dataclass
class Write:
    value_key: str  # the tensor (source key or plan output) whose value goes here
    dtype: torch.dtype
    shape: tuple


@dataclass
class Conversion:
    plan: Plan
    model: object  # the converted module tree (no storage for file sources)
    inputs: Inputs
    writes: dict  # output key -> Write, in state-dict order, tied duplicates left out
    parameters_before: int
    parameters_after: int
    source_dtype: str
    output_dtype: str

    @property
    def specs(self) -> dict:
        return {k: (w.dtype, w.shape) for k, w in self.writes.items()}


def count_parameters(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def prepare(model, inputs: Inputs, family, options: ConvertOptions, dtype=None) -> Conversion:
    """Plan ``model``'s conversion, rebuild its module tree in place, and list the output tensors."""
    config = model.config
    plan = build_plan(family, model, config, options)
    inputs.aliases = plan.aliases
    for op in plan.derivations.values():  # refusals that depend on values: before anything changes
        ops.check_values(op, inputs.read)
    src_specs = inputs.specs
    params_before = count_parameters(model)
    source_dtype = _dtype_name(next(model.parameters()).dtype)

    with torch.no_grad():
        apply_normswap_structure(model, plan.block)
        if dtype is not None:
            model.to(dtype)
    conv_sd = model.state_dict(keep_vars=True)
    dropped = set(plan.drop)
    produced = [k for k in src_specs if not (k in dropped and k not in plan.derivations)]
    produced += [k for k in plan.derivations if k not in src_specs]
    produced_set = set(produced)
    params = dict(model.named_parameters(remove_duplicate=False))
    lost = [k for k in conv_sd if k not in produced_set and k in params]
    extra = [k for k in produced if k not in conv_sd]
    if lost or extra:
        raise NormswapError(
            "internal error: converted weights do not fit the new module tree "
            f"(missing {lost[:3]}, unexpected {extra[:3]})"
        )
    plan.block["source_model_type"] = config.model_type
    plan.block["source_class"] = type(model).__name__
    config.normswap = plan.block
    if plan.block["untied"]:
        config.tie_word_embeddings = False
    left = {item["module"] for item in plan.block["left_alone"]}
    for name, module in model.named_modules():
        if is_layernorm(module) and name not in left:
            raise NormswapError(f"internal error: LayerNorm {name} survived the conversion")

    # the converted state dict without tied duplicates: the first name is kept, holding what
    # load_state_dict would have left there (the last tied key it loaded)
    groups = tie_groups(model)
    writes, seen = {}, set()
    for key, t in conv_sd.items():
        if key in seen:
            continue
        group = groups.get(key, [key])
        seen.update(group)
        if key not in produced_set and key not in params:
            continue  # a buffer the model has but no file carries
        value_key = [g for g in group if g in produced_set][-1]
        writes[key] = Write(value_key, t.dtype, tuple(t.shape))
    out_dtype = dtype or next(model.parameters()).dtype
    return Conversion(
        plan, model, inputs, writes, params_before, count_parameters(model), source_dtype, _dtype_name(out_dtype)
    )


def default_workers() -> int:
    return min(8, (os.cpu_count() or 1) + 1)


def execute(conv: Conversion, sink, *, device="cpu", compute=None, workers=None) -> None:
    """Compute every output tensor and hand it to ``sink`` (``write(key, tensor, row)``, ``copy``)."""
    inputs = conv.inputs

    def shape_of(key):
        return inputs.specs[key][1]

    fused = fused_biases(conv, compute)  # weight output key -> bias output key summed in its pass

    def emitter(key):
        return lambda t, row: sink.write(key, t, row)

    def one(key):
        w = conv.writes[key]
        op = conv.plan.derivations.get(w.value_key)
        emit = emitter(key)
        if op is not None:
            bias = None
            if key in fused:
                b = conv.writes[fused[key]]
                bias = (conv.plan.derivations[b.value_key], emitter(fused[key]), b.dtype)
            ops.run(op, w.shape, inputs.read, shape_of, emit, w.dtype, compute=compute, device=device, bias=bias)
            return
        file_dtype = inputs.file_dtype(w.value_key)
        raw = inputs.source.raw(inputs.disk_key(w.value_key))
        if raw is not None and file_dtype == inputs.specs[w.value_key][0] == w.dtype and hasattr(sink, "copy"):
            sink.copy(key, *raw)  # passed through unchanged: no cast, no arithmetic
            return
        for a, b in ops.row_blocks(w.shape):
            emit(inputs.read(w.value_key, a, b).to(w.dtype), a)

    def one_then_trim(key):
        one(key)
        if _numel(conv.writes[key].shape) >= ops.BLOCK_ELEMENTS:  # only big tensors leave big holes
            release_freed_memory()

    def work(key):  # elements read and written: a folded bias reads its whole weight matrix
        w = conv.writes[key]
        op = conv.plan.derivations.get(w.value_key)
        return _numel(w.shape) + (sum(_numel(shape_of(k)) for k in ops.source_keys(op)) if op else 0)

    # the most work first, so that the last tasks to finish are short ones (not the head's W·β)
    summed = set(fused.values())
    order = sorted((k for k in conv.writes if k not in summed), key=lambda k: -work(k))
    try:
        with ops.intra_op_threads(1), ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
            futures = [pool.submit(one_then_trim, key) for key in order]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
    finally:
        release_freed_memory()


def fused_biases(conv: Conversion, compute=None) -> dict:
    """Weight output key -> the bias output whose W·β reads the same matrix (``ops.fusable``):
    one pass over W computes both, with the bits of two separate passes."""
    derived = {key: conv.plan.derivations.get(w.value_key) for key, w in conv.writes.items()}
    readers = {}  # source matrix -> the weight output that reads it block by block
    for key, op in derived.items():
        if (
            op is not None
            and op["op"] == "linear_weight"
            and tuple(conv.inputs.specs[op["src"]][1]) == conv.writes[key].shape
        ):
            readers.setdefault(op["src"], key)
    fused = {}
    for key, op in derived.items():
        weight_key = readers.get(op.get("weight")) if op is not None and op["op"] == "linear_bias" else None
        if weight_key is None or weight_key in fused:
            continue
        weight = conv.writes[weight_key]
        if ops.fusable(derived[weight_key], op, conv.inputs.specs[op["weight"]][0], weight.dtype, compute):
            fused[weight_key] = key
    return fused


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class TensorDict:
    """A sink that assembles the output tensors in memory."""

    def __init__(self, specs: dict, tensors: dict | None = None):
        """``tensors``: some outputs' destination tensors, given (reused buffers); the rest are allocated."""
        given = tensors or {}
        self.tensors = {k: given[k] if k in given else torch.empty(shape, dtype=dt) for k, (dt, shape) in specs.items()}

    def write(self, key, tensor, row=0):
        target = self.tensors[key]
        if target.dim() == 0:
            target.copy_(tensor.reshape(()))
        else:
            target[row : row + tensor.shape[0]].copy_(tensor)
