"""Hand freed heap memory back to the operating system.

Blocks of rows and one module's weights are smaller than glibc's (adaptive, up to 32 MB) mmap
threshold, so they live on the heap, whose free pages glibc keeps by default: without this the
resident size creeps up tensor after tensor, module after module, thread arena after arena.
"""

from __future__ import annotations

_TRIM = None


def release_freed_memory() -> None:
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to do
            _TRIM = False
    if _TRIM:
        _TRIM(0)
