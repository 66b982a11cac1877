"""Tensor sources: where a conversion (or an export, or a size check) reads a checkpoint's tensors from.

Three kinds, one interface (``specs``, ``read``, ``raw``, ``close``), so that conversion has one
path whatever the checkpoint is stored as:

- ``SafetensorsFiles``: the checkpoint's safetensors files. Headers are validated with
  ``safe_open``; tensors are then read with ``pread`` at their recorded offsets, in row ranges,
  into fresh buffers (a long-lived memory map would count every touched page towards this
  process's resident memory until it is unmapped). ``raw`` exposes a tensor's bytes so that a
  tensor passed through unchanged is copied file to file by the kernel.
- ``StateDict``: tensors already in memory (``apply.convert_model``, tests).
- ``open_bin``: PyTorch ``.bin`` files, read with ``torch.load(weights_only=True)`` (no arbitrary
  unpickling) and memory-mapped where the file format allows it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from normswap.checkpoint import shards
from normswap.errors import NormswapError, first_line

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# (index, single file) names in the order looked for: a stock checkpoint's, then the variant
# names normswap's own checkpoints use (checkpoint/shards.py says why)
SAFETENSORS_NAMES = ((INDEX_NAME, SINGLE_NAME), (shards.INDEX_NAME, shards.SINGLE_NAME))
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# -- where a checkpoint's files are ---------------------------------------------------------------


def local_dir(resolved, *, download=True) -> Path | None:
    """A directory holding the checkpoint's files: the path itself, or a hub id's snapshot."""
    path = Path(str(resolved))
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    for local_only in (True, False):
        if not local_only and not download:
            return None
        try:
            found = Path(snapshot_download(str(resolved), local_files_only=local_only, allow_patterns=patterns))
        except Exception as e:
            if not local_only:
                raise NormswapError(f"cannot fetch the weight files of {resolved}: {first_line(e)}") from None
            continue
        if weight_files(found)[0] is None and not local_only:  # a repo with .bin weights only
            found = Path(snapshot_download(str(resolved), allow_patterns=patterns + ["*.bin"]))
        return found
    return None


def weight_files(directory: Path) -> tuple[str | None, list[Path]]:
    """('safetensors', files) | ('bin', files) | (None, []), preferring safetensors like transformers.

    Every file named is a regular file inside the model directory (links followed only when they stay
    inside it, or, for a hub snapshot, inside its repository folder, whose blobs it links to: the
    side-file rule); a link anywhere else, or a FIFO or device in a weight file's place, is refused
    by name here, before anything opens it (an open of a FIFO blocks until someone writes to it)."""
    for index_name, single_name in SAFETENSORS_NAMES:
        if _regular(directory / index_name, directory):
            return "safetensors", _indexed_files(directory, directory / index_name)
        if _regular(directory / single_name, directory):
            return "safetensors", [directory / single_name]
    if _regular(directory / BIN_INDEX_NAME, directory):
        return "bin", _indexed_files(directory, directory / BIN_INDEX_NAME)
    bins = sorted(p for p in directory.glob("pytorch_model*.bin") if _regular(p, directory))
    if bins:
        return "bin", bins
    return None, []


def _regular(path: Path, directory: Path) -> bool:
    """Whether the weight file ``path`` of the model ``directory`` is there (a regular file); refused
    in one line when it is a link out of the model directory, or something that is not a regular file
    stands in its place."""
    from normswap.bounded_load import file_kind
    from normswap.checkpoint.side_files import model_root

    try:
        st = os.stat(path)
    except OSError:
        return False  # absent, or a dangling link: not there
    real, root = Path(path).resolve(), model_root(directory).resolve()
    if not real.is_relative_to(root):
        raise NormswapError(
            f"{path} is a symbolic link to {real}, outside the model directory {directory}: normswap reads no "
            "weights from elsewhere (they would be published as this model's); copy the file into the model "
            "directory instead of linking it; nothing was written"
        )
    kind = file_kind(st.st_mode)
    if kind:
        raise NormswapError(f"{path} is {kind}, not a regular file; a model's weights must be a plain file")
    return True


def _indexed_files(directory: Path, index: Path) -> list[Path]:
    from normswap import bounded_load

    try:
        weight_map = bounded_load.load_json(index, what="a weight index", follow=True)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (KeyError, TypeError, AttributeError):
        raise NormswapError(f"{index} is not a valid weight index (no weight_map)") from None
    except bounded_load.BoundedLoadError as e:
        if e.syntax is None:
            raise
        raise NormswapError(f"{index} is not a valid weight index (no weight_map)") from None
    for name in names:
        path = directory / name
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            raise NormswapError(f"{index.name} names {name!r}, which is outside the checkpoint directory")
        if not _regular(path, directory):
            raise NormswapError(f"{directory} is incomplete: {name} is listed in {index.name} but absent")
    return [directory / n for n in names]


def open_source(directory: Path, label: str):
    """The tensor source for a checkpoint directory, or a one-line refusal."""
    fmt, files = weight_files(directory)
    if fmt == "safetensors":
        return SafetensorsFiles(directory, files)
    if fmt == "bin":
        return open_bin(files, label)
    raise NormswapError(f"{label} holds no weights (no model.safetensors, index or pytorch_model.bin)")


# -- the sources ------------------------------------------------------------------------------


class SafetensorsFiles:
    """The safetensors files of a checkpoint, read lazily in row ranges."""

    kind = "safetensors"

    def __init__(self, directory: Path, files: list[Path]):
        from safetensors import safe_open

        self.directory = Path(directory)
        self.files = list(files)
        self.specs: dict = {}  # file key -> (torch dtype, shape)
        self.where: dict = {}  # file key -> path
        self.offsets: dict = {}  # file key -> absolute byte offset
        self.duplicates: list = []  # keys stored in more than one file
        self.metadata: dict = {}
        self._fds: dict = {}
        for index_name, _ in SAFETENSORS_NAMES:
            index = self.directory / index_name
            if index.is_file():
                self.metadata = json.loads(index.read_text()).get("metadata") or {}
                break
        for path in self.files:
            try:
                with safe_open(str(path), framework="pt") as handle:
                    keys = list(handle.keys())
            except Exception as e:  # safetensors' own error type: truncated or not safetensors at all
                raise NormswapError(
                    f"cannot read weights of {self.directory}: {path.name} is a corrupted safetensors "
                    f"file ({first_line(e)})"
                ) from None
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for key in keys:
                if key in self.where:
                    self.duplicates.append(key)
                    continue
                entry = header[key]
                dtype = ST_DTYPES.get(entry["dtype"])
                if dtype is None:
                    raise NormswapError(
                        f"{path.name}: tensor {key} has dtype {entry['dtype']}, which normswap does not read"
                    )
                self.where[key] = path
                self.specs[key] = (dtype, tuple(int(s) for s in entry["shape"]))
                self.offsets[key] = 8 + n + int(entry["data_offsets"][0])

    def _fd(self, path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def raw(self, key):
        """(fd, byte offset, byte count) of ``key`` in its file."""
        dtype, shape = self.specs[key]
        return self._fd(self.where[key]), self.offsets[key], numel(shape) * element_size(dtype)

    def read(self, key, start=None, stop=None, out=None) -> torch.Tensor:
        """Tensor ``key`` (rows ``start:stop`` of dimension 0 when given) in its file dtype.

        ``out``: a uint8 buffer of at least the rows' size to read into (a view of it is returned),
        so that a caller reading block after block reuses pages instead of faulting in new ones.
        """
        dtype, shape = self.specs[key]
        if not shape:
            start, stop = 0, 1
        elif start is None:
            start, stop = 0, shape[0]
        row = numel(shape[1:]) * element_size(dtype)
        size = (stop - start) * row
        out_shape = (stop - start, *shape[1:]) if shape else ()
        buf = out[:size] if out is not None and out.numel() >= size else torch.empty(size, dtype=torch.uint8)
        if size:
            fd, offset, _ = self.raw(key)
            view, done = memoryview(buf.numpy()), 0
            while done < size:
                got = os.preadv(fd, [view[done:]], offset + start * row + done)
                if got <= 0:
                    raise NormswapError(f"cannot read {key} from {self.where[key].name}: the file ended early")
                done += got
        return buf.view(dtype).reshape(out_shape)

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class StateDict:
    """Tensors already in memory, behind the same interface as the files."""

    kind = "state-dict"

    def __init__(self, tensors: dict, metadata: dict | None = None):
        self.tensors = {k: v.detach() for k, v in tensors.items()}
        self.specs = {k: (t.dtype, tuple(t.shape)) for k, t in self.tensors.items()}
        self.duplicates: list = []
        self.metadata = metadata or {}
        self.files: list = []

    def raw(self, key):
        return None

    def read(self, key, start=None, stop=None, out=None) -> torch.Tensor:  # out: already in memory, unused
        t = self.tensors[key]
        if start is None or t.dim() == 0:
            return t.cpu()
        return t[start:stop].cpu()

    def close(self):
        pass


def check_backed(tensors: dict, where: str) -> None:
    """Refuse, before anything is built from them, tensors that declare more bytes than the file holds.

    A ``.bin`` file stores storages and, per tensor, a view on one: shape, strides and offset. A view
    may repeat its storage's bytes (stride 0, an ``expand``), so a 16 KB file can declare the shapes
    of a 3.3B-parameter model that every shape check accepts and that loading then allocates for real.
    So each tensor must fit in its own storage, and the distinct views together
    (one view shared by tied weights counts once) must fit in the bytes of the distinct storages."""
    storages, views, declared = {}, set(), 0
    for key, t in tensors.items():
        storage = t.untyped_storage()
        held = storage.nbytes()
        need = t.numel() * t.element_size()
        if need > held:
            raise NormswapError(
                f"{where}: tensor {key} declares shape {list(t.shape)} ({need:,} bytes) over {held:,} bytes stored "
                "(a view that repeats its data): the file does not hold the weights its shapes claim; nothing was built"
            )
        storages[(storage.data_ptr(), held)] = held
        view = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if view not in views:
            views.add(view)
            declared += need
    held = sum(storages.values())
    if declared > held:
        raise NormswapError(
            f"{where}: its tensors declare {declared:,} bytes over {held:,} bytes stored (views that overlap "
            "one another): the file does not hold the weights its shapes claim; nothing was built"
        )


def bin_shapes(files: list[Path], label: str) -> dict:
    """{tensor name: shape} of ``.bin`` weight files, each checked by :func:`check_backed` (memory-mapped:
    nothing is copied, and a view's declared size is never allocated)."""
    source = open_bin(files, label)
    return {k: tuple(t.shape) for k, t in source.tensors.items()}


def open_bin(files: list[Path], label: str) -> StateDict:
    """PyTorch .bin weights through the restricted unpickler (tensors and plain containers only)."""
    tensors: dict = {}
    duplicates = []
    for path in files:
        if not _regular(path, path.parent):  # checked again just before the open: a FIFO would block torch.load
            raise NormswapError(f"cannot read weights of {label}: {path.name} is gone")
        try:
            try:
                loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                loaded = torch.load(path, map_location="cpu", weights_only=True)  # legacy format: no mmap
        except Exception as e:
            raise NormswapError(
                f"cannot read weights of {label}: {path.name} is not a plain PyTorch weights file ({first_line(e)})"
            ) from None
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
        ):
            raise NormswapError(f"cannot read weights of {label}: {path.name} does not hold a flat dict of tensors")
        check_backed(loaded, f"{label}: {path.name}")
        for key, tensor in loaded.items():
            if key in tensors:
                duplicates.append(key)
                continue
            tensors[key] = tensor
    source = StateDict(tensors)
    source.duplicates = duplicates
    source.files = list(files)
    source.kind = "bin"
    return source
