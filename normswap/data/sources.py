"""Where documents come from: the embedded corpus, local files, saved datasets, or the hub.

Every source yields plain-text documents for one split. Sources that come without splits (a text
file, a JSONL file, a plain saved dataset, a hub dataset with only `train`) are split
deterministically by a hash of each document's text, ~90/5/5: the same text always lands in the
same split, so duplicates cannot straddle train and held-out, and the assignment survives
re-ordering or appending to the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from normswap import bounded_load, dir_links
from normswap.bounded_load import file_kind
from normswap.errors import NormswapError, first_line
from normswap.network import offline_env

SPLITS = ("train", "validation", "test")
# "all" (every document, no split) is for evaluating a user's own text in full.
_ACCEPTED_SPLITS = SPLITS + ("all",)

TEXT_SUFFIXES = (".txt", ".md")
# Plain text is cut into documents at paragraph breaks once this many characters have accumulated,
# so one long book becomes many documents that the hash split can spread over train and held-out.
TEXT_CHUNK_CHARS = 4000
# A text file is read in blocks of this many bytes. A line longer than LONG_LINE_CHARS is not a
# record but text without line breaks (a book on one line): it is cut just before whitespace into
# documents of about TEXT_CHUNK_CHARS, so memory never depends on the length of a line. Files
# whose lines are shorter give exactly the documents they gave when files were read whole.
READ_BYTES = 1 << 20
LONG_LINE_CHARS = 1 << 16

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")
_HUB_SPLIT_NAMES = {
    "train": ("train",),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test",),
}


def hash_split(text: str) -> str:
    """Deterministic 90/5/5 split of one document by a hash of its content."""
    bucket = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big") % 100
    if bucket < 90:
        return "train"
    return "validation" if bucket < 95 else "test"


def _check_split(split: str) -> None:
    if split not in _ACCEPTED_SPLITS:
        raise NormswapError(f"unknown split {split!r}; use one of {', '.join(_ACCEPTED_SPLITS)}")


def _nonblank(docs: Iterable[str]) -> Iterator[str]:
    return (d for d in docs if d and d.strip())


# Held-out notices already printed by this process (a training stream re-reads its split every epoch).
_NOTICES: set[tuple[str, tuple[str, ...]]] = set()
# The held-out fallback of the source whose split was decided last (split_rule reads it).
_LAST_FALLBACK: dict | None = None

HASH_RULE = "hash of each document's text: ~90 % train, 5 % validation, 5 % test (normswap.data.sources.hash_split)"


def _fallback_slices(make_docs: Callable[[], Iterable[str]], where: str) -> dict[int, str]:
    """Held-out documents to take from train when the hash leaves a held-out split empty.

    A small corpus (a few dozen documents) can hash no document into validation or test. Then the
    last ~5 % of its train-hashed documents (at least one per split) become that split instead:
    deterministic, never trained on, and announced in one line. The scan stops as soon as both
    held-out splits have a document, so a real corpus pays for a few dozen hashes only.
    """
    global _LAST_FALLBACK
    _LAST_FALLBACK = None
    seen = {"validation": False, "test": False}
    train_idx: list[int] = []
    n = 0
    for i, doc in enumerate(_nonblank(make_docs())):
        n += 1
        s = hash_split(doc)
        if s == "train":
            train_idx.append(i)
        else:
            seen[s] = True
            if all(seen.values()):
                return {}
    if n == 0:
        return {}  # no text at all: load_documents says so
    empty = tuple(s for s in ("validation", "test") if not seen[s])
    k = max(1, round(0.05 * n))
    if len(train_idx) - k * len(empty) < 1:
        raise NormswapError(
            f"{where} holds only {n} document(s): too few for both a training split and a held-out split; "
            "give more text or name the held-out set (finetune --eval-data)"
        )
    tail = train_idx[-k * len(empty) :]
    plan = {i: s for j, s in enumerate(empty) for i in tail[j * k : (j + 1) * k]}
    _LAST_FALLBACK = {"documents": n, "held_out_per_split": k, "splits": list(empty)}
    if (where, empty) not in _NOTICES:
        _NOTICES.add((where, empty))
        print(f"normswap: {where}: {fallback_words(_LAST_FALLBACK)}", file=sys.stderr)
    return plan


def fallback_words(fb: dict) -> str:
    """The held-out fallback in words: what is held out, and that the rest is what trains."""
    k, splits, n = fb["held_out_per_split"], fb["splits"], fb["documents"]
    held = " and ".join(f"{k} as {s}" for s in splits)
    return (
        f"only {n} documents and none hashed into the {' or '.join(splits)} split, so its last documents are held "
        f"out instead ({held}): training reads the other {n - k * len(splits)} and never these"
    )


def split_rule(spec: str) -> str:
    """How ``spec`` is split into train / validation / test, as actually applied (for manifests)."""
    spec = str(spec)
    if has_own_splits(spec) and not Path(spec).expanduser().is_dir():
        return "the source's own splits"
    try:
        next(iter(load_documents(spec, "validation")), None)  # decides the split (and the fallback) of this source
    except NormswapError:
        pass  # an empty held-out split: the rule is still the hash
    if _LAST_FALLBACK is None:
        return "the source's own splits" if has_own_splits(spec) else HASH_RULE
    return "hash of each document's text, then the held-out fallback: " + fallback_words(_LAST_FALLBACK)


def _hash_split(make_docs: Callable[[], Iterable[str]], split: str, where: str) -> Iterator[str]:
    """The documents of one split of a source that has no splits of its own (see hash_split)."""
    if split == "all":
        yield from _nonblank(make_docs())
        return
    plan = _fallback_slices(make_docs, where)
    for i, doc in enumerate(_nonblank(make_docs())):
        if plan.get(i, None) == split or (i not in plan and hash_split(doc) == split):
            yield doc


def has_own_splits(spec: str) -> bool:
    """True for corpora that come with held-out splits (the embedded corpus' books, a saved
    DatasetDict, a hub dataset); False for a user's plain files, which `normswap eval` reads whole."""
    spec = str(spec)
    if spec == "embedded":
        return True
    path = Path(spec).expanduser()
    if path.is_dir():
        return (path / "dataset_dict.json").is_file()
    return not path.exists() and bool(_HUB_ID.match(spec))


