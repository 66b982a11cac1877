"""Directories and files normswap keeps for itself outside the user's OUT, made private.

Why: normswap loads code (the compiled CPU kernel's ``.so``) and choices (the autotune table)
from its cache, builds in a fallback under the shared temporary directory, and keeps lock files
beside OUT, which may itself sit in a shared directory. Another local user who can write such a
directory, or who planted it first (``/tmp/normswap-<uid>`` is a predictable name), could get
their code run by the victim's next ``normswap convert``, or make normswap write through a
symlink into one of the victim's files. So:

* a directory normswap creates is created with mode 0700 (missing parents too);
* one that already exists is used only when it is ours: owned by this user (a symlink to it
  too), a real directory, not writable by group or others;
* and only when no name on the way to it can be renamed or replaced by another user
  (:func:`why_replaceable`): every directory from ``/`` down to it, and every symlink followed
  on the way, must lie in a directory that belongs to this user or root and that others cannot
  write, unless it is sticky (like ``/tmp``) and the name in it belongs to this user or root.
  Checking only the directory and its parent is not enough: with the cache at
  ``scratch/me/nscache`` in another user's ``scratch``, normswap makes ``scratch/me`` itself, and
  that user could rename ``scratch/me`` away during the minute-long build and put their own tree
  (and library) in its place;
* compiled code is loaded through a handle on the directory opened once and checked
  (:func:`open_private_dir`, :func:`open_private_file`: ``openat`` with ``O_NOFOLLOW``, the file
  checked with ``fstat``), never by a path that is resolved again later;
* a file normswap reads back (the autotune table) must be a regular file that is ours and not
  writable by others; files normswap writes there are opened with ``O_NOFOLLOW`` (``O_EXCL``
  where they are created), so a planted symlink is never followed.

:func:`cache_dir` is the one way to get a cache directory: the configured cache
(``$NORMSWAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/normswap``, else ``~/.cache/normswap``), else
``$TMPDIR/normswap-<uid>``, else a fresh ``mkdtemp`` directory; each directory skipped is said in
one line on stderr, with the reason. :func:`check_private_dir` alone answers "may I load from
here?" without creating anything.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
import tempfile
from pathlib import Path

from normswap.errors import NormswapError

_POSIX = hasattr(os, "getuid")
_said: set = set()
_fresh: dict = {}  # roots tried -> the mkdtemp directory used instead for the rest of the process


class NotPrivate(NormswapError):
    """A directory or file that another user could have written: refused."""


def _uid() -> int:
    return os.getuid() if _POSIX else 0


def cache_root() -> Path:
    """The configured cache directory (not yet checked): ``$NORMSWAP_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/normswap``, else ``~/.cache/normswap``."""
    env = os.environ.get("NORMSWAP_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "normswap"


def temp_root() -> Path:
    """The per-user fallback under the temporary directory (a predictable, shared-place name: checked
    like every other before use)."""
    return Path(tempfile.gettempdir()) / f"normswap-{_uid()}"


def _mode(st) -> str:
    return oct(stat.S_IMODE(st.st_mode))


def _why_stat_not_private(st, path, kind: str) -> str | None:
    """Why a file or directory with status ``st`` (followed, or of an open handle) is not ours alone."""
    uid = _uid()
    if kind == "directory" and not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != uid:
        return f"{path} belongs to uid {st.st_uid}, not to you (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {_mode(st)})"
    return None


def why_not_private(path, *, kind: str = "directory") -> str | None:
    """Why ``path`` (which exists) may not be trusted, or None when it is ours alone.

    ``kind``: "directory" or "file" (a regular file)."""
    if not _POSIX:
        return None  # no owners or modes to check (Windows): the per-user profile directory is private
    path = Path(path)
    uid = _uid()
    lst = os.lstat(path)
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid != uid:
        return f"{path} is a symbolic link owned by uid {lst.st_uid}, not by you (uid {uid})"
    return _why_stat_not_private(os.stat(path), path, kind)


_MAX_LINKS = 40  # as Linux's lookup: more symlinks than this on one path is ELOOP


def _lookups(path):
    """``(directory, name, lstat)`` for every name the kernel looks up to reach ``path``, symlinks
    followed as it follows them (``..`` after a symlink is the target's parent, not the link's);
    stops at the first name that does not exist. ``directory`` is always a real directory."""
    text = os.fsdecode(os.fspath(path))
    if not text.startswith("/"):
        text = os.getcwd() + "/" + text
    todo = list(reversed(text.split("/")))
    cur, links = "/", 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            cur = os.path.dirname(cur)
            continue
        entry = os.path.join(cur, part)
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            return
        yield cur, entry, st
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), entry)
            target = os.readlink(entry)
            if target.startswith("/"):
                cur = "/"
            todo.extend(reversed(target.split("/")))
        else:
            cur = entry


def why_replaceable(path) -> str | None:
    """Why another user could rename, replace or redirect a name on the way to ``path``, or None.

    For every name looked up from ``/`` to ``path`` (symlinks followed): the directory holding it
    must belong to this user or root, and must not be writable by group or others unless it is
    sticky (``/tmp``) and the name in it belongs to this user or root. A missing tail is fine
    (normswap creates it, 0700). The one rule for every directory normswap loads code from."""
    if not _POSIX:
        return None
    trusted = (0, _uid())
    try:
        for parent, entry, st in _lookups(path):
            pst = os.stat(parent)
            if pst.st_uid not in trusted:
                return f"{parent} belongs to uid {pst.st_uid}, who can rename {entry} away and put another in its place"
            if pst.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                if not pst.st_mode & stat.S_ISVTX:
                    return f"its parent {parent} is writable by other users (mode {_mode(pst)}) and not sticky"
                if st.st_uid not in trusted:
                    return f"{entry} belongs to uid {st.st_uid} in the shared directory {parent}"
    except OSError as e:
        return f"{path}: {e.strerror}"
    return None


def check_private_dir(path) -> str | None:
    """Why the existing directory ``path`` may not be loaded from, or None (nothing is created)."""
    path = Path(path)
    try:
        return why_not_private(path) or why_replaceable(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as e:
        return f"{path}: {e.strerror}"


def open_private_dir(path) -> int:
    """A handle (file descriptor) on the private directory ``path``, checked once open.

    What is read or loaded from the directory afterwards goes through this handle
    (:func:`open_private_file`), so renaming a directory on the way later cannot make normswap
    read another tree. The caller closes it. Raises :class:`NotPrivate`."""
    path = Path(path)
    why = check_private_dir(path)
    if why:
        raise NotPrivate(f"refusing to use {path}: {why}")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        why = _why_stat_not_private(st, path, "directory") if _POSIX else None
        if why or not is_same_dir(fd, path):
            raise NotPrivate(f"refusing to use {path}: {why or 'it was replaced while it was being opened'}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_same_dir(fd: int, path) -> bool:
    """Whether ``path`` still names the directory ``fd`` was opened on, and is still private."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path)) and check_private_dir(path) is None
    except OSError:
        return False


