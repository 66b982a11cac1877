"""Streaming conversion: tensor by tensor from safetensors, for checkpoints larger than memory.

The streaming path executes the *same plan* as the in-memory path (``plan.build_plan`` on a
meta-device model, ``ops.compute`` for every derived tensor) and reproduces, key by key, what the
in-memory path does to a tensor on its way from the files to OUT:

    file dtype --(cast on load, as transformers' dtype="auto")--> load dtype --float64 math-->
    --(cast as transform_state_dict does)--> --(cast into the converted parameter)--> written

so the two outputs are bitwise equal: same keys, dtypes, values and shard layout.

Memory stays near one *piece* of a tensor rather than one model or one shard:
- source tensors are read from the memory-mapped files (``safe_open``) in row ranges;
- row-separable ops (embedding centring, γ folding, Conv1D centring, plain copies) run on row
  pieces; Linear centring (a mean over the output axis) runs on column pieces of one tensor.
  Both give bit-identical results to the whole-tensor op (each output element is reduced in
  the same order), which tests/test_streaming.py checks against the in-memory path;
- the one op that is not piece-wise reproducible is β folding (``c + W β``): a BLAS
  matrix-vector product sums in a blocking-dependent order, so it gets its whole ``W`` in
  float64 (8 bytes × rows × cols, the largest such matrix bounds the peak);
- output shards are laid out in advance and filled in place (``checkpoint/shards.py``), so
  no shard is ever held in memory.

Verification (``--verify``, the default) reloads the source and the output in float32 (plus a
float64 copy for the noise floor and, for 16-bit outputs, a rounded copy): about 12-24 bytes per
parameter. When that exceeds the available memory, the conversion refuses up front and asks for
``--no-verify``, rather than skip a check the user asked for or die half-way through.
"""

from __future__ import annotations

import copy
import json
import os
import struct
import sys
import time
from pathlib import Path

import torch

from normswap.errors import NormswapError

CHUNK_BYTES = 16 * 2**20  # float64 bytes of one piece of a tensor
ADAPTIVE_WHOLE = True  # let column-wise ops run whole below the β-folding peak (tests turn it off)
STREAM_FRACTION = 0.25  # auto: stream when the weights exceed this share of available memory ...
STREAM_ABOVE = 4 * 10**9  # ... or this many bytes
THRESHOLD_ENV = "NORMSWAP_STREAM_ABOVE"  # override for the automatic choice, e.g. "500MB" or "0"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_BIN_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_ST_TORCH = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


# -- where the files are and whether to stream ---------------------------------------------------

def local_dir(resolved, *, download=False) -> Path | None:
    """A directory holding the checkpoint's files: the path itself, or a hub id's cached snapshot."""
    path = Path(str(resolved))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    try:
        return Path(snapshot_download(str(resolved), local_files_only=True, allow_patterns=patterns))
    except Exception:
        if not download:
            return None
    try:
        return Path(snapshot_download(str(resolved), allow_patterns=patterns))
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NormswapError(f"cannot fetch the safetensors files of {resolved} for streaming: {msg}") from None


def weight_files(directory: Path) -> tuple[str | None, list[Path]]:
    """('safetensors', files) | ('bin', files) | (None, []), the way transformers picks them."""
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise NormswapError(f"{index} is not a valid safetensors index (no weight_map)") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise NormswapError(f"{directory} is incomplete: {missing[0]} is listed in {INDEX_NAME} but absent")
        return "safetensors", [directory / n for n in names]
    if (directory / SINGLE_NAME).is_file():
        return "safetensors", [directory / SINGLE_NAME]
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if bins or any((directory / n).is_file() for n in _BIN_NAMES):
        return "bin", bins
    return None, []


def threshold_bytes() -> int:
    env = os.environ.get(THRESHOLD_ENV)
    if env:
        from normswap.checkpoint.shards import parse_size

        return parse_size(env)
    return int(min(STREAM_ABOVE, STREAM_FRACTION * _available_memory()))


def _available_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        return 8 * 2**30


