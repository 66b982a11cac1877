"""YAML and JSON that came from a user, read with bounds: the one way normswap reads such a file.

Why: a file a user hands normswap (a family file, a recipe, a study's ``study_run.json`` and
``units/*.json``, a ``results.json`` to render, a model's ``config.json``) is data from anywhere. Read
naively, ``--family-file /dev/zero`` reads until memory runs out, a FIFO blocks forever, a
``units/x.json`` planted as a link to another file is read through it, and a 795-byte YAML file of
nested aliases (``b: [*a, *a, ...]``, ``c: [*b, *b, ...]``) stands for billions of values once
something walks it. So every such read here is bounded:

* **regular files only**: the path is checked before it is opened and the open descriptor again
  (``fstat``), so a FIFO, a device, a socket or a directory is refused by name and never read; a
  symbolic link is refused by name too (``O_NOFOLLOW``), except where the caller passes
  ``follow=True`` for a path the user typed themselves (a recipe, ``--family-file``): then the link
  is followed but what it reaches must still be a regular file;
* **a size cap** (``max_bytes``), checked on the open file and again while reading, so a file that
  grows after the check is not read past it;
* **a nesting cap** (``max_depth``) for JSON and YAML;
* **YAML alias expansion bounded**: the composed node graph is measured with every alias written
  out (shared nodes counted once per use, in time proportional to the graph) and refused past
  ``max_nodes``; an alias inside its own anchor (a cycle) is refused; only ``yaml.SafeLoader``'s
  tags are constructed (no Python objects).

Every refusal is a :class:`BoundedLoadError` (a ``NormswapError``): one line naming the file and
what is wrong.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from normswap.errors import NormswapError

MAX_BYTES = 16 << 20  # no settings file, config or report normswap reads comes near this
MAX_DEPTH = 64  # nesting of mappings and lists; real files stay under 10
MAX_NODES = 100_000  # YAML values with every alias written out


class BoundedLoadError(NormswapError):
    """A user file refused by a bound (size, kind of file, nesting, aliases) or not parseable.

    ``syntax``: for a file that is not valid JSON/YAML, where and what (`` at line 3, column 7: ...``),
    so that a caller can word the line its own way."""

    def __init__(self, message: str, syntax: str | None = None):
        super().__init__(message)
        self.syntax = syntax


# the kinds of file that are not regular files, in words, in the order st_mode is tested
NOT_REGULAR = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
)


def file_kind(mode: int) -> str | None:
    """What a file that is not a regular file is, in words ("a FIFO (named pipe)"), from its
    ``st_mode``; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((words for test, words in NOT_REGULAR if test(mode)), "not a regular file")


def _refuse_kind(path: Path, what: str, kind: str) -> BoundedLoadError:
    return BoundedLoadError(f"{path} is {kind}, not a regular file; {what} must be a plain file")