def open_private_file(dir_fd: int, name: str, *, where="", made_here: bool = False) -> int:
    """Open the regular file ``name`` inside the directory handle ``dir_fd`` (never following a
    symlink) and check the open file: ours, and writable by nobody else. The caller closes it.

    ``made_here``: the file was just made by this process in this private directory (a library
    linked under our build lock); if our umask let group or others write it, it is made ours
    alone instead of refused (refusing would disable the kernel for every user with umask 002),
    since nobody else can reach a file inside a private directory."""
    label = os.path.join(str(where), name)
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotPrivate(f"{label} is a symbolic link; normswap does not follow it") from None
        raise
    try:
        st = os.fstat(fd)
        loose = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if made_here and _POSIX and st.st_uid == _uid() and stat.S_ISREG(st.st_mode) and loose:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
            st = os.fstat(fd)
        why = _why_stat_not_private(st, label, "file") if _POSIX else None
        if why:
            raise NotPrivate(f"refusing to load {label}: {why}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_private_dir(path, *, base=None) -> Path:
    """Create ``path`` with mode 0700 or check the one that exists; raise :class:`NotPrivate`.

    ``base``: the top directory normswap owns (``path`` or one of its parents). It and every
    level below it down to ``path`` are created 0700 or checked (ours alone); every name from
    ``/`` down to ``path`` is checked by :func:`why_replaceable` (nobody else can swap it)."""
    path = Path(path)
    base = Path(base) if base is not None else path
    levels = [path] + [p for p in path.parents if p == base or base in p.parents]
    if base not in levels:
        raise ValueError(f"{base} is not {path} or one of its parents")
    why = why_replaceable(base)  # before creating anything in a place another user controls
    if why:
        raise NotPrivate(f"{base} is not private: {why}")
    if not base.parent.exists():
        base.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for level in reversed(levels):  # top down: a level is trusted before anything below it is
        with contextlib.suppress(FileExistsError):
            os.mkdir(level, 0o700)
        why = why_not_private(level)
        if why:
            raise NotPrivate(
                f"refusing to use {level}: {why}; remove it or set NORMSWAP_CACHE_DIR to a private directory"
            )
    why = why_replaceable(path)  # the whole way down, now that every level exists
    if why:
        raise NotPrivate(f"{path} is not private: {why}")
    return path


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        print(f"normswap: {message}", file=sys.stderr)


def _writable(d: Path) -> None:
    probe = d / f".probe-{os.getpid()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    os.close(fd)
    os.unlink(probe)


def cache_dir(*parts: str) -> Path:
    """A private, writable directory ``<root>/<parts...>`` for normswap's caches.

    Tries the configured cache root, then :func:`temp_root`; when neither is both private and
    writable, a fresh ``mkdtemp`` directory (used for the rest of the process, removed at exit).
    Every skip is said once on stderr, in one line with its reason."""
    return _first_private((cache_root(), temp_root()), parts)


def temp_dir(*parts: str) -> Path:
    """A private, writable directory under :func:`temp_root` for files that need not outlive the
    run (logs), or a fresh ``mkdtemp`` one, like :func:`cache_dir`."""
    return _first_private((temp_root(),), parts)


def _first_private(roots, parts) -> Path:
    skipped = []
    for root in roots:
        d = root.joinpath(*parts)
        try:
            ensure_private_dir(d, base=root)
            _writable(d)
            return d
        except NotPrivate as e:
            skipped.append(str(e).split("; remove it")[0])
        except OSError as e:
            skipped.append(f"cannot write in {d}: {e.strerror}")
    fresh = _fresh.get(roots)
    if fresh is None:
        fresh = _fresh[roots] = Path(tempfile.mkdtemp(prefix="normswap-"))  # mode 0700, a name nobody predicted
        import atexit
        import shutil

        atexit.register(shutil.rmtree, fresh, ignore_errors=True)
        _say_once(f"{'; '.join(skipped)}: using a fresh private temporary directory {fresh} instead (not kept)")
    return ensure_private_dir(fresh.joinpath(*parts), base=fresh)  # parts inside it, so its locks are private too


def open_private(path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that never follows a symlink at ``path`` (one line instead of ELOOP)."""
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.EMLINK and Path(path).is_symlink()):
            raise NotPrivate(
                f"{path} is a symbolic link (to {os.readlink(path)}); normswap does not follow it: "
                "remove it and run again"
            ) from None
        raise


def read_private_text(path) -> str | None:
    """The text of a file in a cache, or None when it or its directory is missing or not private
    (then never read): opened through a checked handle on the directory, the file checked once open."""
    path = Path(path)
    try:
        dir_fd = open_private_dir(path.parent)
    except (OSError, NotPrivate):
        return None
    try:
        fd = open_private_file(dir_fd, path.name, where=path.parent)
    except (OSError, NotPrivate):
        return None
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, encoding="utf-8") as f:
        return f.read()


def write_private_text(path, text: str) -> None:
    """Replace a cache file atomically: a fresh ``O_EXCL | O_NOFOLLOW`` sibling renamed over it."""
    path = Path(path)
    import secrets

    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ------------------------------------------------------------------ a tree read through handles
# A directory normswap wrote and reads back later (a fine-tune's OUT: its checkpoints, log and run
# record) is walked through directory handles, never by path: every name is opened relative to the
# handle of the directory holding it (``openat``) with ``O_NOFOLLOW``, and what was opened is checked
# (``fstat``: a real directory or regular file, ours, writable by nobody else). A link planted
# anywhere inside (``OUT/checkpoints -> elsewhere``) is therefore refused by name instead of
# followed, and since every later read, write, rename or delete goes through the same handle, no
# rename between the check and the use can redirect it (no TOCTOU). Deletes never follow a link
# either: :func:`remove_tree_at` walks with ``os.scandir`` on a handle and unlinks by ``dir_fd``.

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _link_refusal(dir_fd: int, name: str, where, e: OSError) -> NotPrivate | None:
    """The refusal for an ``openat(O_NOFOLLOW)`` that met a symlink (ELOOP, or ENOTDIR for a link
    opened with O_DIRECTORY) or a file where a directory belongs; None for another error."""
    if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return None
    try:
        target = os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return NotPrivate(f"{where} is not a directory")
    return NotPrivate(f"{where} is a symbolic link (to {target}); normswap does not follow a link here")


def _open_checked(dir_fd: int, name: str, flags: int, *, where, kind: str, verb: str, mode: int = 0o600) -> int:
    """``openat(dir_fd, name, flags)`` (the caller's flags hold ``O_NOFOLLOW``), then the open
    descriptor checked (``fstat``): a ``kind`` ("directory" or "file") that is ours and writable by
    nobody else, else :class:`NotPrivate` naming ``where``; a link is refused by name."""
    try:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as e:
        raise _link_refusal(dir_fd, name, where, e) or e from None
    try:
        why = _why_stat_not_private(os.fstat(fd), where, kind) if _POSIX else None
        if why:
            raise NotPrivate(f"refusing to {verb} {where}: {why}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_dir_at(dir_fd: int, name: str, *, where) -> int:
    """A handle on the directory ``name`` inside ``dir_fd``: never through a symlink, and refused
    (:class:`NotPrivate`, one line naming ``where``) unless it is ours and nobody else can write it.
    Raises FileNotFoundError when it is absent. The caller closes it."""
    return _open_checked(dir_fd, name, _DIR_FLAGS, where=where, kind="directory", verb="use")


def make_dir_at(dir_fd: int, name: str, *, where, mode: int = 0o755) -> int:
    """Create the directory ``name`` inside ``dir_fd`` (or take the one there, under
    :func:`open_dir_at`'s check) and return a handle on it. ``mode`` has no group or other write
    bit, whatever the umask, so that what normswap writes passes its own check when read back."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, mode & ~(stat.S_IWGRP | stat.S_IWOTH), dir_fd=dir_fd)
    return open_dir_at(dir_fd, name, where=where)


def open_file_at(dir_fd: int, name: str, *, where) -> int:
    """``name`` inside ``dir_fd`` opened for reading: a regular file (``O_NONBLOCK``: a FIFO is
    refused, not waited on), not a link, ours, writable by nobody else; refused
    (:class:`NotPrivate`, naming ``where``) otherwise, FileNotFoundError when absent."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = _open_checked(dir_fd, name, flags, where=where, kind="file", verb="read")
    os.set_blocking(fd, True)
    return fd


def create_file_at(dir_fd: int, name: str, *, where, append: bool = False, mode: int = 0o644) -> int:
    """``name`` inside ``dir_fd`` opened for writing without following a link: created fresh
    (``O_EXCL``, so nothing planted is written through), or with ``append`` an existing file of ours
    opened to add to (checked like a read). ``mode`` loses any group or other write bit. The
    caller closes it."""
    nofollow = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    flags = os.O_WRONLY | nofollow | (os.O_APPEND | os.O_CREAT if append else os.O_CREAT | os.O_EXCL)
    mode &= ~(stat.S_IWGRP | stat.S_IWOTH)
    return _open_checked(dir_fd, name, flags, where=where, kind="file", verb="write", mode=mode)


def replace_at(dir_fd: int, src: str, dst: str) -> None:
    """Rename ``src`` over ``dst``, both inside ``dir_fd``: a link at ``dst`` is replaced, never followed."""
    os.replace(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def write_file_at(dir_fd: int, name: str, data: bytes, *, where) -> None:
    """Replace ``name`` inside ``dir_fd`` atomically: a fresh private sibling, fsynced, renamed over it."""
    import secrets

    tmp = f".{name}.normswap-tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = create_file_at(dir_fd, tmp, where=where)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        replace_at(dir_fd, tmp, name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def fd_path(fd: int, name: str | None = None) -> str:
    """A path that reaches the open file or directory ``fd`` (and ``name`` in it) without resolving
    any name above it again, for libraries that take only a path (safetensors): Linux's
    ``/proc/self/fd/N``. Where there is no /proc the caller must not need it (see has_fd_paths)."""
    base = f"/proc/self/fd/{fd}"
    return base if name is None else f"{base}/{name}"


def has_fd_paths() -> bool:
    return os.path.isdir("/proc/self/fd")


def list_dir_at(dir_fd: int) -> list[os.DirEntry]:
    """The entries of the directory ``dir_fd`` (``os.scandir`` on a handle: the names are the
    directory's, whatever a path to it now leads to)."""
    with os.scandir(os.dup(dir_fd)) as it:  # scandir closes the descriptor it was given
        return list(it)


def remove_tree_at(dir_fd: int, name: str, *, where) -> None:
    """Delete ``name`` inside ``dir_fd`` and, when it is a directory, all it holds: every level
    opened through the handle of the level above with ``O_NOFOLLOW`` and emptied through its own
    handle, so a link (planted before, or swapped in meanwhile) is removed as a link and nothing it
    points to is touched. A directory that is not ours is refused (:class:`NotPrivate`), never emptied."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    if _POSIX and st.st_uid != _uid():
        raise NotPrivate(f"refusing to remove {where}: it belongs to uid {st.st_uid}, not to you (uid {_uid()})")
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped for a link or a file after the stat
            os.unlink(name, dir_fd=dir_fd)
            return
        raise
    try:
        if not os.path.samestat(st, os.fstat(fd)):
            raise NotPrivate(f"refusing to remove {where}: it was replaced while it was being removed")
        for entry in list_dir_at(fd):
            remove_tree_at(fd, entry.name, where=os.path.join(str(where), entry.name))
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)
