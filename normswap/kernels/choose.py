"""Which implementation a kind of call runs: decided here, and nowhere else.

:func:`decide` maps a kind of call (:func:`call_kind`: device, dtype, width, few or many rows, γ,
β, residual, gradient) to a record of normswap.kernels.implementations's table, by these rules in order:

1. float64 is verification's dtype: the reference formula (``torch``), whatever is asked.
2. A name asked for — ``backend=`` in a call, or the setting ``NORMSWAP_KERNEL`` (read here, once
   per process) — runs that record. If it cannot run the call, a ``backend=`` raises
   (:class:`~normswap.errors.NormswapError`, saying why); so does the setting, except for calls on a
   device type the record does not run on at all: the setting is process-wide, so
   ``NORMSWAP_KERNEL=triton`` means *CUDA tensors*, and a CPU call in the same process (convert's
   verification) runs what ``auto`` chooses there, with one warning.
3. The compile rule: while torch.compile traces, ``auto`` gives Inductor the plain formula (the
   residual add, the norm and their neighbours fuse into one generated kernel); a named record stays
   one opaque custom op. In a study, ``torch.compile`` of the formula is a candidate on CUDA only
   (:func:`compile_pays`).
4. ``auto``: the records that run this kind here, ranked by measurement at the call's own shape
   (normswap.kernels.autotune), fastest first; the first that binds is the choice. One that fails
   to bind is skipped (the next one runs), so an automatic choice falls back where a named one raises.

:func:`bind` returns the decision as a function that runs it with no further choice; the module
(normswap.modules.RMSNorm) keeps one per kind of call, and registers itself in :data:`binders` so
that a changed decision (the setting read again, the choices forgotten) reaches it.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from normswap.errors import NormswapError
from normswap.kernels import autotune
from normswap.kernels.implementations import FEW_ROWS, TABLE, Impl

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled

AUTO = "auto"

# the setting, read once: os.environ.get costs about as much as a small norm's whole dispatch, and
# the setting is a process-wide choice (normswap.testing.kernel_backend sets it and has it read again)
_setting: str | None = None
_warned: set = set()  # settings already warned about (a call on a device type their record does not run on)
# the functional API's memo: kind of call -> record (normswap.kernels.rms_norm)
decided: dict = {}
# whatever keeps bound decisions of its own (normswap.modules.RMSNorm): told to drop them with the rest
binders: weakref.WeakSet = weakref.WeakSet()


def settings() -> tuple[str, ...]:
    """What NORMSWAP_KERNEL accepts: ``auto`` and every record's name."""
    return (AUTO, *TABLE)


def setting() -> str:
    """The implementation NORMSWAP_KERNEL asks for (``auto`` when unset)."""
    global _setting
    if _setting is None:
        value = os.environ.get("NORMSWAP_KERNEL", AUTO).strip().lower() or AUTO
        if value not in settings():
            raise NormswapError(f"NORMSWAP_KERNEL={value!r} is not one of {', '.join(settings())}")
        _setting = value
    return _setting


def set_setting(value: str | None) -> str | None:
    """Set NORMSWAP_KERNEL for this process (None: unset) and read it again; returns what it was."""
    before = os.environ.get("NORMSWAP_KERNEL")
    if value is None:
        os.environ.pop("NORMSWAP_KERNEL", None)
    else:
        os.environ["NORMSWAP_KERNEL"] = value
    reread()
    return before


def reread() -> None:
    """Read NORMSWAP_KERNEL again on the next call; every decision taken is dropped with it."""
    global _setting
    _setting = None
    _warned.clear()
    drop_decisions()


def forget() -> None:
    """Drop autotune's rankings and every decision taken from them (the on-disk table is read again)."""
    autotune.forget()
    drop_decisions()


def drop_decisions() -> None:
    decided.clear()
    for b in list(binders):
        b.unbind()


def setting_on(device_type: str) -> str:
    """What the setting asks of calls on ``device_type``: a record's name, or ``auto`` where the
    named record does not run on that device type at all."""
    name = setting()
    if name != AUTO and not TABLE[name].runs_on(device_type):
        return AUTO
    return name