def finetune_splits(data: str, eval_data: str | None = None) -> tuple[str, str, str]:
    """(training split of ``data``, held-out source, held-out split) of a fine-tune.

    Without ``eval_data`` the held-out set is ``data``'s validation split. With it (finetune
    --eval-data), the held-out set is that source (its validation split, or all of a plain file),
    and a plain ``data`` file is trained on whole: the user has named what is held out.
    """
    data = str(data)
    if eval_data is None or str(eval_data) == data:
        return "train", data, "validation"
    return default_eval_split(data, "train"), str(eval_data), default_eval_split(str(eval_data), "validation")


def default_eval_split(spec: str, held_out: str = "test") -> str:
    """The split an evaluation reads when none is named: ``held_out`` of a corpus with its own
    splits, all of a user's explicit file or directory."""
    return held_out if has_own_splits(spec) else "all"


def _line_runs(para: str, chunk_chars: int) -> Iterator[str]:
    """Cut one long paragraph (a file with no blank lines: one record per line) into runs of whole
    lines of at least ~chunk_chars characters, so that a verse-per-line file still becomes many
    documents that the hash split can spread over train and held-out."""
    run = _LineRun(chunk_chars)
    for line in para.split("\n"):
        yield from run.add(line)
    yield from run.close()


class _LineRun:
    """Whole lines gathered until they hold at least ``chunk_chars`` characters."""

    def __init__(self, chunk_chars: int):
        self.chunk_chars, self.lines, self.size = chunk_chars, [], 0

    def add(self, line: str) -> list[str]:
        self.lines.append(line)
        self.size += len(line) + 1
        return self.close() if self.size >= self.chunk_chars else []

    def close(self) -> list[str]:
        done = ["\n".join(self.lines)] if self.lines else []
        self.lines, self.size = [], 0
        return done


