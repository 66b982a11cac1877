"""Every ``torch.compile`` normswap does goes through :func:`compiled`: its caches are normswap's own.

Why: Inductor writes the code it generates (C++ and its ``.so``, Python wrapper modules, Triton
kernels, precompiled headers) into a cache directory and then loads it; a file already there
under the expected name is loaded as is. Its default directory is ``$TMPDIR/torchinductor_<user>``,
a predictable name in a shared directory, made with ``exist_ok=True`` and never checked for its
owner: another local user who makes that directory first and plants modules there has them run
in the victim's process. ``TORCHINDUCTOR_CACHE_DIR`` moves most of it, but
not all: torch computes some paths from ``default_cache_dir()`` itself (the precompiled headers,
``codecache._HEADER_DIR``, fixed when ``torch._inductor.codecache`` is imported; the on-disk
caches of ``torch._inductor.cache`` and ``runtime.caching``), and Inductor's compile workers are
separate processes that start with the environment only.

So, once per process, before the first compilation (compiling happens at the first call of the
compiled function, not at ``torch.compile``):

* the cache is ``private_dirs.cache_dir("torch-compile")``: created 0700 or checked (ours, not
  writable by others, nothing on the way to it replaceable), else a fresh private directory;
* ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` name it (inside it);
* every name torch binds ``default_cache_dir`` to is pointed at it too (:data:`DEFAULT_CACHE_DIR_USERS`;
  ``tests/test_compile_cache.py`` fails when an installed torch binds it in a module not listed
  here), and so are the precompiled-header paths computed from it at import;
* children (the compile workers, the compiler) get ``TMPDIR`` inside it, so the default a child
  computes for itself lies in the private directory as well.

A user's own ``TORCHINDUCTOR_CACHE_DIR`` is not used: normswap cannot tell one the user chose from
one torch itself wrote into the environment, and the rule must not depend on that.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from normswap.private_dirs import cache_dir, ensure_private_dir

# the modules of torch that bind the name ``default_cache_dir`` (imported from cache_dir_utils)
DEFAULT_CACHE_DIR_USERS = (
    "torch._inductor.runtime.cache_dir_utils",
    "torch._inductor.runtime.runtime_utils",
    "torch._inductor.codecache",
)
_ready: Path | None = None


def private_compile_cache() -> Path:
    """Point every cache Inductor and Triton keep on disk at normswap's private directory (once per
    process) and return it. Raises ``NotPrivate``/``OSError`` only when no private directory can
    be made at all."""
    global _ready
    if _ready is not None and os.environ.get("TORCHINDUCTOR_CACHE_DIR") == str(_ready):
        return _ready
    root = cache_dir("torch-compile")
    for sub in ("triton", "tmp"):
        ensure_private_dir(root / sub, base=root)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root)
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    os.environ["TMPDIR"] = str(root / "tmp")  # for children only: this process's tempfile.tempdir is fixed
    _redirect_default(root)
    _ready = root
    return root


def _redirect_default(root: Path) -> None:
    """Make torch's ``default_cache_dir()`` answer ``root`` in this process, wherever it is bound."""

    def default_cache_dir() -> str:
        return str(root)

    for name in DEFAULT_CACHE_DIR_USERS:
        module = importlib.import_module(name)
        module.default_cache_dir = default_cache_dir
    codecache = sys.modules["torch._inductor.codecache"]
    codecache._HEADER_DIR = os.path.join(root, "precompiled_headers")
    codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")


def compiled(fn, **kwargs):
    """``torch.compile(fn, **kwargs)`` with the caches in normswap's private directory: the one way
    normswap compiles (the evaluation's ``--compile``, the study's ``compile`` kernel, the
    compatibility matrix's torch.compile row)."""
    import torch

    private_compile_cache()
    return torch.compile(fn, **kwargs)


__all__ = ["DEFAULT_CACHE_DIR_USERS", "compiled", "private_compile_cache"]