# ---------------------------------------------------------------------------------------------
# kinds of call
# ---------------------------------------------------------------------------------------------


class CallKind(NamedTuple):
    """The key every decision is made and remembered under (a tuple: hashable, cheap to build)."""

    device: str  # device type
    index: int | None  # device index
    dtype: torch.dtype
    width: int
    few_rows: bool  # at most FEW_ROWS rows (decode), else many (prefill, training)
    weight_dtype: torch.dtype | None  # γ's dtype, None without γ
    bias: bool  # β present
    residual_dtype: torch.dtype | None  # the residual's dtype, None without a fused residual add
    grad: bool  # a gradient is needed


_new_kind = tuple.__new__


def call_kind(x, weight, bias, residual=None, grad=None) -> CallKind:
    """The kind of call ``rms_norm(x, weight, bias=bias, residual=residual)`` is (see :class:`CallKind`)."""
    h = x.shape[-1] if x.dim() else 0
    if grad is None:
        grad = _needs_grad(x, weight, bias, residual)
    # tuple.__new__ skips the NamedTuple constructor's argument handling: rms_norm's functional API
    # builds a kind on every call
    return _new_kind(
        CallKind,
        (
            x.device.type,
            x.device.index,
            x.dtype,
            h,
            x.numel() <= FEW_ROWS * max(1, h),
            None if weight is None else weight.dtype,
            bias is not None,
            None if residual is None else residual.dtype,
            bool(grad),
        ),
    )


def _needs_grad(x, weight, bias, residual) -> bool:
    return _grad_enabled() and (
        x.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
        or (residual is not None and residual.requires_grad)
    )


def describe(kind: CallKind) -> str:
    """A kind of call in words, e.g. ``cuda bfloat16 ×1600, many rows, γ, inference``."""
    parts = [f"{kind.device} {str(kind.dtype).replace('torch.', '')} ×{kind.width}"]
    parts += ["few rows" if kind.few_rows else "many rows"]
    parts += ["γ"] if kind.weight_dtype is not None else []
    parts += ["β"] if kind.bias else []
    parts += ["+residual"] if kind.residual_dtype is not None else []
    parts.append("training" if kind.grad else "inference")
    return ", ".join(parts)


def _runs(impl: Impl, kind: CallKind) -> bool:
    weight, residual = kind.weight_dtype is not None, kind.residual_dtype is not None
    return impl.supports(kind.device, kind.dtype, weight, residual, kind.grad) and impl.ready(kind.device, kind.dtype)


# ---------------------------------------------------------------------------------------------
# the decision
# ---------------------------------------------------------------------------------------------


def _record(name: str, source: str) -> Impl:
    impl = TABLE.get(name)
    if impl is None:
        expected = ", ".join(settings())
        raise NormswapError(f"{source}: unknown RMSNorm implementation {name!r}; expected one of {expected}")
    return impl


def _named(kind: CallKind, backend: str | None) -> Impl | None:
    """The record a name asks for (rule 2), None where the setting leaves this call to ``auto``."""
    name = setting() if backend is None else backend
    if name == AUTO:
        return None
    impl = _record(name, "NORMSWAP_KERNEL" if backend is None else "backend")
    if _is_compiling() or _runs(impl, kind):
        return impl
    dev = kind.device
    if backend is None and not impl.runs_on(dev):
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"NORMSWAP_KERNEL={name} applies to {'/'.join(impl.devices)} tensors: RMSNorm calls on {dev} "
                "tensors (convert's verification, a CPU eval) run what NORMSWAP_KERNEL=auto chooses there",
                stacklevel=4,
            )
        return None
    raise NormswapError(
        f"{'NORMSWAP_KERNEL=' + name if backend is None else 'backend=' + repr(name)} cannot run "
        f"{describe(kind)}: {_why_not(impl, kind)}"
    )