class _Paragraphs:
    """Documents of a plain text, fed one line at a time (see _chunk_text).

    Paragraphs are separated by blank (whitespace-only) lines. Consecutive paragraphs are grouped
    into documents of at least ~chunk_chars characters; a paragraph longer than twice that with
    more than one line is cut into runs of whole lines instead. A paragraph is held only while it
    may still be short: once the part before its latest line passes 2 × chunk_chars, its lines flow
    straight into runs (one line held back, whose trailing whitespace the paragraph's end strips).
    """

    def __init__(self, chunk_chars: int):
        self.chunk_chars = chunk_chars
        self.group: list[str] = []  # short paragraphs waiting to fill a document
        self.group_size = 0
        self.lines: list[str] = []  # the current paragraph's lines (the first one left-stripped)
        self.held = 0  # len("\n".join(self.lines))
        self.run: _LineRun | None = None  # set once the current paragraph is known to be long

    def line(self, line: str) -> list[str]:
        if not line.strip():
            return self.end_paragraph()
        if self.run is not None:
            done = self.run.add(self.lines[-1])
            self.lines = [line]
            return done
        if not self.lines:
            line = line.lstrip()
        self.held += len(line) + (1 if self.lines else 0)
        self.lines.append(line)
        if len(self.lines) < 2 or self.held - len(line) - 1 <= 2 * self.chunk_chars:
            return []
        done = self.flush_group()
        self.run = _LineRun(self.chunk_chars)
        for held in self.lines[:-1]:
            done += self.run.add(held)
        self.lines = self.lines[-1:]
        return done

    def end_paragraph(self) -> list[str]:
        lines, run = self.lines, self.run
        self.lines, self.held, self.run = [], 0, None
        if run is not None:
            return run.add(lines[-1].rstrip()) + run.close()
        para = "\n".join(lines).strip()
        if not para:
            return []
        if len(para) > 2 * self.chunk_chars and "\n" in para:
            return self.flush_group() + list(_line_runs(para, self.chunk_chars))
        self.group.append(para)
        self.group_size += len(para)
        return self.flush_group() if self.group_size >= self.chunk_chars else []

    def flush_group(self) -> list[str]:
        done = ["\n\n".join(self.group)] if self.group else []
        self.group, self.group_size = [], 0
        return done

    def piece(self, piece: str) -> list[str]:
        """A piece of a line too long to be a record (see _text_lines): a document of its own."""
        piece = piece.strip()
        return self.end_paragraph() + self.flush_group() + ([piece] if piece else [])

    def close(self) -> list[str]:
        return self.end_paragraph() + self.flush_group()


def _chunk_text(lines: Iterable[tuple[bool, str]], chunk_chars: int = TEXT_CHUNK_CHARS) -> Iterator[str]:
    """Documents of a plain text given as ``(is_piece, text)`` items (see _text_lines): consecutive
    paragraphs grouped to at least ~chunk_chars characters; a paragraph longer than twice that (no
    blank lines) is cut into runs of lines; a line too long to be a record comes in pieces, each
    a document. Memory holds a few documents, whatever the length of the file or of its lines."""
    doc = _Paragraphs(chunk_chars)
    for is_piece, text in lines:
        yield from (doc.piece(text) if is_piece else doc.line(text))
    yield from doc.close()


def _utf8_blocks(path: Path, root: Path | None = None) -> Iterator[str]:
    """The file decoded in blocks of READ_BYTES; a character cut by a block's end waits for the next
    block; bytes that are not UTF-8 are refused with the file's line and byte offset. ``root``: the
    (resolved) data directory the file was found in, which the opened file must lie in
    (normswap/dir_links.py)."""
    carry, offset, newlines = b"", 0, 0  # undecoded bytes, and the bytes and lines before them
    with os.fdopen(bounded_load.open_regular(path, what="a text data file", follow=True), "rb") as f:
        if root is not None:
            dir_links.check_opened(f.fileno(), path, root)
        while True:
            raw = f.read(READ_BYTES)
            data = carry + raw
            if not data:
                return
            try:
                text, carry = data.decode("utf-8"), b""
            except UnicodeDecodeError as e:
                if not (raw and e.reason == "unexpected end of data"):
                    line = newlines + data.count(b"\n", 0, e.start) + 1
                    raise NormswapError(
                        f"{path}:{line}: not UTF-8 text ({e.reason} at byte {offset + e.start}); "
                        "convert the file to UTF-8"
                    ) from None
                text, carry = data[: e.start].decode("utf-8"), data[e.start :]
            newlines += text.count("\n")
            offset += len(data) - len(carry)
            yield text


