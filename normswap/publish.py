"""Every file and directory normswap writes goes through here: atomic, safe and locked.

Four jobs, used by every command that writes (convert, finetune, eval report, run, bench):

- ``atomic_write_text`` / ``atomic_write_json`` / ``atomic_write_with``: a file is written beside its destination,
  flushed to disk and renamed over it, so a reader sees the old file or the new one, never half.
- ``check_output_path``: an OUT that would clobber something is refused before any work: an
  existing OUT without ``--force``, a file, a dangling symlink, or a path that overlaps what the
  command reads (normswap.overlap: one rule for every command).
- ``output_lock``: a command holds an exclusive ``flock`` on ``.OUT.normswap.lock`` (beside OUT)
  for its whole life; a second process is refused with one line naming the holder's pid and
  command. The kernel drops the lock when its holder dies, however it dies. Taking the lock also
  removes what a killed process left behind (staging directories) and says so. Names in a shared
  directory that another user owns (a lock file or a staging-style name, planted or left by their
  own runs) are never removed, used or a reason to refuse: they are left alone and named in one
  line, and this user's lock then lives at ``.OUT.normswap.lock-<uid>``.
- ``staging_dir`` + ``publish_dir``: a directory is built in a sibling
  ``.OUT.normswap-staging-<pid>-<rand>``, verified by the caller, then renamed into place. With
  ``--force`` the staging directory and the old OUT are exchanged in one ``renameat2`` call, so a
  complete OUT exists at every instant; the old one is deleted afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import secrets
import shutil
import stat
import sys
from pathlib import Path

from normswap.errors import NormswapError, os_error_message
from normswap.overlap import check_disjoint
from normswap.private_dirs import NotPrivate, open_private

STAGING_TAG = ".normswap-staging-"
LOCK_SUFFIX = ".normswap.lock"
COMPLETE_MARKER = ".normswap-complete"  # a verified staging directory, see publish_dir


# ------------------------------------------------------------------------------------- files
def atomic_write_text(path, text: str, *, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` through a temporary sibling and a rename (fsynced first)."""
    return atomic_write_with(path, lambda f: f.write(text.encode(encoding)))


def atomic_write_with(path, write) -> Path:
    """``write(binary file)`` into a fresh sibling (``O_EXCL | O_NOFOLLOW``: nothing planted there is
    followed), fsynced, then renamed over ``path``: a link planted at ``path`` is replaced, never
    written through (a figure's ``savefig`` goes through here too)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.normswap-tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


def atomic_write_json(path, obj, **dump_kwargs) -> Path:
    dump_kwargs.setdefault("indent", 2)
    return atomic_write_text(path, json.dumps(obj, **dump_kwargs) + "\n")


def open_append(path, *, label: str = "the file"):
    """A binary file object appending to ``path`` (a log written line by line, such as ``bench kernels
    --jsonl``), for the one kind of output that cannot be a fresh file renamed into place.

    Nothing planted is written through: the name is opened ``O_NOFOLLOW`` (a link is refused, not
    followed) and ``O_NONBLOCK`` (a FIFO is refused, not waited on), and what was opened must be a
    regular file of this user with no other name (a hard link to another file is refused), checked
    on the open descriptor. Each refusal is one line naming ``label`` and the path."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = open_private(path, flags, 0o644)
    except NotPrivate as e:
        raise NormswapError(f"{label}: {e}") from None
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO nobody reads
            raise NormswapError(f"{label} {path} is a FIFO (named pipe), not a regular file") from None
        raise NormswapError(f"cannot write {label} {path}: {os_error_message(e)}") from None
    why = _not_ours_alone(fd)
    if why:
        os.close(fd)
        raise NormswapError(f"refusing to append to {label} {path}: {why}; remove it or choose another file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab")


