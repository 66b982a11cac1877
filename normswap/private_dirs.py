"""Directories and files normswap keeps for itself outside the user's OUT, made private.

Why: normswap loads code (the compiled CPU kernel's ``.so``) and choices (the autotune table)
from its cache, builds in a fallback under the shared temporary directory, and keeps lock files
beside OUT, which may itself sit in a shared directory. Another local user who can write such a
directory, or who planted it first (``/tmp/normswap-<uid>`` is a predictable name), could get
their code run by the victim's next ``normswap convert``, or make normswap write through a
symlink into one of the victim's files. So:

* a directory normswap creates is created with mode 0700 (missing parents too);
* one that already exists is used only when it is ours: owned by this user (a symlink to it
  too), a real directory, not writable by group or others, and in a parent that nobody else can
  use to swap it (not writable by others, unless sticky like ``/tmp``);
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
    st = os.stat(path)
    if kind == "directory" and not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != uid:
        return f"{path} belongs to uid {st.st_uid}, not to you (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {_mode(st)})"
    return None


def _why_parent_unsafe(path: Path) -> str | None:
    """Someone else who can write the parent can rename ``path`` away and plant another in its place
    (unless the sticky bit forbids it, as in /tmp)."""
    if not _POSIX:
        return None
    parent = path.parent
    try:
        st = os.stat(parent)
    except OSError:
        return None
    if st.st_uid not in (0, _uid()):
        return f"its parent {parent} belongs to uid {st.st_uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return f"its parent {parent} is writable by other users (mode {_mode(st)}) and not sticky"
    return None


def check_private_dir(path) -> str | None:
    """Why the existing directory ``path`` may not be loaded from, or None (nothing is created)."""
    path = Path(path)
    try:
        return why_not_private(path) or _why_parent_unsafe(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as e:
        return f"{path}: {e.strerror}"


def ensure_private_dir(path, *, base=None) -> Path:
    """Create ``path`` with mode 0700 or check the one that exists; raise :class:`NotPrivate`.

    ``base``: the top directory normswap owns (``path`` or one of its parents). It and every
    level below it down to ``path`` are created 0700 or checked; above ``base`` only its parent
    is checked (a user's own ``~/.cache`` is theirs to arrange)."""
    path = Path(path)
    base = Path(base) if base is not None else path
    levels = [path] + [p for p in path.parents if p == base or base in p.parents]
    if base not in levels:
        raise ValueError(f"{base} is not {path} or one of its parents")
    if not base.parent.exists():
        base.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    why = _why_parent_unsafe(base)
    if why:
        raise NotPrivate(f"{base} is not private: {why}")
    for level in reversed(levels):  # top down: a level is trusted before anything below it is
        with contextlib.suppress(FileExistsError):
            os.mkdir(level, 0o700)
        why = why_not_private(level)
        if why:
            raise NotPrivate(
                f"refusing to use {level}: {why}; remove it or set NORMSWAP_CACHE_DIR to a private directory"
            )
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
    """The text of a file in a cache, or None when it is missing or not private (then never read)."""
    path = Path(path)
    try:
        if why_not_private(path, kind="file"):
            return None
        fd = open_private(path, os.O_RDONLY)
    except (OSError, NotPrivate):
        return None
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
