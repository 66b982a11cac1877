"""Match a checkpoint's tensors to the model its config describes, and refuse what does not fit.

Before anything is written, every tensor in the files must find exactly one place in the model,
every weight the model needs must be in the files, and each one's shape and kind of dtype must
be what its place implies. A config.json with fewer layers than the weights, a missing tensor,
or a header that relabels float32 bytes as int32 is refused here, in one line.
"""

from __future__ import annotations

import copy
import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.convert.ops import each_block, read_buffer, row_blocks
from normswap.errors import NormswapError


def skeleton(config, dtype=None, *, buffers=False):
    """The model class's module tree without parameter storage.

    ``buffers=True`` keeps buffers real (rotary frequencies, masks), which running the model
    needs; planning and checking need only the meta device.
    """
    from normswap.checkpoint import load as ckload

    cls = ckload.model_class_for(config)
    config = copy.deepcopy(config)
    kwargs = {} if dtype is None else {"dtype": dtype}
    context = _parameters_on_meta() if buffers else torch.device("meta")
    with context:
        if cls.__name__.startswith("Auto"):
            model = cls.from_config(config, trust_remote_code=ckload.remote_code_trusted(config), **kwargs)
        else:
            model = cls._from_config(config, **kwargs)
    if dtype is not None:
        keep32 = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
        for name, p in model.named_parameters():  # a few classes keep some modules in float32
            if keep32 and any(re.search(pattern, name) for pattern in keep32):
                p.data = p.data.to(torch.float32)
    model.eval()
    return model


@contextmanager
def _parameters_on_meta():
    """Parameters go to the meta device as modules register them; buffers stay real."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def load_dtype(config, source) -> torch.dtype:
    """transformers' dtype="auto": the config's dtype, else the index's, else the first floating tensor's."""
    for value in (getattr(config, "dtype", None), source.metadata.get("dtype")):
        if value is not None:
            return getattr(torch, value) if isinstance(value, str) else value
    for dt, _ in source.specs.values():
        if dt.is_floating_point:
            return dt
    return torch.float32


def tie_groups(model) -> dict:
    """key -> all state-dict keys that share its tensor (itself included), in state-dict order."""
    order = {k: i for i, k in enumerate(model.state_dict(keep_vars=True))}
    by_id: dict = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        if name in order:
            by_id.setdefault(id(p), []).append(name)
    groups = {}
    for names in by_id.values():
        names = sorted(set(names), key=order.__getitem__)
        for n in names:
            groups[n] = names
    return groups


def _renamer(model, meta_sd):
    """file key -> (model key, transformation pattern or None), as transformers renames on load."""
    prefix = getattr(model, "base_model_prefix", None) or None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]

        def rename(key):
            new, pattern = rename_source_key(key, renamings, converters, prefix, meta_sd)
            if new not in meta_sd and key in meta_sd:
                new, pattern = rename_source_key(key, [], [], prefix, meta_sd)
            return new, pattern
    except ImportError:  # another transformers: plain names, base-model prefix added or removed

        def rename(key):
            if key in meta_sd:
                return key, None
            if prefix and f"{prefix}.{key}" in meta_sd:
                return f"{prefix}.{key}", None
            if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1 :] in meta_sd:
                return key[len(prefix) + 1 :], None
            return key, None

    return rename


@dataclass
class Inputs:
    """A checkpoint's tensors as the model sees them: ``read(model key)`` in the load dtype."""

    source: object
    model: object  # skeleton as loaded (source structure)
    keymap: dict  # model key -> file key (one per tie group at least)
    specs: dict  # model key -> (load dtype, shape)
    groups: dict  # model key -> tied keys
    aliases: dict = field(default_factory=dict)  # plan aliases (tied head absent on disk)

    def disk_key(self, key):
        for k in [key] + [g for g in self.groups.get(key, [key]) if g != key]:
            if k in self.keymap:
                return self.keymap[k]
        target = self.aliases.get(key)
        if target and target in self.keymap:
            return self.keymap[target]
        return None

    def file_dtype(self, key) -> torch.dtype:
        return self.source.specs[self.disk_key(key)][0]

    def read(self, key, start=None, stop=None, out=None) -> torch.Tensor:
        """Rows of model tensor ``key`` in its load dtype (what from_pretrained would hold);
        ``out``: a byte buffer the source may read into (``SafetensorsFiles.read``)."""
        return self.source.read(self.disk_key(key), start, stop, out=out).to(self.specs[key][0])

    def read_as(self, key, dtype, out=None, pool=None) -> torch.Tensor:
        """Tensor ``key`` cast straight from the file dtype (what from_pretrained(dtype=...) holds),
        filled row block by row block so that no second whole-size copy exists at any time;
        ``out``: the tensor to fill (a reused buffer) instead of a fresh one; ``pool``: threads
        that fill row blocks side by side."""
        disk = self.disk_key(key)
        shape = self.source.specs[disk][1]
        if out is None:
            if len(shape) < 2:
                return self.source.read(disk).to(dtype)
            out = torch.empty(shape, dtype=dtype)
        if len(shape) < 2:
            return out.copy_(self.source.read(disk).reshape(out.shape))

        def fill(ab):
            a, b = ab
            raw = read_buffer((b - a, *shape[1:]), torch.float64)  # this thread's
            out[a:b].copy_(self.source.read(disk, a, b, out=raw))  # copy_ casts exactly like .to()

        each_block(pool)(fill, row_blocks(shape))
        return out


