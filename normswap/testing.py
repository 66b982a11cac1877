"""The one interface tests (normswap's own, and a user's) use to reach into normswap.

Everything a test needs to force, inject or reset goes through here, so that product code keeps
no test-only switches of its own (no environment variables but the documented user settings, see
docs/architecture.md) and a reader finds every hook in one place. Nothing in the package imports
this module (tests/test_package_structure.py ranks it above every other part).

- ``kernel_backend(name)``: run a block with the kernel setting set to ``name`` (normswap.kernels.choose
  reads it once per process otherwise).
- ``cpu_isa(name)``: force the compiled CPU kernel's instruction set (``baseline``, ``avx2``,
  ``best``); False where that is not possible here.
- ``forget_kernel_choices()``: drop the autotuner's in-memory rankings and every decision taken from
  them (the on-disk table is read again on the next choice).
- ``registered_impl(record)``: a block in which ``record`` (a normswap.kernels.implementations.Impl: a
  planted implementation, or a changed copy of a real one made with ``dataclasses.replace``) is in
  the table, with every choice forgotten on the way in and out.
- ``FinetuneHooks``: fault injection for ``run_finetune(..., hooks=)``: replace a step's loss
  (e.g. by NaN) or run something after each step (e.g. wait so a test can kill the process).
- ``StudyHooks``: the same for ``normswap study`` (per arm: its loss, after each interleaved step).
- A deliberately wrong conversion needs no hook: ``convert_checkpoint(src, out, ConvertOptions(...))``
  and ``build_plan(family, model, config, options)`` take any options and any family.
"""

from __future__ import annotations

import contextlib

from normswap.finetune.trainer import Hooks as FinetuneHooks
from normswap.study.training.interleaved import Hooks as StudyHooks

__all__ = ["FinetuneHooks", "StudyHooks", "cpu_isa", "forget_kernel_choices", "kernel_backend", "registered_impl"]


@contextlib.contextmanager
def kernel_backend(name: str | None):
    """The kernel setting ``name`` inside the block (None: unset), as it was afterwards."""
    from normswap.kernels import choose

    before = choose.set_setting(name)
    try:
        yield
    finally:
        choose.set_setting(before)


def cpu_isa(name: str) -> bool:
    from normswap.kernels import cpu

    return cpu.force_isa(name)


def forget_kernel_choices() -> None:
    from normswap.kernels import choose

    choose.forget()


@contextlib.contextmanager
def registered_impl(record):
    """``record`` in the implementation table inside the block (replacing one of its name), as it
    was afterwards; the choices are forgotten on the way in and out."""
    from normswap.kernels import choose
    from normswap.kernels import implementations as registry

    before = registry.TABLE.get(record.name)
    registry.register(record)  # a replaced record keeps its place in the table's order
    choose.forget()
    try:
        yield record
    finally:
        if before is None:
            registry.unregister(record.name)
        else:
            registry.register(before)
        choose.forget()
