"""Slicing without a whole model in memory: every weight is read from the conversion's files when
the module that owns it runs, and every sliced tensor is computed from the file tensor it replaces.

The runner is convert's own (convert/verify.py ``Blockwise``): a model skeleton whose parameters
have no storage, each module loading its weights in a forward pre-hook and dropping them after its
forward, so at any instant one module's weights are resident (plus the activations of the batch
running). The same runner serves the calibration (Σ gathered by the norms' pre-hooks), the
rotation-alone check, the reload check and the held-out perplexity; what differs is where a weight
comes from:

- ``ConvertedFiles``: the conversion's (or the written sliced checkpoint's) safetensors, cast
  from the file dtype as from_pretrained casts them;
- ``RotatedWeights``: the sliced model at a width w, each stream tensor computed on demand from the
  conversion's (rotate.rotated_tensor: Q_w contracted along each stream axis, in float64, or float32
  where the output is 16-bit: ``ops.compute_dtype``, convert's own rule), the others read through.

Nothing here holds a model's weights: the largest resident tensor is the largest module's.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from normswap.checkpoint import load as ckload
from normswap.checkpoint.shards import ShardedCheckpoint
from normswap.checkpoint.tensor_source import SafetensorsFiles, numel, weight_files
from normswap.convert import tensor_match as ckinputs
from normswap.convert import verify as runner
from normswap.convert.ops import compute_dtype
from normswap.errors import NormswapError
from normswap.model_facts import output_embeddings
from normswap.slice.calibrate import SecondMoments
from normswap.slice.rotate import head_tensors, narrowed, rotated_tensor, sliced_block
from normswap.slice.stream import StreamMap, stream_map

ROW_BLOCK_ELEMENTS = 1 << 22  # a table rotated this many elements of rows at a time (16 MB in float32)


def skeleton(config, dtype=torch.float32, *, buffers=True):
    """A storage-free model of ``config`` (buffers real when the model is to run). ``config`` itself is
    never changed: a model to run gets its own copy with the key/value cache off (one forward, no
    generation: a cache is copying only), while the config written beside the weights keeps the
    source's setting, so that generate() on the sliced model uses its cache."""
    if buffers and getattr(config, "use_cache", None):
        config = copy.deepcopy(config)
        config.use_cache = False
    return ckinputs.skeleton(config, dtype, buffers=buffers)


class ConvertedFiles:
    """A normswap checkpoint's weights, tensor by tensor (``fetch(key, dtype, out=None)``)."""

    def __init__(self, directory, label: str):
        self.directory = directory
        self.config = ckload.load_config(str(directory))
        files = weight_files(directory)[1]
        if not files:
            raise NormswapError(f"{label} holds no safetensors weight file")
        self.files = SafetensorsFiles(directory, files)
        try:
            self.meta = skeleton(self.config, buffers=False)
            self.inputs = ckinputs.match(self.meta, self.files, label)
        except BaseException:
            self.files.close()
            raise

    def fetch(self, key, dtype, out=None, pool=None) -> torch.Tensor:
        return self.inputs.read_as(key, dtype, out=out, pool=pool)

    def has(self, key) -> bool:
        return self.inputs.disk_key(key) is not None

    def file_dtype(self, key) -> torch.dtype:
        return self.inputs.file_dtype(key)

    def close(self) -> None:
        self.files.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def sliced_config(config, stream: StreamMap, width: int, *, fraction: float, basis: str):
    """The config of the model sliced ``width`` wide (what the written checkpoint declares)."""
    cfg = copy.deepcopy(config)
    cfg.normswap = sliced_block(config.normswap, stream, width, fraction=fraction, basis=basis)
    return cfg