def open_regular(path, *, what: str = "the file", follow: bool = False) -> int:
    """A descriptor on the regular file ``path``, or one refusing line: a FIFO, device, socket or
    directory is named, never opened in a way that could block (``O_NONBLOCK``, and the open
    descriptor checked again with ``fstat``); a symbolic link is refused unless ``follow`` (a path
    the user typed), and then what it reaches must still be a regular file. The caller closes it."""
    path = Path(path)
    try:
        lst = os.lstat(path)
        if stat.S_ISLNK(lst.st_mode) and not follow:
            raise BoundedLoadError(
                f"{path} is a symbolic link (to {os.readlink(path)}); normswap does not follow it here: "
                f"{what} must be a plain file (remove the link)"
            )
        kind = file_kind(os.stat(path).st_mode)
        if kind:
            raise _refuse_kind(path, what, kind)
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags | (0 if follow else getattr(os, "O_NOFOLLOW", 0)))
    except BoundedLoadError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:  # swapped for a link between the check and the open
            raise BoundedLoadError(f"{path} is a symbolic link; {what} must be a plain file") from None
        raise BoundedLoadError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        kind = file_kind(os.fstat(fd).st_mode)
        if kind:  # swapped between the check and the open: the descriptor is what counts
            raise _refuse_kind(path, what, kind)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path, *, what: str = "the file", max_bytes: int = MAX_BYTES, follow: bool = False) -> bytes:
    """The bytes of the regular file ``path`` (at most ``max_bytes``), or one refusing line.

    ``what`` names the file in messages ("a recipe", "a family file"); ``follow``: whether a
    symbolic link at ``path`` itself may be followed (only for a path the user typed)."""
    path = Path(path)
    fd = open_regular(path, what=what, follow=follow)
    try:
        st = os.fstat(fd)
        if st.st_size > max_bytes:
            raise _too_big(path, what, st.st_size, max_bytes)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # it grew while being read
                raise _too_big(path, what, total, max_bytes, more=True)
        return b"".join(chunks)
    except OSError as e:
        raise BoundedLoadError(f"cannot read {what} {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


# -- streams: bounded per record --------------------------------------------------------------------

MAX_RECORD_BYTES = 64 << 20  # one JSONL line or one element of a JSON array; a whole book is ~5 MB


def lines(path, *, what: str = "the file", max_line: int = MAX_RECORD_BYTES, follow: bool = True):
    """``(line number, bytes)`` for each line of the regular file ``path``, newline included; a line
    longer than ``max_line`` bytes is refused by number (only that much is ever held), so a file of
    one 20 GB line costs ``max_line`` bytes of memory, not 20 GB."""
    path = Path(path)
    with os.fdopen(open_regular(path, what=what, follow=follow), "rb") as f:
        lineno = 0
        while True:
            line = f.readline(max_line + 1)
            if not line:
                return
            lineno += 1
            if len(line) > max_line and not line.endswith(b"\n"):
                raise BoundedLoadError(
                    f"{path}:{lineno}: a line longer than {max_line:,} bytes; {what} holds one record a line "
                    "(is it one document without line breaks? give it as a .txt file)"
                )
            yield lineno, line


def json_array(path, *, what: str = "the file", max_record: int = MAX_RECORD_BYTES, follow: bool = True):
    """``(index, value)`` for each element of the JSON array that is the regular file ``path``, parsed
    one element at a time: at most ``max_record`` bytes of one element are ever held, however large
    the file. Refuses, in one line, a file that is not one array, an element past the cap, bad JSON."""
    path = Path(path)
    decoder = json.JSONDecoder()
    with os.fdopen(open_regular(path, what=what, follow=follow), "rb") as f:
        reader = _Chars(f, path)
        if reader.skip_space() != "[":
            raise BoundedLoadError(f"{path}: not a JSON array; {what} is one array of records")
        reader.pos += 1
        index = 0
        while True:
            if reader.skip_space() == "]":
                return
            if index and reader.char() != ",":
                raise BoundedLoadError(f"{path}: invalid JSON after element {index - 1}: expected ',' or ']'")
            if index:
                reader.pos += 1
                reader.skip_space()
            value = reader.element(decoder, index, max_record, what)
            yield index, value
            index += 1


class _Chars:
    """Decoded text of a file read in growing blocks, with a cursor (for :func:`json_array`)."""

    def __init__(self, f, path):
        import codecs

        self.f, self.path = f, path
        self.decode = codecs.getincrementaldecoder("utf-8")().decode
        self.buf, self.pos, self.eof = "", 0, False
        self.lines, self.offset = 0, 0  # newlines dropped from buf, and bytes read, so far

    def more(self, at_least: int = 1 << 20) -> bool:
        if self.eof:
            return False
        raw = self.f.read(at_least)
        try:
            text = self.decode(raw, final=not raw)
        except UnicodeDecodeError as e:
            line = self.lines + self.buf.count("\n") + raw.count(b"\n", 0, max(e.start, 0)) + 1
            raise BoundedLoadError(
                f"{self.path}:{line}: not UTF-8 text ({e.reason} near byte {self.offset + max(e.start, 0)}); "
                "convert the file to UTF-8"
            ) from None
        self.eof = not raw
        self.offset += len(raw)
        self.lines += self.buf.count("\n", 0, self.pos)
        self.buf = self.buf[self.pos :] + text  # what was consumed is dropped: memory stays one element
        self.pos = 0
        return True

    def skip_space(self) -> str:
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                raise BoundedLoadError(f"{self.path}: the JSON array ends before its closing ']'")

    def char(self) -> str:
        return self.buf[self.pos]

    def element(self, decoder, index: int, max_record: int, what: str):
        """The element at the cursor; reads on (doubling) until it and the delimiter after it are held."""
        while True:
            try:
                value, end = decoder.raw_decode(self.buf, self.pos)
                after = end
                while after < len(self.buf) and self.buf[after] in " \t\r\n":
                    after += 1
                if after < len(self.buf) or self.eof:  # complete: the delimiter after it is in view
                    self.pos = end
                    return value
                error = None
            except RecursionError:
                raise BoundedLoadError(f"{self.path}: element {index} is nested too deeply to read") from None
            except json.JSONDecodeError as e:
                error = e
            if len(self.buf) - self.pos > max_record:
                raise BoundedLoadError(
                    f"{self.path}: element {index} is longer than {max_record:,} bytes; {what} is read one record "
                    "at a time, each at most that long"
                )
            if not self.more(max(1 << 20, len(self.buf) - self.pos)):
                raise BoundedLoadError(f"{self.path}: invalid JSON in element {index}: {error.msg}") from None


def _too_big(path, what: str, size: int, cap: int, more: bool = False) -> BoundedLoadError:
    return BoundedLoadError(f"{path}: {'more than ' if more else ''}{size:,} bytes; {what} is at most {cap:,} bytes")


def read_text(path, *, what: str = "the file", max_bytes: int = MAX_BYTES, follow: bool = False) -> str:
    data = read_bytes(path, what=what, max_bytes=max_bytes, follow=follow)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BoundedLoadError(f"{path}: {what} must be UTF-8 text (byte {e.start} is not)") from None


# -- JSON -------------------------------------------------------------------------------------------


def parse_json(text: str | bytes, where: str, *, max_depth: int = MAX_DEPTH):
    """``json.loads`` with a nesting cap and one-line errors."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise BoundedLoadError(f"{where}: nested more than {max_depth} levels deep") from None
    except UnicodeDecodeError as e:
        raise BoundedLoadError(f"{where}: not UTF-8 text (byte {e.start} is not)") from None
    except json.JSONDecodeError as e:
        syntax = f" at line {e.lineno}, column {e.colno}: {e.msg}"
        raise BoundedLoadError(f"{where}: invalid JSON{syntax}", syntax) from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise BoundedLoadError(f"{where}: invalid JSON: {str(e).splitlines()[0][:200]}") from None
    _check_depth(value, where, max_depth)
    return value


def _check_depth(value, where: str, max_depth: int) -> None:
    stack = [(value, 1)]
    while stack:  # iterative: the check itself must not recurse as deep as the file
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > max_depth:
                raise BoundedLoadError(f"{where}: nested more than {max_depth} levels deep")
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))


def load_json(
    path, *, what: str = "the file", max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH, follow: bool = False
):
    """The JSON value in the regular file ``path``, read with :func:`read_bytes`' bounds."""
    data = read_bytes(path, what=what, max_bytes=max_bytes, follow=follow)
    return parse_json(data, str(path), max_depth=max_depth)


# -- YAML -------------------------------------------------------------------------------------------


def _yaml_loader(max_nodes: int, max_depth: int, what: str, unique_keys: bool = False):
    import yaml

    class Bounded(yaml.SafeLoader):
        def get_single_node(self):
            node = super().get_single_node()
            if node is not None:
                _expanded_size(node, self.name, max_nodes, max_depth, what)
                if unique_keys:
                    _refuse_duplicate_keys(node, self.name)
            return node

    return Bounded


def _refuse_duplicate_keys(root, where: str) -> None:
    """A key written twice in one mapping: YAML loaders keep the last silently, so a file that reads as
    two settings (or two variants) runs as one; refused, naming the key and its second line. Walked after
    the size bound, each distinct node once (an alias repeats a node, not a key)."""
    import yaml

    seen_nodes: set = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: set = set()
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    if k.value in keys:
                        raise BoundedLoadError(
                            f"{where}: at line {k.start_mark.line + 1}: the key {k.value!r} is written twice in "
                            "one mapping (YAML would keep only the last); remove or rename one"
                        )
                    keys.add(k.value)
                stack.extend((k, v))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)