def should_stream(resolved, local, requested) -> bool:
    """Stream when asked to (refusing what cannot stream) or, by default, when the weights are big."""
    directory = local_dir(resolved, download=bool(requested))
    if directory is None:
        if requested:
            raise NormswapError(f"--streaming needs the checkpoint's files on disk: {resolved} is neither a directory nor in the Hugging Face cache")
        return False
    fmt, files = weight_files(directory)
    size = sum(f.stat().st_size for f in files)
    if fmt != "safetensors":
        if requested:
            what = "only PyTorch .bin weights" if fmt == "bin" else "no weight files"
            raise NormswapError(f"--streaming reads safetensors weights, but {resolved} has {what}: convert without --streaming (loads the whole model)")
        if fmt == "bin" and size > threshold_bytes():
            print(f"normswap: note: {resolved} holds .bin weights, which cannot stream; converting in memory "
                  f"(needs a few times {size / 1e9:.1f} GB)", file=sys.stderr)
        return False
    if requested:
        return True
    return size > threshold_bytes()


# -- the source files ------------------------------------------------------------------------

class Source:
    """The safetensors files of a checkpoint: which file holds which key, read lazily in pieces.

    Headers are validated with ``safe_open`` (a truncated or damaged file is refused before
    anything is written); tensors are then read with ``pread`` at their recorded offsets rather
    than through a long-lived memory map, whose touched pages would count towards this process's
    resident memory until it is unmapped.
    """

    def __init__(self, directory: Path, files: list[Path]):
        from safetensors import safe_open

        self.directory = directory
        self.files = files
        self.where: dict = {}  # file key -> path
        self.specs: dict = {}  # file key -> (torch dtype, shape)
        self.offsets: dict = {}  # file key -> absolute byte offset in its file
        self._fds: dict = {}
        self.metadata = {}
        index = directory / INDEX_NAME
        if index.is_file():
            self.metadata = json.loads(index.read_text()).get("metadata") or {}
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as handle:
                    keys = list(handle.keys())
            except Exception as e:  # safetensors' own error type: truncated or not safetensors at all
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise NormswapError(f"cannot read weights of {directory}: {path.name} is a corrupted safetensors file ({msg})") from None
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for key in keys:
                if key in self.where:
                    continue
                entry = header[key]
                dtype = _ST_TORCH.get(entry["dtype"])
                if dtype is None:
                    raise NormswapError(f"{path.name}: tensor {key} has dtype {entry['dtype']}, which normswap cannot stream")
                self.where[key] = path
                self.specs[key] = (dtype, tuple(entry["shape"]))
                self.offsets[key] = 8 + n + entry["data_offsets"][0]

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)

    def read(self, key, start=None, stop=None) -> torch.Tensor:
        """Tensor ``key`` (rows ``start:stop`` of dimension 0 when given) in its file dtype."""
        path = self.where[key]
        dtype, shape = self.specs[key]
        if start is None or not shape:
            start, stop = 0, (shape[0] if shape else 1)
        row = _numel(shape[1:]) * torch.empty((), dtype=dtype).element_size() if shape else torch.empty((), dtype=dtype).element_size()
        size = (stop - start) * row
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        out_shape = (stop - start, *shape[1:]) if shape else ()
        if size == 0:
            return torch.empty(out_shape, dtype=dtype)
        buf = torch.empty(size, dtype=torch.uint8)  # not zero-filled, unlike bytearray
        view, done = memoryview(buf.numpy()), 0
        while done < size:
            got = os.preadv(fd, [view[done:]], self.offsets[key] + start * row + done)
            if got <= 0:
                raise NormswapError(f"cannot read {key} from {path.name}: the file ended early")
            done += got
        return buf.view(dtype).reshape(out_shape)

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


# -- the model as transformers would load it ---------------------------------------------------

def auto_dtype(config, source: Source) -> torch.dtype:
    """transformers' dtype="auto": the config's dtype, else the first floating tensor's on disk."""
    dtype = getattr(config, "dtype", None)
    if dtype is not None:
        return getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if "dtype" in source.metadata:
        value = source.metadata["dtype"]
        return getattr(torch, value) if isinstance(value, str) else value
    try:
        from transformers.modeling_utils import get_state_dict_dtype, load_state_dict

        return get_state_dict_dtype(load_state_dict(str(source.files[0]), map_location="meta"))
    except ImportError:
        for key, (dt, _) in source.specs.items():
            if source.where[key] == source.files[0] and dt.is_floating_point:
                return dt
        return torch.float32