_SPACE = re.compile(r"\s")


def _cut_long_line(line: str, chunk_chars: int, final: bool) -> tuple[list[str], str]:
    """Pieces of at least chunk_chars characters cut from the front of a too-long line, each just
    before whitespace (or at 2 × chunk_chars where there is none); and what is left. ``final``:
    the line ended, so what is left (at most ~2 × chunk_chars) is a piece too."""
    pieces, start = [], 0
    while len(line) - start > 2 * chunk_chars:
        space = _SPACE.search(line, start + chunk_chars, start + 2 * chunk_chars)
        cut = space.start() if space else start + 2 * chunk_chars
        pieces.append(line[start:cut])
        start = cut
    rest = line[start:]
    if final:
        return pieces + [rest], ""
    return pieces, rest


def _text_lines(
    path: Path, chunk_chars: int = TEXT_CHUNK_CHARS, root: Path | None = None
) -> Iterator[tuple[bool, str]]:
    """``(False, line)`` for each line of a text file (without its newline), read in bounded blocks;
    a line longer than LONG_LINE_CHARS is no record but text without line breaks, and comes as
    ``(True, piece)`` items of about chunk_chars characters, cut just before whitespace."""
    partial, long_line = "", False
    for block in _utf8_blocks(path, root):
        *complete, tail = block.split("\n")
        for line in complete:
            line, partial = partial + line, ""
            if long_line:
                pieces, _ = _cut_long_line(line, chunk_chars, final=True)
                yield from ((True, p) for p in pieces)
                long_line = False
            elif len(line) > LONG_LINE_CHARS:
                yield from ((True, p) for p in _cut_long_line(line, chunk_chars, final=True)[0])
            else:
                yield False, line
        partial += tail
        if long_line or len(partial) > LONG_LINE_CHARS:
            long_line = True
            pieces, partial = _cut_long_line(partial, chunk_chars, final=False)
            yield from ((True, p) for p in pieces)
    if long_line:
        yield from ((True, p) for p in _cut_long_line(partial, chunk_chars, final=True)[0])
    elif partial:
        yield False, partial


def _text_docs(paths: list[Path], root: Path | None = None) -> Iterator[str]:
    for p in paths:
        yield from _chunk_text(_text_lines(p, root=root))


def _json_array_docs(path: Path, text_field: str) -> Iterator[str]:
    """A .json file holding one array of records, parsed one record at a time (bounded_load.json_array:
    a record is held whole, the file never is)."""
    for i, row in bounded_load.json_array(path, what="a .json data file"):
        if isinstance(row, str):
            yield row
            continue
        if not isinstance(row, dict) or text_field not in row:
            keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise NormswapError(
                f"{path}: record {i} has no field {text_field!r} (found: {keys}); "
                "choose one with text_field / --text-field"
            )
        if isinstance(row[text_field], str):
            yield row[text_field]


def _too_deep(path: Path, lineno: int | None = None) -> str:
    where = f"{path}:{lineno}" if lineno else str(path)
    return (
        f"{where}: JSON nested too deeply to read (more levels than Python's parser allows); a text record is "
        "an object with a text field: fix or remove that record"
    )


def _starts_with_array(path: Path) -> bool:
    with os.fdopen(bounded_load.open_regular(path, what="a data file", follow=True), "rb") as f:
        head = f.read(4096).decode("utf-8", errors="replace").lstrip()
    return head.startswith("[")


def _jsonl_docs(path: Path, text_field: str) -> Iterator[str]:
    if path.suffix.lower() == ".json" and _starts_with_array(path):
        yield from _json_array_docs(path, text_field)
        return
    yield from _jsonl_records(path, text_field)  # refusals are bounded_load's one-line NormswapErrors