# ------------------------------------------------------------------------------- path safety
def check_output_path(
    out, *, force: bool, reads=(), allow_empty: bool = False, must_have_parent: bool = True, label: str = "OUT"
) -> Path:
    """Refuse an OUT that would clobber something; cheap, so commands call it before any work.

    ``label``: what the command calls its output in messages (export's is DEST).
    ``reads``: what the command reads, as ``normswap.overlap.check_disjoint`` takes them (OUT may
    not be one of them, be inside one or contain one). ``allow_empty``: an existing empty
    directory may be replaced without ``--force``.
    """
    out = Path(out).expanduser()
    if out.is_symlink() and not out.exists():
        raise NormswapError(
            f"{label} {out} is a symlink to {os.readlink(out)}, which does not exist; "
            f"remove it or choose another {label}"
        )
    check_disjoint(reads, [(f"{label} {out}", out)])
    if out.exists() and not out.is_dir():
        raise NormswapError(f"{label} {out} exists and is not a directory")
    if out.exists() and not force and not (allow_empty and not any(out.iterdir())):
        raise NormswapError(f"{label} {out} already exists; pass --force to replace it")
    if must_have_parent and not out.parent.exists():
        raise NormswapError(f"parent directory of {label} does not exist: {out.parent}")
    return out


def check_output_file(path, *, force: bool, reads=(), label: str = "OUT") -> Path:
    """The file counterpart of :func:`check_output_path`, for commands whose output is one file
    (written with :func:`atomic_write_text`): refuse an existing file without ``--force``, a
    directory, a dangling symlink, a missing parent and a path that overlaps what the command
    reads (normswap.overlap), each in one line, before any work."""
    path = Path(path).expanduser()
    if path.is_symlink() and not path.exists():
        raise NormswapError(
            f"{label} {path} is a symlink to {os.readlink(path)}, which does not exist; "
            f"remove it or choose another {label}"
        )
    check_disjoint(reads, [(f"{label} {path}", path)], advice=f"choose another {label}")
    if path.is_dir():
        raise NormswapError(f"{label} {path} is a directory; give a file name")
    if path.exists() and not force:
        raise NormswapError(f"{label} {path} already exists; pass --force to replace it")
    if not path.parent.is_dir():
        raise NormswapError(f"parent directory of {label} does not exist: {path.parent}")
    return path


# ------------------------------------------------------------------------------------- lock
_held: dict[Path, list] = {}  # lock path -> [fd, depth]: re-entrant within one process


def _lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def _foreign_owner(path: Path) -> int | None:
    """The uid of another user who owns the name ``path`` (not followed), or None (ours or absent)."""
    try:
        owner = os.lstat(path).st_uid
    except OSError:
        return None
    return owner if _uid() is not None and owner != _uid() else None


def _usable_lock_path(out: Path, say) -> Path:
    """OUT's lock file; when another user owns the shared name (their run, or a plant in a sticky
    directory nobody else can remove), it is left alone, named, and a per-user name is used."""
    lock_path = _lock_path(out)
    owner = _foreign_owner(lock_path)
    if owner is None:
        return lock_path
    mine = lock_path.with_name(f"{lock_path.name}-{_uid()}")
    _say(say, f"left alone {lock_path.name}, which belongs to another user (uid {owner}); locking with {mine.name}")
    return mine


def _holder(lock_path: Path) -> str:
    try:
        with os.fdopen(open_private(lock_path, os.O_RDONLY), encoding="utf-8") as f:
            info = json.loads(f.read(4096))
        return f"pid {info['pid']} ({info['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another normswap process"