def meta_model_as_loaded(config, dtype):
    """The model ``from_pretrained(dtype="auto")`` builds, on the meta device (no storage)."""
    from normswap.checkpoint import load as ckload

    cls = ckload.model_class_for(config)
    config = copy.deepcopy(config)
    with torch.device("meta"):
        if cls.__name__.startswith("Auto"):
            model = cls.from_config(config, trust_remote_code=ckload.remote_code_trusted(config), dtype=dtype)
        else:
            model = cls._from_config(config, dtype=dtype)
    keep32 = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if keep32:
        # a few model classes keep some modules in float32 under 16-bit loads
        import re

        for name, p in model.named_parameters():
            if any(re.search(pattern, name) for pattern in keep32):
                p.data = p.data.to(torch.float32)
    model.eval()
    return model


def tie_groups(model) -> dict:
    """key -> all state-dict keys that share its tensor (itself included), in state-dict order."""
    order = {k: i for i, k in enumerate(model.state_dict(keep_vars=True))}
    by_id: dict = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if name in order:
            by_id.setdefault(id(p), []).append(name)
    groups = {}
    for names in by_id.values():
        names = sorted(set(names), key=order.__getitem__)
        for n in names:
            groups[n] = names
    return groups


def map_keys(model, source: Source) -> tuple[dict, list]:
    """model key -> file key, renaming legacy names the way transformers does on load."""
    meta_sd = model.state_dict(keep_vars=True)
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
            if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in meta_sd:
                return key[len(prefix) + 1:], None
            return key, None

    out, unexpected = {}, []
    for key in source.specs:
        new, pattern = rename(key)
        if new not in meta_sd:
            unexpected.append(key)
            continue
        if pattern is not None:
            raise NormswapError(
                f"{key} must be transformed (not just renamed) by transformers when it loads, which streaming does "
                "not reproduce: convert with --no-streaming"
            )
        out.setdefault(new, key)
    return out, unexpected


# -- the conversion --------------------------------------------------------------------------

def verification_bytes(params: int, out_dtype: torch.dtype) -> int:
    """What `finish`'s verification holds at once: float32 source + converted, rounded copy, float64 floor."""
    from normswap.convert.verify import FLOOR_MAX_PARAMS

    total = 8 * params
    if out_dtype not in (torch.float32, torch.float64):
        total += 6 * params
    if params <= FLOOR_MAX_PARAMS:
        total += 8 * params
    return int(total * 1.1)


def _pieces(op, shape) -> tuple[int | None, dict]:
    """Which axis an output tensor can be computed along in pieces, and how each input is sliced.

    Returns (axis, {input key: axis it is sliced on, or None for whole}); axis None: compute whole.
    Only ops whose every output element depends on one row (axis 0) or one column (axis 1) of the
    inputs qualify, and each piece goes through ``ops.compute`` itself, so the arithmetic is the
    plan's, not a copy of it.
    """
    if len(shape) < 2:
        return None, {}
    if op is None:
        return 0, {}
    kind = op["op"]
    if kind in ("copy", "center_rows"):
        return 0, {op["src"]: 0}
    if kind == "linear_weight" and len(shape) == 2:
        gamma = op.get("gamma")
        if op["layout"] == "conv1d":  # [in, out]: γ scales rows, centring is per row
            return 0, {op["src"]: 0, **({gamma: 0} if gamma else {})}
        if op.get("center"):  # [out, in]: centring averages each column over the output axis
            return 1, {op["src"]: 1, **({gamma: 0} if gamma else {})}
        return 0, {op["src"]: 0, **({gamma: None} if gamma else {})}
    return None, {}


def _ranges(n, step):
    """[a, b) ranges covering n, none of length 1 unless n is (keeps every reduction a multi-output one)."""
    step = max(2, int(step))
    out = [(a, min(a + step, n)) for a in range(0, n, step)]
    if len(out) > 1 and out[-1][1] - out[-1][0] == 1:
        a, _ = out[-2]
        out[-2:] = [(a, n)]
    return out


