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