def _jsonl_records(path: Path, text_field: str) -> Iterator[str]:
    """One record a line, each line held whole only up to bounded_load's per-record cap."""
    for lineno, raw in bounded_load.lines(path, what="a .jsonl data file"):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise NormswapError(
                f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start} of the line); convert the file to UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise NormswapError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
        except RecursionError:
            raise NormswapError(_too_deep(path, lineno)) from None
        if not isinstance(row, dict) or text_field not in row:
            keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise NormswapError(
                f"{path}:{lineno}: no field {text_field!r} (found: {keys}); choose one with text_field / --text-field"
            )
        value = row[text_field]
        if value is None:
            continue
        if not isinstance(value, str):
            raise NormswapError(f"{path}:{lineno}: field {text_field!r} is {type(value).__name__}, not text")
        yield value


def _parquet_docs(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise NormswapError("reading parquet needs pyarrow: pip install pyarrow") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise NormswapError(f"{path}: not a readable parquet file ({type(e).__name__}: {first_line(e)})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise NormswapError(
            f"{path}: no column {text_field!r} (found: {', '.join(names)}); choose one with text_field / --text-field"
        )
    # Row groups stream the file instead of loading it whole.
    for i in range(pf.num_row_groups):
        try:
            values = pf.read_row_group(i, columns=[text_field]).column(0).to_pylist()
        except (
            OSError,
            ValueError,
            ArithmeticError,
        ) as e:  # pyarrow's errors (ArrowInvalid, ArrowIOError...) derive from these
            raise NormswapError(
                f"{path}: row group {i} of {pf.num_row_groups} is corrupt ({first_line(e)}); "
                "re-create or re-download the file"
            ) from None
        for value in values:
            if isinstance(value, str):
                yield value


def _dataset_docs(ds, text_field: str, where: str) -> Iterator[str]:
    for row in ds.select_columns([text_field]):
        value = row[text_field]
        if isinstance(value, str):
            yield value


def _from_dataset_object(obj, split: str, text_field: str, where: str) -> Iterator[str]:
    """A datasets.Dataset (no splits: hash-split it) or DatasetDict (use its own splits)."""
    import datasets

    if not isinstance(obj, datasets.DatasetDict):
        _check_column(obj, text_field, where)
        return _hash_split(lambda: _dataset_docs(obj, text_field, where), split, where)
    available = list(obj.keys())
    for name in available:
        _check_column(obj[name], text_field, where)
    if split == "all":
        return _nonblank(d for name in available for d in _dataset_docs(obj[name], text_field, where))
    native = {}
    for wanted, candidates in _HUB_SPLIT_NAMES.items():
        native[wanted] = next((c for c in candidates if c in obj), None)
    if native["train"] is None and len(available) == 1:
        native["train"] = available[0]
    if native[split] is not None and (split != "train" or all(native.values())):
        return _nonblank(_dataset_docs(obj[native[split]], text_field, where))
    if native["train"] is None:
        raise NormswapError(
            f"{where}: has no {split!r} split and no train split to derive it from (splits: {', '.join(available)})"
        )
    # A held-out split is missing: derive it from a hashed slice of train, and then train on the
    # remaining ~90 % only, so the derived held-out text is never trained on.
    train = native["train"]
    return _hash_split(lambda: _dataset_docs(obj[train], text_field, where), split, where)


def _check_column(ds, text_field: str, where: str) -> None:
    names = list(ds.column_names)
    if text_field not in names:
        raise NormswapError(
            f"{where}: no column {text_field!r} (found: {', '.join(names)}); choose one with text_field / --text-field"
        )


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _saved_dataset_docs(path: Path, split: str, text_field: str) -> Iterator[str]:
    import datasets

    try:
        obj = datasets.load_from_disk(str(path))
    except Exception as e:
        raise NormswapError(f"{path}: cannot load the saved dataset ({type(e).__name__}: {first_line(e)})") from e
    return _from_dataset_object(obj, split, text_field, str(path))


def _hub_docs(spec: str, split: str, text_field: str) -> Iterator[str]:
    """A hub dataset id, optionally `id:config` (e.g. `wikitext:wikitext-2-raw-v1`). Offline,
    `datasets` serves one loaded before from its cache and touches no network."""
    import datasets

    name, _, config = spec.partition(":")
    try:
        obj = datasets.load_dataset(name, config or None)
    except Exception as e:
        if offline_env():
            raise NormswapError(
                f"{spec!r} is neither a local file nor directory, nor a hub dataset in the datasets cache, and hub "
                f"datasets are unavailable offline ({offline_env()}); pass a local path or `embedded`"
            ) from None
        raise NormswapError(f"cannot load hub dataset {spec!r}: {first_line(e)}") from e
    return _from_dataset_object(obj, split, text_field, spec)


def _open_source(spec: str, split: str, text_field: str) -> Iterator[str]:
    """Resolve the source now (so a missing path fails at the call) and return its document stream."""
    if spec == "embedded":
        from normswap.data import kjv

        kjv.chapters()  # fail now if the corpus package is missing
        return kjv.documents(split)
    path = Path(spec).expanduser()
    try:
        kind = file_kind(path.stat().st_mode)
    except OSError:
        kind = None  # missing: said below
    if kind is not None and kind != "a directory":  # a FIFO would block the read, a device never end
        raise NormswapError(f"the data {spec} is {kind}, not a text file or directory; give a regular file")
    if path.is_dir():
        # the link rule of model directories: a link out of the directory is refused, not read
        inside = dir_links.files_inside(path)
        if _is_saved_dataset(path):
            return _saved_dataset_docs(path, split, text_field)
        files = [p for p in inside if p.suffix.lower() in TEXT_SUFFIXES]
        if not files:
            raise NormswapError(f"{path}: directory holds no .txt/.md files and is not a saved dataset")
        root = path.resolve()
        return _hash_split(lambda: _text_docs(files, root), split, str(path))
    if path.is_file():
        if path.stat().st_size == 0:
            raise NormswapError(f"{path}: the file is empty")
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            return _hash_split(lambda: _jsonl_docs(path, text_field), split, str(path))
        if suffix == ".parquet":
            return _hash_split(lambda: _parquet_docs(path, text_field), split, str(path))
        if suffix in TEXT_SUFFIXES or suffix == "":
            return _hash_split(lambda: _text_docs([path]), split, str(path))
        raise NormswapError(f"{path}: unsupported file type {suffix!r}; use .txt, .md, .jsonl, .parquet or a directory")
    looks_like_path = (
        spec.startswith((".", "/", "~"))
        or spec.count("/") > 1
        or (os.sep != "/" and os.sep in spec)
        or Path(spec).suffix.lower() in TEXT_SUFFIXES + (".jsonl", ".json", ".parquet")
    )
    if looks_like_path or not _HUB_ID.match(spec):
        raise NormswapError(f"no such file or directory: {spec}")
    return _hub_docs(spec, split, text_field)


def load_documents(spec: str, split: str = "train", *, text_field: str = "text") -> Iterator[str]:
    """Stream the documents of one split of a corpus.

    spec: `embedded`, a .txt/.md file or a directory of them, a .jsonl/.parquet file (column
    `text_field`), a directory written by `datasets.save_to_disk`, or a hub dataset id
    (`id` or `id:config`, online only). split: train, validation, test (or all).
    Raises NormswapError when the source is missing or malformed, or the split comes out empty.
    """
    _check_split(split)
    spec = str(spec)
    if not spec:
        raise NormswapError("empty data source; pass `embedded` or a path")
    return _nonempty(_open_source(spec, split, text_field), spec, split)


def _nonempty(docs: Iterator[str], spec: str, split: str) -> Iterator[str]:
    # Checked lazily at the end of the stream so the corpus is still read only once.
    n = 0
    for doc in docs:
        n += 1
        yield doc
    if n == 0:
        if split == "all" or not has_own_splits(spec):
            raise NormswapError(f"data source {spec!r} holds no text (every document is empty or blank)")
        raise NormswapError(f"data source {spec!r} has no documents in the {split!r} split")


def load_text(spec: str, split: str = "validation", *, text_field: str = "text") -> str:
    """All documents of one split joined by blank lines (for perplexity over a held-out text)."""
    return "\n\n".join(load_documents(spec, split, text_field=text_field))