class _Converter:
    def __init__(self, source: Source, keymap: dict, src_groups: dict, src_specs: dict):
        self.source = source
        self.keymap = keymap
        self.src_groups = src_groups
        self.src_specs = src_specs
        self.plan = None  # set once planned; the tie groups alone locate every source tensor
        self.whole_bytes = CHUNK_BYTES  # float64 size up to which a column-wise op runs whole

    def disk_key(self, key):
        """The file key holding model key ``key`` (directly, or through the tensor it is tied to)."""
        for k in [key] + [g for g in self.src_groups.get(key, [key]) if g != key]:
            if k in self.keymap:
                return self.keymap[k]
        target = self.plan.aliases.get(key) if self.plan is not None else None
        if target and target in self.keymap:
            return self.keymap[target]
        return None

    def loaded(self, key, start=None, stop=None) -> torch.Tensor:
        """Rows of source tensor ``key`` as the in-memory path holds it (the load dtype)."""
        t = self.source.read(self.disk_key(key), start, stop)
        return t.to(self.src_specs[key][0])

    def loaded64(self, key, axis=None, start=None, stop=None) -> torch.Tensor:
        """``loaded(key)`` in float64, sliced on ``axis``; whole tensors are filled row piece by piece."""
        if axis == 0:
            return self.loaded(key, start, stop).to(torch.float64)
        shape = self.src_specs[key][1]
        if axis is None and len(shape) >= 2 and _numel(shape) * 8 > CHUNK_BYTES:
            out = torch.empty(shape, dtype=torch.float64)
            for a, b in _ranges(shape[0], CHUNK_BYTES // max(1, 8 * _numel(shape[1:]))):
                out[a:b] = self.loaded(key, a, b)  # copy_ casts exactly like .to()
            return out
        t = self.loaded(key).to(torch.float64)
        return t if axis is None else t.narrow(axis, start, stop - start)

    def emit(self, writer, out_key, value_key, final_dtype, out_dtype_of):
        from normswap.convert import ops

        op = self.plan.derivations.get(value_key)
        shape = writer.specs[out_key][1]
        axis, slicing = _pieces(op, shape)
        if axis is not None and _numel(shape) * 8 <= CHUNK_BYTES:
            axis = None
        if axis == 1 and _numel(shape) * 8 <= self.whole_bytes:
            axis = None  # column pieces are slow (strided); whole costs no more than the peak anyway
        if op is None:  # carried over: file -> load dtype -> parameter dtype
            if axis is None:
                writer.write(out_key, self.loaded(value_key).to(final_dtype))
                return
            for a, b in _ranges(shape[0], CHUNK_BYTES // max(1, 8 * _numel(shape[1:]))):
                writer.write(out_key, self.loaded(value_key, a, b).to(final_dtype), row=a)
            return

        def finish(t):
            return t.to(out_dtype_of(value_key)).to(final_dtype)

        if axis is None:
            cache = {}

            def fetch(k):
                if k not in cache:
                    cache[k] = self.loaded64(k)
                return cache[k]

            writer.write(out_key, finish(ops.compute(op, fetch)))
            return
        other = _numel(shape) // shape[axis]
        step = CHUNK_BYTES // max(1, 8 * other)
        whole = {}  # inputs not sliced (γ on the input axis), read once
        if axis == 0:
            for a, b in _ranges(shape[0], step):
                piece = ops.compute(op, lambda k: self._piece(k, slicing, a, b, whole))
                writer.write(out_key, finish(piece), row=a)
            return
        out = torch.empty(shape, dtype=final_dtype)  # column pieces: assemble, then write once
        for a, b in _ranges(shape[1], step):
            out[:, a:b] = finish(ops.compute(op, lambda k: self._piece(k, slicing, a, b, whole)))
        writer.write(out_key, out)

    def _piece(self, key, slicing, a, b, whole):
        axis = slicing.get(key)
        if axis is None:
            if key not in whole:
                whole[key] = self.loaded64(key)
            return whole[key]
        if axis == 0:
            return self.loaded64(key, 0, a, b)
        if key not in whole:  # column slices of a matrix: read it once in its load dtype
            whole[key] = self.loaded(key)
        return whole[key][:, a:b].to(torch.float64)


def _release_freed_memory():
    """Hand freed heap pages back to the OS between tensors.

    Pieces are smaller than glibc's mmap threshold, so they come from the heap, and the heap does
    not shrink by itself: without this the resident size creeps up tensor after tensor.
    """
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def convert_streaming(resolved, out, *, config, family, skeleton=None, src_label=None, mode="auto", gamma=None, beta=None,
                      untie=False, dtype=None, force=False, verify=True, tolerance=1e-4, max_shard_size="5GB",
                      progress=None) -> dict:
    """Convert a safetensors checkpoint tensor by tensor into OUT; returns convert's summary."""
    from normswap.checkpoint import load as ckload
    from normswap.checkpoint.remote_code import apply_normswap_structure
    from normswap.checkpoint.shards import ShardWriter, default_metadata, plan_shards, shard_names, write_index
    from normswap.checkpoint.write import copy_side_files, write_config_and_code
    from normswap.convert.apply import _assert_no_residual_layernorm, count_parameters
    from normswap.convert.pipeline import base_manifest, finish, summary
    from normswap.convert.plan import ConvertOptions, build_plan
    from normswap.publish import staging_dir

    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    src_label = str(resolved) if src_label is None else src_label
    out = Path(out)
    directory = local_dir(resolved, download=True)
    if directory is None:
        raise NormswapError(f"cannot stream {resolved}: its files are not on disk")
    fmt, files = weight_files(directory)
    if fmt != "safetensors":
        raise NormswapError(f"cannot stream {resolved}: it has no safetensors weights (convert without --streaming)")
    source = Source(directory, files)

    # the model exactly as the in-memory path would hold it after loading, but without storage
    load_dtype = auto_dtype(config, source)
    config.dtype = load_dtype  # from_pretrained(dtype="auto") records it on the config it is given
    model = meta_model_as_loaded(config, load_dtype)
    src_sd = model.state_dict(keep_vars=True)
    src_specs = {k: (t.dtype, tuple(t.shape)) for k, t in src_sd.items()}
    src_groups = tie_groups(model)
    keymap, unexpected = map_keys(model, source)

    missing, mismatched = [], []
    conv = _Converter(source, keymap, src_groups, src_specs)
    for key, (dt, shape) in src_specs.items():
        disk = conv.disk_key(key)
        if disk is None:
            missing.append(key)
        elif tuple(source.specs[disk][1]) != tuple(shape):
            mismatched.append((key, source.specs[disk][1], shape))
    if missing:
        raise NormswapError(
            f"{src_label} lacks {len(missing)} tensor(s) the {type(model).__name__} needs (first: {missing[0]}): truncated or "
            "saved by an incompatible version; nothing was written"
        )
    if mismatched:
        key, have, want = mismatched[0]
        raise NormswapError(f"{src_label}: tensor {key} has shape {list(have)} on disk but the config implies {list(want)}; nothing was written")

    options = ConvertOptions(mode=mode, gamma=gamma, beta=beta, untie=untie)
    plan = build_plan(family, model, model.config, options)
    conv.plan = plan
    # β folding holds its whole reader matrix in float64 (see the module docstring): that matrix
    # sets the peak, so ops that would otherwise go in slow column pieces may run whole when
    # their own peak (input, result, cast: ~2.5x their float64 size) stays below it
    fold = [_numel(src_specs[op["weight"]][1]) * 8 for op in plan.derivations.values()
            if op.get("op") == "linear_bias" and op.get("beta") and op.get("weight") in src_specs]
    if ADAPTIVE_WHOLE and fold:
        conv.whole_bytes = max(CHUNK_BYTES, int(max(fold) / 2.5))
    params_before = count_parameters(model)
    source_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    ref_dtype = next(iter(src_specs.values()))[0]

    # the converted module tree, still without storage: its state dict says what OUT holds
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
        raise NormswapError(f"internal error: converted weights do not fit the new module tree (missing {lost[:3]}, unexpected {extra[:3]})")
    plan.block["source_model_type"] = config.model_type
    plan.block["source_class"] = type(model).__name__
    model.config.normswap = plan.block
    if plan.block["untied"]:
        model.config.tie_word_embeddings = False
    _assert_no_residual_layernorm(model, plan)
    params_after = count_parameters(model)
    out_dtype = dtype or next(model.parameters()).dtype

    if verify:
        need, have = verification_bytes(max(params_before, params_after), out_dtype), _available_memory()
        if need > 0.9 * have:
            raise NormswapError(
                f"verification reloads the model in float32/float64 (~{need / 1e9:.1f} GB) but only {have / 1e9:.1f} GB "
                "of memory is available; the conversion itself streams: rerun with --no-verify"
            )

    # what to write: the converted state dict without tied duplicates (the first name is kept,
    # holding what load_state_dict would have left there: the last tied key it loaded)
    conv_groups = tie_groups(model)
    writes, seen = {}, set()
    for key, t in conv_sd.items():
        if key in seen:
            continue
        group = conv_groups.get(key, [key])
        seen.update(group)
        if key not in produced_set and key not in params:
            continue  # a buffer the model has but no file carries (cannot happen in the families listed)
        value_key = [g for g in group if g in produced_set][-1]
        writes[key] = (value_key, t.dtype, tuple(t.shape))

    def out_dtype_of(key):
        if dtype is not None:
            return dtype
        return src_specs[key][0] if key in src_specs else ref_dtype

    specs = {k: (dt, shape) for k, (_, dt, shape) in writes.items()}
    shards = plan_shards(specs, max_shard_size)
    names = shard_names(len(shards))
    total = sum(_numel(s) * torch.empty((), dtype=d).element_size() for d, s in specs.values())
    say(f"streaming {len(writes)} tensors ({total / 1e9:.2f} GB) from {len(files)} file(s) into {len(shards)} shard(s) "
        f"({family.display}, {params_before / 1e6:.1f}M parameters)")

    manifest = base_manifest(src_label, resolved, plan, params_before, params_after, source_dtype,
                             str(out_dtype).replace("torch.", ""), "streaming")
    manifest["conversion"]["source_files"] = len(files)
    if unexpected:
        manifest["conversion"]["ignored_source_tensors"] = len(unexpected)
    with staging_dir(out) as tmp:
        write_config_and_code(model, tmp)
        meta = default_metadata()
        for i, (keys, name) in enumerate(zip(shards, names), start=1):
            if len(shards) > 1:
                say(f"writing {name}")
            with ShardWriter(tmp / name, {k: specs[k] for k in keys}, meta) as writer:
                for key in keys:
                    value_key, final_dtype, _ = writes[key]
                    conv.emit(writer, key, value_key, final_dtype, out_dtype_of)
                    if _numel(specs[key][1]) * 8 >= CHUNK_BYTES:  # only big tensors leave big holes
                        _release_freed_memory()
        write_index(tmp, shards, names, specs)
        source.close()
        _write_generation_config(model, directory, tmp)
        copy_side_files(directory, tmp)
        finish(tmp, out, resolved, manifest, plan.mode, causal=ckload.is_causal_lm(config), verify=verify,
               tolerance=tolerance, force=force, say=say)
    manifest["seconds"] = round(time.perf_counter() - t0, 3)
    return summary(out, manifest)


def _write_generation_config(model, src_dir: Path, tmp: Path):
    """What from_pretrained + save_pretrained would leave: the source's generation config, re-saved.

    Like ``GenerationMixin.adjust_generation_fn``: generation_config.json when the source has
    one, else one built from the source's config.json.
    """
    gen = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)()
    if can_generate:
        try:
            from transformers import GenerationConfig

            if (src_dir / "generation_config.json").is_file():
                gen = GenerationConfig.from_pretrained(str(src_dir))
            else:
                gen = GenerationConfig.from_pretrained(str(src_dir), config_file_name="config.json", _from_model_config=True)
        except Exception:
            pass
    if gen is not None and not (tmp / "generation_config.json").exists():
        try:
            gen.save_pretrained(tmp)
        except Exception:  # an invalid generation config must not lose the weights
            pass