def match(model, source, label: str) -> Inputs:
    """Map every file tensor onto ``model`` and refuse any mismatch; nothing is read but headers."""
    meta_sd = model.state_dict(keep_vars=True)
    params = dict(model.named_parameters(remove_duplicate=False))
    groups = tie_groups(model)
    rename = _renamer(model, meta_sd)
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    cls = type(model).__name__

    # older checkpoints store buffers that are no longer persistent (BERT's embeddings.position_ids):
    # from_pretrained drops them silently, and so do we
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    keymap, unexpected, used_by = {}, [], {}
    for key in source.specs:
        new, pattern = rename(key)
        if new not in meta_sd:
            if new not in buffers and not any(p.search(key) for p in ignore):
                unexpected.append(key)
            continue
        if pattern is not None:
            raise NormswapError(
                f"{label}: {key} must be transformed (not just renamed) when it loads, which normswap "
                "does not reproduce"
            )
        owner = groups.get(new, [new])[0]
        used_by.setdefault(owner, []).append(key)
        keymap.setdefault(new, key)
    if source.duplicates:
        raise NormswapError(
            f"{label}: tensor {source.duplicates[0]} is stored twice in the weight files; nothing was written"
        )
    if unexpected:
        raise NormswapError(
            f"{label}: {len(unexpected)} tensor(s) in the weight files have no place in the {cls} that config.json "
            f"describes (first: {unexpected[0]}): the config has fewer layers or another shape than the weights; "
            "nothing was written"
        )
    for _owner, keys in used_by.items():
        if len(keys) > 1:  # the same tensor (or tied tensors) under two names: both must hold the same numbers
            first = source.read(keys[0])
            for other in keys[1:]:
                if not torch.equal(
                    first.reshape(-1).view(torch.uint8), source.read(other).reshape(-1).view(torch.uint8)
                ):
                    raise NormswapError(
                        f"{label}: {keys[0]} and {other} fill the same tied tensor of {cls} but differ; "
                        "nothing was written"
                    )

    specs = {k: (t.dtype, tuple(t.shape)) for k, t in meta_sd.items()}
    inputs = Inputs(source, model, keymap, specs, groups)
    missing = [k for k in specs if inputs.disk_key(k) is None and (k in params or k in persistent_buffers(model))]
    if missing:
        raise NormswapError(
            f"{label} lacks {len(missing)} tensor(s) the {cls} needs (first: {missing[0]}): truncated or "
            "saved by an incompatible version; nothing was written"
        )
    for key, (dtype, shape) in specs.items():
        disk = inputs.disk_key(key)
        if disk is None:
            continue
        have_dtype, have_shape = source.specs[disk]
        if tuple(have_shape) != tuple(shape):
            raise NormswapError(
                f"{label}: tensor {disk} has shape {list(have_shape)} in the files but the config implies "
                f"{list(shape)}; nothing was written"
            )
        if have_dtype.is_floating_point != dtype.is_floating_point:
            want = "floating-point" if dtype.is_floating_point else "integer"
            raise NormswapError(
                f"{label}: tensor {disk} is stored as {str(have_dtype).replace('torch.', '')} but is a "
                f"{want} {'weight' if key in params else 'buffer'} of {cls}: the file header is wrong "
                "or the file is not this model's; nothing was written"
            )
    return inputs


def persistent_buffers(model) -> set:
    out = set()
    for mname, module in model.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for bname, buf in module._buffers.items():
            if buf is not None and bname not in skip:
                out.add(f"{mname}.{bname}" if mname else bname)
    return out