def _acquire(lock_path: Path, command: str) -> int:
    while True:
        # O_NOFOLLOW: a symlink planted at the lock's name in a shared directory must not make us
        # truncate and write its target; a hard link or another user's file is refused too
        try:
            fd = open_private(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise NormswapError(f"cannot create the lock file {lock_path}: {os_error_message(e)}") from None
        why = _not_ours_alone(fd)
        if why:
            os.close(fd)
            raise NormswapError(
                f"refusing the lock file {lock_path}: {why}; remove it (it is only a lock) and run again"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise NormswapError(
                f"{lock_path.parent / lock_path.name[1 : -len(LOCK_SUFFIX)]} is in use by {_holder(lock_path)}; "
                "wait for it to finish or stop it"
            ) from None
        # the previous holder may have unlinked the file between our open and our flock:
        # then we hold a lock nobody else can see; start again on the current file
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock_path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "command": command}).encode())
    return fd


def _not_ours_alone(fd: int) -> str | None:
    """Why the open file ``fd`` is not a regular file of this user's with one name, or None."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_nlink > 1:
        return f"it has {st.st_nlink} names (a hard link to another file)"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}, not to you (uid {os.getuid()})"
    return None


def _release(lock_path: Path, fd: int) -> None:
    with contextlib.suppress(OSError):
        lock_path.unlink()  # still holding the lock, so nobody can be between open and flock on it
    os.close(fd)


def _command_line() -> str:
    args = " ".join(sys.argv[1:])
    return (
        f"normswap {args}"[:300]
        if Path(sys.argv[0]).name in ("normswap", "__main__.py")
        else f"{sys.argv[0]} {args}"[:300]
    )


@contextlib.contextmanager
def output_lock(out, *, command: str | None = None, say=None, create_parent: bool = False, replaced_whole: bool = True):
    """Hold OUT's lock for the ``with`` block (re-entrant in one process); clean up leftovers.

    Holding the lock means no other live process works on OUT, so every staging directory of
    OUT that exists now belongs to a process that died: it is removed, and ``say`` reports it.
    ``replaced_whole``: OUT is published by a rename (see check_writable_destination); False for a
    directory the command only writes into (a recipe's run directory).
    """
    out = Path(out).expanduser().absolute()
    if out.is_symlink() and not out.exists():
        raise NormswapError(
            f"OUT {out} is a symlink to {os.readlink(out)}, which does not exist; remove it or choose another OUT"
        )
    if not out.parent.exists():
        if not create_parent:
            raise NormswapError(f"parent directory of OUT does not exist: {out.parent}")
        out.parent.mkdir(parents=True, exist_ok=True)
    out = out.parent.resolve() / out.name  # one lock file per directory, however it is spelled
    key = _lock_path(out)
    entry = _held.get(key)
    if entry is None:
        check_writable_destination(out, replaced_whole=replaced_whole)
        lock_path = _usable_lock_path(out, say)
        entry = _held[key] = [_acquire(lock_path, command or _command_line()), 0, lock_path]
        try:
            _remove_leftovers(out, say)
        except BaseException:
            del _held[key]
            _release(lock_path, entry[0])
            raise
    entry[1] += 1
    try:
        yield out
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            _release(entry[2], entry[0])


# the longest name normswap puts beside OUT: ".OUT" + STAGING_TAG + pid (up to 7 digits) + "-old-" + 8 hex
_SIBLING_EXTRA = 1 + len(STAGING_TAG) + 7 + len("-old-") + 8


def check_writable_destination(out: Path, *, replaced_whole: bool = True) -> None:
    """Refuse, before any work, an OUT that normswap could build but never publish: a name too
    long for the lock and staging names beside it, the current directory (or one holding it) or
    a mount point (neither can be replaced by a rename), a parent it cannot write."""
    out = Path(out)
    try:
        name_max = os.pathconf(out.parent, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        name_max = 255
    length = len(os.fsencode(out.name))
    if length + _SIBLING_EXTRA > name_max:
        raise NormswapError(
            f"OUT name {out.name[:40]}... is {length} bytes long: normswap needs {_SIBLING_EXTRA} more for "
            f"the lock and staging names it keeps beside OUT, and this file system allows {name_max}; "
            f"choose a name of at most {name_max - _SIBLING_EXTRA} bytes"
        )
    if out.exists() and replaced_whole:
        real, cwd = out.resolve(), Path.cwd().resolve()
        if real == cwd or real in cwd.parents:
            raise NormswapError(
                f"OUT {out} is the current directory or holds it: normswap replaces OUT as a whole, which "
                "cannot be done to the directory you are working in; give a new directory as OUT"
            )
        if os.path.ismount(real):
            raise NormswapError(
                f"OUT {out} is a mount point, which cannot be replaced by a rename; give a directory inside it as OUT"
            )
    if out.parent.exists() and not os.access(out.parent, os.W_OK):
        ro = _read_only_fs(out.parent)
        raise NormswapError(
            f"cannot write in {out.parent}: "
            + ("the file system is read-only" if ro else "permission denied")
            + "; choose an OUT in a directory you can write"
        )


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def _alive(pid: str) -> bool:
    if not pid.isdigit() or int(pid) == os.getpid():
        return False  # ours would be from an earlier process with the same pid: we hold the lock
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_leftovers(out: Path, say) -> None:
    restored, removed, pids, foreign, stuck = False, [], set(), {}, []
    for p in sorted(out.parent.glob(f".{out.name}{STAGING_TAG}*")):
        owner = _foreign_owner(p)
        if owner is not None:  # another user's name (their run, or a plant): never ours to remove or restore
            foreign.setdefault(owner, []).append(p.name)
            continue
        pid = p.name.rsplit(STAGING_TAG, 1)[1].split("-")[0]
        if _alive(pid):
            continue  # a live writer that holds no lock on OUT (should not happen): leave it alone
        pids.add(pid)
        if not out.exists() and p.is_dir() and (p / COMPLETE_MARKER).is_file():
            os.rename(p, out)  # killed between the fallback publish's two renames: this is the verified OUT
            restored = True
            continue
        try:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
            removed.append(p.name)
        except OSError:
            stuck.append(p.name)
    with contextlib.suppress(OSError):
        (out / COMPLETE_MARKER).unlink()  # restored above, or killed just after the fallback's second rename
    if foreign or stuck:
        _say(
            say,
            "left alone "
            + "; ".join(
                [f"{', '.join(names)} (owned by another user, uid {uid})" for uid, names in sorted(foreign.items())]
                + ([f"{', '.join(stuck)} (could not be removed)"] if stuck else [])
            )
            + f": not normswap's own leftovers of {out.name}, they do not stop it",
        )
    if restored or removed:
        what = ([f"restored {out.name} from its verified staging directory"] if restored else []) + (
            [
                f"removed {len(removed)} leftover staging director{'y' if len(removed) == 1 else 'ies'} "
                f"({', '.join(removed)})"
            ]
            if removed
            else []
        )
        _say(say, f"cleaned up after stopped process {', '.join(sorted(pids))}: {'; '.join(what)}")


def _say(say, msg: str) -> None:
    (say or (lambda m: print(f"normswap: {m}", file=sys.stderr)))(msg)


# ------------------------------------------------------------------------------- directories
@contextlib.contextmanager
def staging_dir(out):
    """A fresh directory beside OUT (same filesystem, so publishing is a rename); removed on failure."""
    out = Path(out).expanduser()
    with output_lock(out):  # re-entrant: the command usually holds it already
        tmp = out.parent / f".{out.name}{STAGING_TAG}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir(mode=0o700)  # private while it is built; publish_dir gives it the usual mode
        except OSError as e:
            raise NormswapError(f"cannot create a staging directory beside OUT: {os_error_message(e)}") from None
        try:
            yield tmp
        except OSError as e:
            if errno.errorcode.get(e.errno or 0) in _WRITE_ERRNOS:  # only writing fails these ways
                raise NormswapError(f"cannot write OUT {out}: {os_error_message(e)}; nothing was written") from None
            raise
        except Exception as e:
            if _is_write_failure(e):  # safetensors' writer wraps the OS error in its own type
                raise NormswapError(
                    f"cannot write OUT {out}: {_one_line(e)} (the disk is full or not writable: free "
                    "some space or choose an OUT on another disk); nothing was written"
                ) from None
            raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


_WRITE_ERRNOS = {"ENOSPC", "EDQUOT", "EFBIG", "EROFS"}


def _is_write_failure(e: Exception) -> bool:
    text = str(e)
    return type(e).__name__ == "SafetensorError" and any(
        s in text
        for s in ("No space left", "os error 28", "Read-only file system", "os error 30", "Disk quota", "os error 122")
    )


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _umask() -> int:
    """The process umask, read without changing it where Linux says it (/proc), else set-and-restore."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the call or filesystem lacks it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def publish_dir(staging, out, *, force: bool) -> Path:
    """Move a finished staging directory to OUT; with ``force`` an existing OUT is replaced so
    that a complete OUT (old, then new) exists at every instant."""
    staging, out = Path(staging), Path(out)
    if (staging / "config.json").is_file():  # a checkpoint: no local directory's path goes out in its files
        from normswap.public_paths import scrub_checkpoint_dir

        scrub_checkpoint_dir(staging)
    os.chmod(staging, 0o777 & ~_umask())  # built private (staging_dir); published with the mode a mkdir would give
    try:
        return _publish(staging, out, force)
    except OSError as e:
        raise NormswapError(
            f"cannot move the finished output into place at {out}: {os_error_message(e)}; nothing was changed"
        ) from None


def publish_files(staging, directory) -> list[Path]:
    """Move each file of a finished staging directory into the existing ``directory``, one atomic
    rename per file, and nothing else: files there with other names stay as they are (a command
    that adds its files to a directory it does not own, e.g. ``eval render`` beside results.json).
    A symlink at one of the names is replaced, never followed; a directory there is refused."""
    staging, directory = Path(staging), Path(directory)
    names = sorted(p.name for p in staging.iterdir() if p.name != COMPLETE_MARKER)
    for name in names:
        dest = directory / name
        if dest.is_dir() and not dest.is_symlink():
            raise NormswapError(f"{dest} is a directory; normswap writes a file of that name there: move it away")
    mask = _umask()
    for name in names:
        os.chmod(staging / name, 0o666 & ~mask)  # the mode a plain write would give, not the staging's
        try:
            os.replace(staging / name, directory / name)
        except OSError as e:
            raise NormswapError(f"cannot write {directory / name}: {os_error_message(e)}") from None
    return [directory / n for n in names]


def _publish(staging: Path, out: Path, force: bool) -> Path:
    if not (out.exists() or out.is_symlink()):
        os.rename(staging, out)
        return out
    if not force:
        raise NormswapError(f"OUT {out} already exists; pass --force to replace it")
    if out.is_dir() and not out.is_symlink() and _exchange(staging, out):
        shutil.rmtree(staging, ignore_errors=True)  # now the old OUT; a kill here leaves it for the next run
        return out
    # Fallback without renameat2 (non-Linux, or a filesystem without RENAME_EXCHANGE): two renames.
    # Between them OUT is missing for an instant; the marker lets the next run (under the lock)
    # restore the new OUT from its staging name if we are killed exactly there.
    (staging / COMPLETE_MARKER).touch()
    old = out.parent / f".{out.name}{STAGING_TAG}{os.getpid()}-old-{secrets.token_hex(4)}"
    os.rename(out, old)
    os.rename(staging, out)
    (out / COMPLETE_MARKER).unlink()
    shutil.rmtree(old, ignore_errors=True) if old.is_dir() and not old.is_symlink() else old.unlink()
    return out


__all__ = [
    "atomic_write_text",
    "atomic_write_json",
    "open_append",
    "check_output_file",
    "check_output_path",
    "output_lock",
    "staging_dir",
    "publish_dir",
    "publish_files",
]