def _why_not(impl: Impl, kind: CallKind) -> str:
    dtype = kind.dtype
    if not impl.runs_on(kind.device):
        return impl.unavailable() or f"it runs on {'/'.join(impl.devices)} tensors"
    missing = [
        what
        for what, lacking in (
            (f"{str(dtype).replace('torch.', '')} tensors", dtype not in impl.dtypes),
            ("γ", kind.weight_dtype is not None and not impl.weight),
            ("a residual", kind.residual_dtype is not None and not impl.residual),
            ("a gradient", kind.grad and not impl.backward),
        )
        if lacking
    ]
    if missing:
        return "it does not take " + ", ".join(missing)
    return impl.unavailable() or "it is not available here"


def ranked(kind: CallKind, rows: int | None = None) -> list[Impl]:
    """``auto``'s records for this kind, fastest first (measured on first use at ``rows`` × width)."""
    names = [n for n, impl in TABLE.items() if impl.ranked and _runs(impl, kind)]
    if rows is None:
        rows = 4 if kind.few_rows else FEW_ROWS * 64
    device = torch.device(kind.device, kind.index) if kind.index is not None else torch.device(kind.device)
    wdt, dtype = kind.weight_dtype, kind.dtype
    order = autotune.ranking(
        device,
        dtype,
        kind.width,
        rows,
        kind.grad,
        weight=wdt is not None,
        residual=kind.residual_dtype is not None,
        candidates=names,
    )
    out = []
    for name in order:
        impl = TABLE.get(name)
        if impl is None or name not in names:
            continue
        if impl.weight_in_x_dtype and wdt is not None and wdt != dtype:
            continue
        out.append(impl)
    return out


def _order(kind: CallKind, backend: str | None, rows: int | None) -> tuple[list[Impl], bool]:
    """(the records to try, in order; whether they were named)."""
    if kind.dtype == torch.float64:  # rule 1
        return [TABLE["torch"]], False
    impl = _named(kind, backend)  # rule 2
    if impl is not None:
        return [impl], True
    if _is_compiling():  # rule 3
        return [TABLE["torch"]], False
    return [*ranked(kind, rows), TABLE["composite"]], False  # rule 4


def decide(kind: CallKind, backend: str | None = None, rows: int | None = None) -> Impl:
    """The record a call of this kind runs (``backend`` overrides NORMSWAP_KERNEL)."""
    return _order(kind, backend, rows)[0][0]


class Bound(NamedTuple):
    """What a kind of call runs: ``name`` (a record of the table) and ``fn``, called as
    ``fn(x, weight, bias, eps) -> y`` (no residual) or ``fn(x, residual, weight, bias, eps) ->
    (y, x + residual)``."""

    name: str
    fn: Callable


def bind(x, weight, bias=None, residual=None, backend=None, grad=None) -> Bound:
    """The decision for calls like this one, as a function that runs it with no further choice. The
    caller keeps it for as long as its calls stay of this kind (:func:`call_kind`)."""
    kind = call_kind(x, weight, bias, residual, grad)
    impls, named = _order(kind, backend, x.numel() // max(1, kind.width))
    for impl in impls:
        try:
            return Bound(impl.name, impl.bind(x, weight, bias, residual))
        except Exception:
            if named or impl is impls[-1]:
                raise
    raise AssertionError("unreachable: the last record re-raises")


def decide_call(kind: CallKind, x, weight, bias, residual) -> Impl:
    """The functional API's record for a kind of call (remembered in :data:`decided`)."""
    impl = decided.get(kind)
    if impl is None:
        impl = decided[kind] = TABLE[bind(x, weight, bias, residual, grad=kind.grad).name]
    return impl


def backend_for(device, dtype=torch.float32, hidden: int = 768, rows: int = 1024, grad: bool = False) -> str:
    """The implementation a call of this kind runs on ``device`` (γ, no residual; measured on first use)."""
    device = torch.device(device)
    kind = CallKind(device.type, device.index, dtype, hidden, rows <= FEW_ROWS, dtype, False, None, grad)
    return decide(kind, rows=rows).name


def compile_pays(device) -> bool:
    """Whether ``torch.compile`` of the formula is worth a candidate's place on this device: on CUDA;
    not on CPU, where compiling takes tens of seconds a shape on a small machine and normswap's C++
    kernel is already one fused pass."""
    return torch.device(device).type == "cuda"
