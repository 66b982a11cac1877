"""The one interface tests (normswap's own, and a user's) use to reach into normswap.

Everything a test needs to force, inject or reset goes through here, so that product code keeps
no test-only switches of its own (no environment variables but the documented user settings, see
docs/architecture.md) and a reader finds every hook in one place. Nothing in the package imports
this module (tests/test_package_structure.py ranks it above every other part).

- ``kernel_backend(name)``: run a block with NORMSWAP_KERNEL set to ``name`` (the variable is read
  once per process otherwise).
- ``cpu_isa(name)``: force the compiled CPU kernel's instruction set (``baseline``, ``avx2``,
  ``best``); False where that is not possible here.
- ``forget_kernel_choices()``: drop the autotuner's in-memory choices (the on-disk table is read
  again on the next choice).
- ``FinetuneHooks``: fault injection for ``run_finetune(..., hooks=)``: replace a step's loss
  (e.g. by NaN) or run something after each step (e.g. wait so a test can kill the process).
- ``StudyHooks``: the same for ``normswap study`` (per arm: its loss, after each interleaved step).
- A deliberately wrong conversion needs no hook: ``convert_checkpoint(src, out, ConvertOptions(...))``
  and ``build_plan(family, model, config, options)`` take any options and any family.
"""

from __future__ import annotations

import contextlib
import os

from normswap.finetune.trainer import Hooks as FinetuneHooks
from normswap.study.interleaved import Hooks as StudyHooks

__all__ = ["FinetuneHooks", "StudyHooks", "cpu_isa", "forget_kernel_choices", "kernel_backend"]


@contextlib.contextmanager
def kernel_backend(name: str | None):
    """NORMSWAP_KERNEL=``name`` inside the block (None: unset), as it was afterwards."""
    from normswap import kernels

    before = os.environ.get("NORMSWAP_KERNEL")
    _set_env("NORMSWAP_KERNEL", name)
    kernels.reread_requested_backend()
    try:
        yield
    finally:
        _set_env("NORMSWAP_KERNEL", before)
        kernels.reread_requested_backend()


def cpu_isa(name: str) -> bool:
    from normswap.kernels import cpu

    return cpu.force_isa(name)


def forget_kernel_choices() -> None:
    from normswap.kernels import autotune

    autotune.forget()


def _set_env(var: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = value
