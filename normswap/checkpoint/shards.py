"""Sharded safetensors written tensor by tensor, with a bounded memory footprint.

``write.write_weights`` needs every tensor of a shard in memory before it calls ``save_file``. The
streaming conversion knows every output tensor's dtype and shape up front (from a meta-device
model), so it can lay a shard out first, write the header, and then fill each tensor's bytes in
place, in any order and in pieces: memory stays at one piece, whatever the shard size.

The layout is the one ``safetensors`` itself writes (tensors ordered by dtype, then by name;
header padded with spaces to 8 bytes), so the data section is byte-identical to ``save_file``'s
and any safetensors reader loads the result. The shard split and the index file follow
``write.write_weights`` exactly, so both conversion paths produce the same files.
"""

from __future__ import annotations

import json
import os
import struct
from functools import lru_cache
from pathlib import Path

import torch

from normswap import __version__
from normswap.errors import NormswapError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def parse_size(size) -> int:
    """'5GB' -> 5e9, with the very parser write.write_weights uses (same split, same files)."""
    from normswap.checkpoint.write import _parse_size

    return _parse_size(size)


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


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def write_index(directory: Path, shards: list[list[str]], names: list[str], specs: dict) -> Path | None:
    """The index json for a multi-file checkpoint (none for a single file), as write_weights writes it."""
    if len(shards) == 1:
        return None
    weight_map, total = {}, 0
    for keys, name in zip(shards, names):
        for key in keys:
            weight_map[key] = name
            total += nbytes(*specs[key])
    path = Path(directory) / INDEX_NAME
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


class ShardWriter:
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
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            short = [k for k, n in self.written.items() if n != self.offsets[k][1]]
            if short:
                raise NormswapError(f"internal error: {len(short)} tensors incompletely written to {self.path.name} (first: {short[0]})")
        finally:
            os.close(self._fd)
            self._fd = None

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def default_metadata() -> dict:
    return {"format": "pt", "producer": f"normswap {__version__}"}
