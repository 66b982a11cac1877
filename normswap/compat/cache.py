"""The matrix's row cache: each finished row's record on disk, so a rerun redoes only what changed.

A row costs minutes (torch.compile's build, a Trainer, two ONNX exports) and the matrix has 80-odd,
so regenerating it after a change to one family must not redo the rest. A row's record is reused
only when its key matches: a digest of the schema, normswap's version, the source that decides a
row's cells (``SOURCE_PARTS``), the versions of the libraries the checks run, the row itself, its
tiny config and the columns asked for. Change any of them and the row runs again.

The cache is read back from disk, so it is untrusted input:
- the directory is normswap's private cache (private_dirs.cache_dir: created 0700, or checked to be
  this user's with nothing on the way to it replaceable by another user), or ``--cache-dir``
  checked the same way;
- each entry is opened through a checked handle on that directory without following a link
  (private_dirs.open_private_file) and must be a regular file nobody else can write;
- it is JSON, never unpickled, and its record is checked against the schema (``why_invalid``)
  before it is used.
An entry that fails any of these is ignored, with one line on stderr saying which file and why, and
the row runs as if it were not there (its fresh record then replaces it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path

SCHEMA = 1
STATUSES = ("ok", "fail", "n/a", "skipped")
MAX_ENTRY_BYTES = 4 << 20  # a row's record is kilobytes
# the source a row's cells depend on (relative to the package): what builds, converts and checks a row.
# Not the CLI, the benches, or compat/matrix.py (it runs rows and renders the table; a new table layout
# must not send every row through its minutes again)
SOURCE_PARTS = (
    "compat/rows.py",
    "compat/checks.py",
    "compat/cache.py",
    "convert",
    "export",
    "architectures",
    "checkpoint",
    "kernels",
    "modules.py",
    "model_facts.py",
    "version.py",
)
LIBRARIES = (
    "torch",
    "transformers",
    "tokenizers",
    "peft",
    "sentence-transformers",
    "onnx",
    "onnxruntime",
    "onnxscript",
)


@functools.cache
def source_digest() -> str:
    """sha256 over every file under SOURCE_PARTS (path and bytes, in a fixed order)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for part in SOURCE_PARTS:
        base = root / part
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" in f.parts:
                continue
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def library_versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in LIBRARIES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def row_key(row, columns) -> str:
    """The digest a cached record of ``row`` must carry to be reused (module doc)."""
    from normswap.compat.rows import row_config
    from normswap.version import __version__

    what = {
        "schema": SCHEMA,
        "normswap": __version__,
        "source": source_digest(),
        "libraries": library_versions(),
        "row": row.as_dict(),
        "config": row_config(row).to_dict(),
        "columns": list(columns),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def why_invalid(entry, row, key: str, columns) -> str | None:
    """Why ``entry`` (parsed JSON) is not a record of ``row`` under ``key``, or None when it is one."""
    if not isinstance(entry, dict) or entry.get("schema") != SCHEMA:
        return f"not a schema-{SCHEMA} matrix cache entry"
    if entry.get("key") != key:
        return "computed for other inputs (source, libraries, config or columns changed)"
    rec = entry.get("record")
    if not isinstance(rec, dict) or rec.get("name") != row.name:
        return "its record is not this row's"
    for field, want in row.as_dict().items():
        if rec.get(field) != want:
            return f"its record's {field} is {rec.get(field)!r}, not {want!r}"
    cells = rec.get("cells")
    if not isinstance(cells, dict) or set(cells) != set(columns):
        return "its cells are not the columns asked for"
    for name, cell in cells.items():
        if not isinstance(cell, dict) or cell.get("status") not in STATUSES or not isinstance(cell.get("detail"), str):
            return f"cell {name!r} is malformed"
        if cell.get("max_rel_diff") is not None and not _is_number(cell["max_rel_diff"]):
            return f"cell {name!r} has a non-numeric difference"
        if not isinstance(cell.get("parts", {}), dict) or not _is_number(cell.get("seconds", 0)):
            return f"cell {name!r} is malformed"
    if not (rec.get("convert") is None or isinstance(rec["convert"], dict)) or not _is_number(rec.get("seconds", 0)):
        return "its convert record or time is malformed"
    return None


def cacheable(record: dict) -> bool:
    """A record worth keeping: the row ran to its end (no time cap hit, no crashed child)."""
    cells = record.get("cells") or {}
    return "error" not in record and "seconds" in record and all(c["status"] != "skipped" for c in cells.values())


class RowCache:
    """Rows' records in ``directory`` (private; ``say``: where the lines about ignored entries go)."""

    def __init__(self, directory=None, say=None):
        from normswap.private_dirs import cache_dir, ensure_private_dir

        self.directory = ensure_private_dir(Path(directory)) if directory else cache_dir("compat-matrix")
        self.say = say or (lambda m: None)
        self.reused = 0

    def _name(self, row) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", row.name) + ".json"

    def _read(self, name: str) -> bytes | None:
        from normswap.private_dirs import NotPrivate, open_private_dir, open_private_file

        try:
            dir_fd = open_private_dir(self.directory)
        except NotPrivate as e:
            self.say(f"matrix cache: ignoring {self.directory}: {e}")
            return None
        try:
            fd = open_private_file(dir_fd, name, where=self.directory)
        except FileNotFoundError:
            return None
        except (NotPrivate, OSError) as e:
            self.say(f"matrix cache: ignoring {self.directory / name}: {e}")
            return None
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "rb") as f:
            return f.read(MAX_ENTRY_BYTES + 1)

    def get(self, row, key: str, columns) -> dict | None:
        """The cached record of ``row`` under ``key``, or None (absent, refused or stale: said why)."""
        data = self._read(self._name(row))
        if data is None:
            return None
        path = self.directory / self._name(row)
        try:
            entry = json.loads(data) if len(data) <= MAX_ENTRY_BYTES else None
        except ValueError:
            entry = None
        why = "not JSON (or larger than a record)" if entry is None else why_invalid(entry, row, key, columns)
        if why:
            self.say(f"matrix cache: ignoring {path}: {why}; running the row")
            return None
        self.reused += 1
        return entry["record"]

    def put(self, row, key: str, record: dict) -> None:
        from normswap.private_dirs import write_private_text

        entry = {"schema": SCHEMA, "key": key, "record": record}
        write_private_text(self.directory / self._name(row), json.dumps(entry, indent=1, default=str) + "\n")
