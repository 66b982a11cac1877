"""One exception type for every failure a user can cause.

The CLI turns a NormswapError into a single line on stderr and exit status 2 (1 for a failed
verification); anything else is a bug and gets a traceback only with --debug.
"""


class NormswapError(Exception):
    """Bad input or a refused operation: the message is shown to the user as one line."""

    exit_code = 2


class VerificationError(NormswapError):
    """The written checkpoint does not compute what it should (exact mode above tolerance)."""

    exit_code = 1


class DiscoveryError(NormswapError):
    """Discovery could not describe an architecture (the message says why)."""


# what to do about an operating-system error, by errno name (see os_error_message)
_ADVICE = {
    "ENOSPC": "the disk is full: free some space or choose an OUT on another disk",
    "EDQUOT": "your disk quota is used up: free some space or choose an OUT on another disk",
    "EFBIG": (
        "the file is larger than this file system allows: choose an OUT on another disk or a smaller --max-shard-size"
    ),
    "EROFS": "the file system is read-only: choose an OUT on a writable disk",
    "EACCES": "permission denied: choose a directory you can write, or fix its permissions",
    "EPERM": "operation not permitted: choose a directory you can write, or fix its permissions",
    "ENAMETOOLONG": "a file name is too long: choose a shorter OUT name",
    "EBUSY": "the path is in use (a mount point or the current directory): choose another OUT",
    "EXDEV": "OUT and its parent are on different file systems (a mount point): choose a directory inside it",
}


def is_environmental(e: OSError) -> bool:
    """An OSError about the machine (disk full, read-only, permissions, names), with advice for it."""
    import errno

    return errno.errorcode.get(e.errno or 0, "") in _ADVICE


def os_error_message(e: OSError) -> str:
    """One line for an OSError: the path it concerns, what happened and what to do."""
    import errno

    name = errno.errorcode.get(e.errno or 0, "")
    what = e.strerror or str(e) or type(e).__name__
    path = f"{e.filename}: " if e.filename else ""
    advice = _ADVICE.get(name)
    return f"{path}{what}" + (f" ({advice})" if advice else "")


def first_line(error: BaseException, max_chars: int | None = None) -> str:
    """The first line of an exception's message (its type name when the message is empty): how a
    library's multi-line error is quoted inside normswap's one-line messages."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    return text[:max_chars] if max_chars else text
