"""Sharded safetensors written tensor by tensor, with a bounded memory footprint.

Every writer of weights in normswap goes through here (conversion, ``write.write_weights``).
Each output tensor's dtype and shape are known up front, so a shard is laid out first, its header
written, and each tensor's bytes filled in place, in any order, in row pieces and from several
threads (``pwrite`` at disjoint offsets): memory stays at one piece, whatever the shard size.

The layout is the one ``safetensors`` itself writes (tensors ordered by dtype, then by name;
header padded with spaces to 8 bytes), so the data section is byte-identical to ``save_file``'s
and any safetensors reader loads the result.
"""

from __future__ import annotations

import json
import os
import struct
from functools import lru_cache
from pathlib import Path

import torch

from normswap.errors import NormswapError
from normswap.version import __version__

# A converted checkpoint stores its weights under a transformers "variant" name
# (model.normswap.safetensors). Its config keeps the source's built-in model_type, so stock
# AutoConfig/AutoTokenizer read it without remote code and without a prompt; a stock model class
# (which would build LayerNorm) finds no model.safetensors and fails loudly, while normswap's
# classes ask for the variant. transformers' own names: `_add_variant` in modeling_utils.
WEIGHTS_VARIANT = "normswap"
INDEX_NAME = f"model.safetensors.index.{WEIGHTS_VARIANT}.json"
SINGLE_NAME = f"model.{WEIGHTS_VARIANT}.safetensors"  # what shard_names/index_name give for the variant

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def parse_size(size) -> int:
    """'5GB' -> 5e9; also MB, KB, GiB, MiB or a plain byte count."""
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    try:
        return int(float(text))
    except ValueError:
        raise NormswapError(f"--max-shard-size: cannot read {size!r} as a size (e.g. 5GB, 500MB)") from None