def _expanded_size(root, where: str, max_nodes: int, max_depth: int, what: str) -> int:
    """Nodes under ``root`` with every alias written out; refuses past ``max_nodes``, past
    ``max_depth`` levels, and an alias inside its own anchor. Each distinct node is visited once
    (its size remembered), so a bomb costs time proportional to what is written, not to what it
    stands for."""
    import yaml

    size: dict = {}
    on_path: set = set()
    # iterative post-order walk: (node, depth, children pushed?)
    stack = [(root, 1, False)]
    while stack:
        node, depth, expanded = stack.pop()
        key = id(node)
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        if expanded:
            on_path.discard(key)
            total = 1 + sum(size[id(c)] for c in children)
            if total > max_nodes:
                raise BoundedLoadError(
                    f"{where}: at line {node.start_mark.line + 1}: the YAML aliases expand to more than "
                    f"{max_nodes:,} values; {what} is a page of settings (write the values out)"
                )
            size[key] = total
            continue
        if key in size:
            continue
        if key in on_path:
            raise BoundedLoadError(
                f"{where}: at line {node.start_mark.line + 1}: a YAML alias refers to its own anchor (a cycle)"
            )
        if depth > max_depth:
            raise BoundedLoadError(f"{where}: at line {node.start_mark.line + 1}: nested more than {max_depth} levels")
        on_path.add(key)
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in size)
    return size[id(root)]


def parse_yaml(
    text: str,
    where: str,
    *,
    what: str = "the file",
    max_nodes: int = MAX_NODES,
    max_depth: int = MAX_DEPTH,
    unique_keys: bool = False,
):
    """``yaml.safe_load`` of ``text`` with alias expansion and nesting bounded, one-line errors;
    ``unique_keys``: a key written twice in one mapping is refused too."""
    import yaml

    loader = _yaml_loader(max_nodes, max_depth, what, unique_keys)(text)
    loader.name = where
    try:
        return loader.get_single_data()
    except RecursionError:
        raise BoundedLoadError(f"{where}: nested more than {max_depth} levels deep") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise BoundedLoadError(f"{where}: invalid YAML{at}: {problem}", f"{at}: {problem}") from None
    finally:
        loader.dispose()


def load_yaml(
    path,
    *,
    what: str = "the file",
    max_bytes: int = MAX_BYTES,
    max_nodes: int = MAX_NODES,
    max_depth: int = MAX_DEPTH,
    follow: bool = False,
):
    """The YAML value in the regular file ``path``, read and parsed with every bound above."""
    text = read_text(path, what=what, max_bytes=max_bytes, follow=follow)
    return parse_yaml(text, str(path), what=what, max_nodes=max_nodes, max_depth=max_depth)