def rotate_once(source: ConvertedFiles, stream: StreamMap, q: torch.Tensor, directory, calc, *, device="cpu", say=None):
    """Every stream tensor of the conversion rotated once, d − 1 wide (only u deleted), into a
    private safetensors file in ``calc``: the one pass of matmuls. Every narrower width is its
    prefix along the stream axes (Q_k is Q's first k columns; ``rotate.narrowed``), so the rotation-
    alone check, the written checkpoint and the reload check all read this file. Tables and heads
    (the stream their last axis only) are rotated in row blocks. ``device``: where the matmuls run
    (one tensor, or one row block, there at a time). Returns (files, seconds)."""
    say = say or (lambda msg: None)
    q = q.to(device=device, dtype=calc)
    width = stream.hidden_size - 1
    specs = {}
    for key in stream.stream_dims():
        if key in stream.unit_scales:
            continue
        shape = list(source.inputs.specs[key][1])
        for axis in stream.writes_and_reads(key):
            shape[axis] = width
        specs[key] = (calc, tuple(shape))
    seconds = {"read": 0.0, "rotate": 0.0, "write": 0.0}
    total, done, next_say, t_start = sum(numel(sh) for _, sh in specs.values()), 0, 0.1, time.perf_counter()
    with ShardedCheckpoint(directory, specs, "5GB") as files:
        for key, (_, shape) in specs.items():
            rows = int(source.inputs.specs[key][1][0]) if shape else 1
            blocked = stream.writes_and_reads(key) == [1] and len(shape) == 2
            step = max(1, ROW_BLOCK_ELEMENTS // max(1, stream.hidden_size)) if blocked else rows
            for a in range(0, rows, step):
                b = min(rows, a + step)
                t0 = time.perf_counter()
                raw = source.inputs.read(key, a, b).to(calc) if blocked else source.fetch(key, calc)
                t1 = time.perf_counter()
                value = rotated_tensor(key, raw.to(device), stream, width, q).cpu().contiguous()
                t2 = time.perf_counter()
                files.write(key, value, row=a if blocked else 0)
                seconds["read"] += t1 - t0
                seconds["rotate"] += t2 - t1
                seconds["write"] += time.perf_counter() - t2
            done += numel(shape)
            if done / total >= next_say:  # about ten progress lines, whatever the model
                next_say = done / total + 0.1
                spent = time.perf_counter() - t_start
                left = spent * (total - done) / done
                say(f"rotating: {done / total:.0%} of the stream's tensors, {spent:.0f} s, ~{left:.0f} s left")
    return SafetensorsFiles(directory, weight_files(directory)[1]), seconds


class RotatedWeights:
    """The sliced model's weights at the width its ``config`` declares: stream tensors narrowed from
    the rotated file (``rotate_once``), the head adapter computed once, the rest read through."""

    def __init__(self, source: ConvertedFiles, rotated, stream: StreamMap, q: torch.Tensor, config):
        self.source, self.rotated, self.stream, self.q = source, rotated, stream, q
        self.width = int(config.normswap["slice"]["width"])
        self.dims = stream.stream_dims()
        # ties from a meta-device build: a skeleton with real buffers re-registers every parameter,
        # which unties the head from its table
        self.groups = ckinputs.tie_groups(skeleton(config, buffers=False))
        self.extra: dict | None = None

    def _extras(self) -> dict:
        if self.extra is None:
            self.extra = {}
            if self.stream.tied_head is not None:

                def read(key):
                    return self.source.fetch(key, torch.float64) if self.source.has(key) else None

                # the head's own bias parameter, if any (a stored logits bias E·β is a buffer, not one:
                # the adapter's bias derives it from β itself)
                bias = getattr(self.source.meta.get_submodule(self.stream.tied_head), "bias", None)
                own = read(f"{self.stream.tied_head}.bias") if isinstance(bias, torch.nn.Parameter) else None
                self.extra = head_tensors(read, self.stream, self.width, self.q, own)
        return self.extra

    def resolve(self, key):
        """(kind, name): where ``key``'s value comes from: "extra", "stream" or "file"."""
        for name in [key] + [g for g in self.groups.get(key, [key]) if g != key]:
            if name in self._extras():
                return "extra", name
            if name in self.dims:
                return "stream", name
        return "file", key

    def value(self, key, dtype, out=None) -> torch.Tensor:
        """Tensor ``key`` of the sliced model in ``dtype`` (into ``out`` when given), cast once."""
        kind, name = self.resolve(key)
        if kind == "file":
            return self.source.fetch(key, dtype, out=out)
        if kind == "extra":
            value = self._extras()[name].to(dtype)
        elif name in self.stream.unit_scales:
            value = torch.ones(self.width, dtype=dtype)
        else:
            return self._narrowed(name, dtype, out)
        return out.copy_(value) if out is not None and tuple(out.shape) == tuple(value.shape) else value

    def _narrowed(self, name, dtype, out):
        full = self.rotated.specs[name][1]
        full_width = self.stream.hidden_size - 1
        shape = [self.width if axis in self.stream.writes_and_reads(name) else n for axis, n in enumerate(full)]
        if out is None or list(out.shape) != shape:
            out = torch.empty(shape, dtype=dtype)
        rows = shape[0] if shape else 1
        step = max(1, ROW_BLOCK_ELEMENTS // max(1, numel(full[1:]))) if full else 1
        for a in range(0, rows, step):
            b = min(rows, a + step)
            block = self.rotated.read(name, a, b) if full else self.rotated.read(name)
            out[a:b].copy_(narrowed(name, block, self.stream, self.width, full_width, rows_kept=True))
        return out

    def fetch(self, key, dtype, out=None, pool=None) -> torch.Tensor:
        return self.value(key, dtype, out=out)


def logprobs(model, fetch, inputs: dict, *, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Per-token log-probabilities (float64, CPU) of ``model`` (a skeleton) on ``inputs``, the
    weights coming module by module from ``fetch``."""
    return runner.outputs(lambda: model, fetch, dtype, inputs, True, device=device)


class _Enough(Exception):
    """Raised at the head's door: calibration needs the norms' inputs, not the logits."""


def _stop_at_head(module, args):
    raise _Enough


class SpilledMoments(SecondMoments):
    """Σ per norm kept in a private file each, not in memory: a d × d float64 sum is 33 MB at
    d = 2048 and 134 MB at 4096, so a model's fifty-odd norms would hold more than one layer's
    weights. Each hook reads its norm's sum, adds the block's xᵀx and writes it back; the total
    over the norms (what PCA needs) stays in memory, one d × d."""

    def __init__(self, model, norm_names, directory):
        super().__init__(model, norm_names)
        self.directory = Path(directory)
        self.total: torch.Tensor | None = None

    def _hook(self, name):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
            if not isinstance(x, torch.Tensor):
                return None
            flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
            part = flat.T @ flat
            self.total = part.clone() if self.total is None else self.total.add_(part)
            path = self.sums.get(name, self.directory / f"sigma-{len(self.sums)}.f64")
            acc = part.cpu()
            if path.exists():
                acc = acc + torch.from_file(str(path), size=acc.numel(), dtype=torch.float64).view_as(acc)
            acc.numpy().tofile(path)
            self.sums[name] = path  # where its Σ is (MomentFiles reads it)
            self.tokens[name] = self.tokens.get(name, 0) + flat.shape[0]
            return None

        return hook


class MomentFiles(Mapping):
    """{norm: Σ (float64, CPU)} read from SpilledMoments' files one at a time, with ``total``."""

    def __init__(self, paths: dict, d: int, total: torch.Tensor):
        self.paths, self.d, self.total = paths, d, total

    def __getitem__(self, name) -> torch.Tensor:
        return torch.from_file(str(self.paths[name]), size=self.d * self.d, dtype=torch.float64).view(self.d, self.d)

    def __iter__(self):
        return iter(self.paths)

    def __len__(self):
        return len(self.paths)


def calibrate(model, fetch, batches, norm_names, *, dtype=torch.float32, device="cpu", say=None, spill=None):
    """({norm: Σ float64 on the CPU}, tokens): each calibration batch run through ``model`` one
    module at a time (weights from ``fetch``), Σ accumulated in float64 by the norms' pre-hooks
    (in files under ``spill``: a MomentFiles mapping, whose ``total`` is their sum). The head never
    runs (no vocabulary-wide logits): the run stops at its door."""
    say = say or (lambda msg: None)
    head = output_embeddings(model)
    stop = head.register_forward_pre_hook(_stop_at_head) if head is not None else None
    tokens, t0 = 0, time.perf_counter()
    hooks = SpilledMoments(model, norm_names, spill) if spill is not None else SecondMoments(model, norm_names)
    try:
        with hooks as moments:
            blockwise = runner.Blockwise(model, fetch, dtype, device)
            for i, batch in enumerate(batches):
                try:
                    blockwise({"input_ids": batch})
                except _Enough:
                    pass
                tokens += int(batch.numel())
                spent = time.perf_counter() - t0
                left = spent / (i + 1) * (len(batches) - i - 1)
                say(f"calibration: batch {i + 1}/{len(batches)}, {tokens:,} tokens, {spent:.0f} s, ~{left:.0f} s left")
    finally:
        if stop is not None:
            stop.remove()
    missing = [n for n in norm_names if n not in moments.sums]
    if missing:
        raise NormswapError(f"calibration: norm {missing[0]} never ran; slice cannot fit a rotation for it")
    if spill is not None:
        return MomentFiles(dict(moments.sums), int(moments.total.shape[0]), moments.total.cpu()), tokens
    return {name: s.cpu() for name, s in moments.sums.items()}, tokens


def write_sliced(tmp, meta, weights: RotatedWeights, out_dtype, *, max_shard_size="5GB", say=None) -> int:
    """The sliced checkpoint's weights into ``tmp``, tensor by tensor: one tensor rotated at a time,
    cast once to ``out_dtype`` (integer tensors as they are). Returns the bytes written."""
    say = say or (lambda msg: None)
    specs, seen = {}, set()
    persistent = ckinputs.persistent_buffers(meta)
    params = dict(meta.named_parameters(remove_duplicate=False))
    for key, t in meta.state_dict(keep_vars=True).items():
        if id(t) in seen or (key not in params and key not in persistent):
            continue
        seen.add(id(t))
        specs[key] = (out_dtype if t.dtype.is_floating_point else t.dtype, tuple(t.shape))
    total = sum(s.numel() * dt.itemsize for dt, s in ((d, torch.Size(sh)) for d, sh in specs.values()))
    done, t0, next_say = 0, time.perf_counter(), 0.1
    with ShardedCheckpoint(tmp, specs, max_shard_size) as files:
        for key, (dtype, shape) in specs.items():
            kind, _ = weights.resolve(key)
            raw = weights.source.files.raw(weights.source.inputs.disk_key(key)) if kind == "file" else None
            if raw is not None and weights.source.file_dtype(key) == dtype:
                files.copy(key, *raw)  # passed through unchanged: file to file, no cast
            else:
                value = weights.value(key, dtype)
                if tuple(value.shape) != shape:
                    raise NormswapError(
                        f"internal error: sliced {key} is {tuple(value.shape)}, the model holds {shape}"
                    )
                files.write(key, value.contiguous())
                del value
            done += numel(shape) * dtype.itemsize
            if total and done / total >= next_say:  # about ten progress lines, whatever the model
                next_say = done / total + 0.1
                spent = time.perf_counter() - t0
                left = spent * (total - done) / done
                say(f"writing: {done / 1e9:.2f}/{total / 1e9:.2f} GB, {spent:.0f} s, ~{left:.0f} s left")
    return total


def check_stream(source: ConvertedFiles) -> StreamMap:
    """The stream map of the conversion (slice/stream.py refuses what cannot rotate), read off its
    meta-device skeleton, whose tied head still shares its table."""
    return stream_map(source.meta)


def calc_dtype(out_dtype) -> torch.dtype:
    """The rotation's arithmetic dtype for an output dtype: convert's rule (float64 unless the
    output is 16-bit, where float32's rounding is ~1000× below the output's own)."""
    return compute_dtype(out_dtype)


def perplexity(model, fetch, batches, *, dtype=torch.float32, device="cpu", say=None) -> float:
    """exp(mean next-token NLL) of ``model`` (a skeleton, weights from ``fetch`` one module at a
    time) over token blocks ``batches``; the log-softmax in float32, the sum in float64."""
    say = say or (lambda msg: None)
    blockwise = runner.Blockwise(model, fetch, dtype, device)
    nll, count = 0.0, 0
    for i, batch in enumerate(batches):
        logits = blockwise({"input_ids": batch}).logits[:, :-1].float()
        target = batch[:, 1:].to(logits.device).unsqueeze(-1)
        nll -= float(logits.log_softmax(-1).gather(-1, target).double().sum())
        count += int(target.numel())
        say(f"perplexity: batch {i + 1}/{len(batches)}")
    return math.exp(nll / max(1, count))


def largest_module_bytes(model, itemsize: int = 4) -> int:
    """The largest set of parameters one module owns (what Blockwise holds at once), in bytes."""
    largest = 0
    for module in model.modules():
        largest = max(largest, sum(p.numel() for p in module._parameters.values() if p is not None))
    return largest * itemsize


def block_activation_bytes(config, seq_len: int) -> int:
    """A bound on one calibration block's live activations in a layer's forward (float32): the
    stream, the MLP's inner width, attention scores and a few temporaries of each."""
    d = int(getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 1024)
    inner = int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * d)
    heads = int(getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 16)
    return 4 * seq_len * (8 * d + 2 * inner) + 4 * 3 * heads * seq_len * seq_len


def blocks_per_batch(budget: int, model, config, seq_len: int, *, most: int) -> int:
    """How many calibration blocks run at once within ``budget`` bytes (at most ``most``); a budget
    too small for one layer's float32 weights and one block is a one-line refusal."""
    weights = largest_module_bytes(model)
    block = block_activation_bytes(config, seq_len)
    fits = (budget - weights) // block
    if fits < 1:
        raise NormswapError(
            f"--memory-budget {_size(budget)} is too small for one layer: the largest module needs "
            f"{_size(weights)} in float32 and one calibration block ~{_size(block)}"
        )
    return int(min(most, fits))


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