def nbytes(dtype: torch.dtype, shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def plan_shards(specs: dict, max_shard_size) -> list[list[str]]:
    """Split ``{key: (dtype, shape)}`` (in write order) greedily, as ``write.write_weights`` does."""
    limit = parse_size(max_shard_size)
    shards, current, size = [], [], 0
    for key, (dtype, shape) in specs.items():
        n = nbytes(dtype, shape)
        if current and size + n > limit:
            shards.append(current)
            current, size = [], 0
        current.append(key)
        size += n
    shards.append(current)
    return shards


def shard_names(count: int, variant: str | None = WEIGHTS_VARIANT) -> list[str]:
    """transformers' file names (``_add_variant``); ``variant=None``: the stock names a stock class loads."""
    stem = f"model.{variant}" if variant else "model"
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def index_name(variant: str | None = WEIGHTS_VARIANT) -> str:
    return f"model.safetensors.index.{variant}.json" if variant else "model.safetensors.index.json"


def write_index(
    directory: Path, shards: list[list[str]], names: list[str], specs: dict, variant: str | None = WEIGHTS_VARIANT
) -> Path | None:
    """The index json for a multi-file checkpoint (none for a single file), as write_weights writes it."""
    if len(shards) == 1:
        return None
    weight_map, total = {}, 0
    for keys, name in zip(shards, names):
        for key in keys:
            weight_map[key] = name
            total += nbytes(*specs[key])
    path = Path(directory) / index_name(variant)
    with open(path, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return path


@lru_cache(maxsize=1)
def _dtype_rank() -> dict:
    """safetensors' own data order (by dtype, descending), read off a tiny file it serialises."""
    from safetensors.torch import save

    probe = {name: torch.zeros(1, dtype=dt) for dt, name in _ST_DTYPES.items()}
    raw = save(probe)
    (n,) = struct.unpack("<Q", raw[:8])
    order = [k for k in json.loads(raw[8 : 8 + n]) if k != "__metadata__"]
    return {name: i for i, name in enumerate(order)}


class _ClosedOnSuccess:
    """``with``: close() when the block succeeds, abort() when it raises."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


class ShardWriter(_ClosedOnSuccess):
    """One safetensors file whose tensors are known in advance and written piece by piece.

    ``write(key, tensor, row=0)`` stores ``tensor`` (contiguous, the declared dtype) as rows
    ``row ...`` of ``key`` (dimension 0). ``close()`` refuses a file with bytes never written.
    """

    def __init__(self, path, specs: dict, metadata: dict | None = None):
        self.path = Path(path)
        self.specs = {k: (dt, tuple(int(s) for s in shape)) for k, (dt, shape) in specs.items()}
        for key, (dt, _) in self.specs.items():
            if dt not in _ST_DTYPES:
                raise NormswapError(f"cannot write {key}: dtype {dt} has no safetensors name")
        rank = _dtype_rank()
        order = sorted(self.specs, key=lambda k: (rank[_ST_DTYPES[self.specs[k][0]]], k))
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self.offsets, pos = {}, 0
        for key in order:
            dt, shape = self.specs[key]
            n = nbytes(dt, shape)
            header[key] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [pos, pos + n]}
            self.offsets[key] = (pos, n)
            pos += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.data_start = 8 + len(text)
        self.size = self.data_start + pos
        self.written = dict.fromkeys(self.specs, 0)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            os.pwrite(self._fd, struct.pack("<Q", len(text)) + text, 0)
            os.ftruncate(self._fd, self.size)
        except BaseException:
            os.close(self._fd)
            raise

    def write(self, key: str, tensor: torch.Tensor, row: int = 0) -> None:
        dt, shape = self.specs[key]
        if tensor.dtype != dt:
            raise NormswapError(f"internal error: {key} is {tensor.dtype}, declared {dt}")
        start, total = self.offsets[key]
        row_bytes = nbytes(dt, shape[1:]) if shape else total
        if tuple(tensor.shape[1:]) != shape[1:] and shape:
            raise NormswapError(f"internal error: {key} piece has shape {tuple(tensor.shape)}, declared {shape}")
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        offset = row * row_bytes
        if offset + data.nbytes > total:
            raise NormswapError(f"internal error: {key} piece overruns its {total} bytes")
        view = memoryview(data)
        done = 0
        while done < len(view):  # pwrite may write less than asked
            done += os.pwrite(self._fd, view[done:], self.data_start + start + offset + done)
        self.written[key] += data.nbytes

    def copy(self, key: str, fd: int, offset: int, nbytes: int) -> None:
        """Fill ``key`` with ``nbytes`` raw bytes of file ``fd`` at ``offset`` (kernel to kernel where it can)."""
        start, total = self.offsets[key]
        if nbytes != total:
            raise NormswapError(f"internal error: {key} is {nbytes} bytes in the source, declared {total}")
        done = 0
        try:
            while done < total:
                n = os.copy_file_range(fd, self._fd, total - done, offset + done, self.data_start + start + done)
                if n <= 0:
                    break
                done += n
        except (OSError, AttributeError):  # no copy_file_range here (older kernel, other filesystem)
            pass
        while done < total:
            chunk = os.pread(fd, min(total - done, 16 * 2**20), offset + done)
            if not chunk:
                raise NormswapError(f"cannot read {key}: its source file ended early")
            view = memoryview(chunk)
            while len(view):
                n = os.pwrite(self._fd, view, self.data_start + start + done)
                view, done = view[n:], done + n
        self.written[key] += total

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            short = [k for k, n in self.written.items() if n != self.offsets[k][1]]
            if short:
                raise NormswapError(
                    f"internal error: {len(short)} tensors incompletely written to {self.path.name} (first: {short[0]})"
                )
        finally:
            os.close(self._fd)
            self._fd = None

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def default_metadata() -> dict:
    return {"format": "pt", "producer": f"normswap {__version__}"}


class ShardedCheckpoint(_ClosedOnSuccess):
    """All weight files of a checkpoint directory: split, opened and filled key by key.

    ``specs`` ({key: (dtype, shape)}, in write order) is split greedily at ``max_shard_size``;
    ``write``/``copy`` go to the shard holding the key; ``close`` checks every byte was
    written and writes the index for a multi-file checkpoint. ``variant``: the file names'
    variant (normswap's by default; None for the stock names ``normswap export`` writes).
    """

    def __init__(
        self,
        directory,
        specs: dict,
        max_shard_size="5GB",
        metadata: dict | None = None,
        variant: str | None = WEIGHTS_VARIANT,
    ):
        self.directory = Path(directory)
        self.specs = specs
        self.variant = variant
        self.shards = plan_shards(specs, max_shard_size)
        self.names = shard_names(len(self.shards), variant)
        self.writers, self.where = [], {}
        try:
            for keys, name in zip(self.shards, self.names):
                writer = ShardWriter(self.directory / name, {k: specs[k] for k in keys}, metadata or default_metadata())
                self.writers.append(writer)
                for key in keys:
                    self.where[key] = writer
        except BaseException:
            self.abort()
            raise

    def write(self, key, tensor, row=0):
        self.where[key].write(key, tensor, row)

    def copy(self, key, fd, offset, nbytes):
        self.where[key].copy(key, fd, offset, nbytes)

    def close(self) -> list[str]:
        for writer in self.writers:
            writer.close()
        write_index(self.directory, self.shards, self.names, self.specs, self.variant)
        return list(self.names)

    def abort(self):
        for writer in self.writers:
            writer.abort()
