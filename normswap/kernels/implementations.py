"""Every RMSNorm implementation, one record each, in one table.

A record (:class:`Impl`) says what an implementation runs — device types, dtypes, γ, a fused
residual add, a backward of its own — whether it can run here now (``ready``: built, importable,
switched on), and the two ways to call it:

- ``run(x, weight, bias, residual, eps)``: one call, API convention (y, or (y, x + residual)),
  inputs already checked; the general entry point and autotune's measurement call it;
- ``bind(x, weight, bias, residual)``: the function a kind of call keeps, called as
  ``fn(x, weight, bias, eps)`` (no residual) or ``fn(x, residual, weight, bias, eps)``: as little
  host work as that kind allows (the C++ ``norm`` itself on CPU, ``torch.rms_norm`` behind one line).

Which record a call runs is normswap.kernels.choose's decision, made there alone. A new
implementation is one :func:`register` call (``normswap.testing.registered_impl`` plants one for a
block).

Settings read here: ``NORMSWAP_CPU_KERNEL=0`` switches the ``cpu`` record off (it is then never
built or run); it is the record's own switch, asked wherever its readiness is.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from normswap.errors import NormswapError
from normswap.kernels import cpu

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled

# At most this many rows is a "few rows" call (decode: bound by launch and host cost, not bandwidth);
# the chooser's kinds, autotune's shape classes and the module's kept decisions all split here.
FEW_ROWS = 16

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
CPU_DTYPES = FLOATS  # the compiled CPU kernel's (float16 where the compiler supports it: ``ready`` asks)


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation: what it runs, whether it runs here now, and how it is called (module doc)."""

    name: str
    devices: tuple[str, ...]  # device types it runs on
    dtypes: tuple[torch.dtype, ...]
    weight: bool  # takes γ
    residual: bool  # takes a residual to add before the norm (and returns the sum)
    backward: bool  # differentiable (calls that need a gradient)
    ranked: bool  # a candidate of `auto`'s measured ranking
    ready: Callable[[str, torch.dtype], bool]  # runs here now (built, importable, switched on)
    run: Callable
    bind: Callable
    unavailable: Callable[[], str]  # why it cannot run here, in one line (for an explicit request)
    what: str = ""  # one line for docs and `normswap bench kernels`
    # `auto` picks it only when γ is absent or has x's dtype (F.rms_norm otherwise rounds γ to x's
    # dtype and takes a slow path); a request by name still runs it
    weight_in_x_dtype: bool = False
    # torch's own op (F.rms_norm), none of normswap's code: what a study's ``--kernels torch`` runs too
    torch_own: bool = False
    # a device type it also runs on where this process allows (Triton's interpreter: CPU tensors)
    also_on: Callable[[str], bool] = lambda device_type: False

    def runs_on(self, device_type: str) -> bool:
        return device_type in self.devices or self.also_on(device_type)

    def supports(self, device_type: str, dtype, weight: bool, residual: bool, grad: bool) -> bool:
        """Whether calls of this kind are within what the record runs (readiness not asked)."""
        return (
            self.runs_on(device_type)
            and dtype in self.dtypes
            and (self.weight or not weight)
            and (self.residual or not residual)
            and (self.backward or not grad)
        )


TABLE: dict[str, Impl] = {}


def register(impl: Impl) -> Impl:
    """Add (or replace) a record."""
    TABLE[impl.name] = impl
    return impl


def unregister(name: str) -> None:
    TABLE.pop(name, None)


# ---------------------------------------------------------------------------------------------
# the calls every record shares
# ---------------------------------------------------------------------------------------------


def plus_bias(out, bias):
    """β added in the output's dtype (a float32 β must not promote a bf16 activation)."""
    if bias is None:
        return out
    if isinstance(out, tuple):
        return out[0] + bias.to(out[0].dtype), out[1]
    return out + (bias if bias.dtype == out.dtype else bias.to(out.dtype))


def checked_call(impl: Impl, x, weight, bias, residual, eps):
    """One call through ``impl``, any kind: shapes checked, a residual of another dtype promoted as
    `x + residual` would (differentiably, so each gradient returns in its own dtype)."""
    h = x.shape[-1]
    if weight is not None and weight.shape != (h,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({h},)")
    if bias is not None and bias.shape != (h,):
        raise ValueError(f"rms_norm: bias has shape {tuple(bias.shape)}, expected ({h},)")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            dt = torch.result_type(x, residual)
            x, residual = x.to(dt), residual.to(dt)
    return impl.run(x, weight, bias, residual, eps)


def _general(impl: Impl, residual) -> Callable:
    """The bound function of a record without a leaner one for this kind: the checked general call."""
    if residual is None:

        def general(x, weight, bias, eps):
            return checked_call(impl, x, weight, bias, None, eps)

        return general

    def general_add(x, residual, weight, bias, eps):
        return checked_call(impl, x, weight, bias, residual, eps)

    return general_add


def _through_ops(name: str):
    """``run`` of a record whose kernels sit behind normswap's autograd.Function and custom op."""

    def run(x, weight, bias, residual, eps):
        from normswap.kernels import _ops  # registers torch.ops.normswap.* on first use

        y, _, summed = _ops.apply(x, weight, residual, float(eps), name)
        return plus_bias((y, summed) if residual is not None else y, bias)

    return run


# ---------------------------------------------------------------------------------------------
# cpu: normswap's compiled C++ kernel
# ---------------------------------------------------------------------------------------------


def cpu_switched_off() -> bool:
    return os.environ.get("NORMSWAP_CPU_KERNEL", "").strip().lower() in ("0", "false", "no", "off")


def cpu_ready(device_type: str = "cpu", dtype=torch.float32) -> bool:
    """Whether the compiled CPU kernel runs ``dtype`` here (builds it on the first ask; never raises)."""
    if device_type != "cpu" or cpu_switched_off():
        return False
    try:
        return cpu.supports(dtype)
    except Exception:  # noqa: BLE001 - the build module promises not to raise; a broken build is "not ready"
        return False


def cpu_ext():
    """The loaded C++ extension (only after :func:`cpu_ready` said yes)."""
    if not cpu_ready():
        raise NormswapError(f"the compiled CPU kernel is not available: {_cpu_unavailable()}")
    return cpu.extension()


def _cpu_unavailable() -> str:
    if cpu_switched_off():
        return "switched off by NORMSWAP_CPU_KERNEL=0"
    return cpu.unavailable_reason() or "it needs a C++ compiler and ninja"


def _cpu_run(x, weight, bias, residual, eps):
    if _is_compiling():  # Dynamo cannot trace pybind: the custom op stays one opaque node
        return _through_ops("cpu")(x, weight, bias, residual, eps)
    ext = cpu.extension() or cpu_ext()
    if residual is None:
        return ext.norm(x, weight, bias, eps)
    return ext.add_norm(x, residual, weight, bias, eps)


def _cpu_bind(x, weight, bias, residual):
    if residual is None or residual.dtype == x.dtype:
        ext = cpu_ext()  # the C++ function itself: it adds β and builds its own autograd node
        return ext.norm if residual is None else ext.add_norm
    return _general(TABLE["cpu"], residual)


# ---------------------------------------------------------------------------------------------
# triton: normswap's Triton kernels
# ---------------------------------------------------------------------------------------------

_triton_found: bool | None = None


def triton_importable() -> bool:
    global _triton_found
    if _triton_found is None:
        try:
            import triton  # noqa: F401

            _triton_found = True
        except ImportError:
            _triton_found = False
    return _triton_found


def triton_interpreting(device_type: str = "cpu") -> bool:
    """Whether Triton kernels run on CPU tensors in this process (TRITON_INTERPRET=1: the tests)."""
    if device_type != "cpu" or not triton_importable():
        return False
    from normswap.kernels.triton_kernels import interpreter_active

    return interpreter_active()


def _triton_ready(device_type: str, dtype) -> bool:
    return triton_importable() and (device_type == "cuda" or triton_interpreting(device_type))


def _triton_bind(x, weight, bias, residual):
    """Inference goes straight to the launch (no autograd.Function); a call that needs a gradient
    takes the autograd.Function, whose backward is the persistent Triton kernel (fp32 dγ partials)."""
    if residual is not None:
        return _general(TABLE["triton"], residual)
    from normswap.kernels import _ops, triton_kernels

    forward, with_autograd = triton_kernels.forward, _ops.apply

    def triton(x, weight, bias, eps):
        if _grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
            y = with_autograd(x, weight, None, eps, "triton")[0]
        else:
            h = x.shape[-1]
            rows = x.reshape(-1, h)
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            cap = _ops.TRITON_MAX_FUSED_N  # tests lower it to reach the looped kernels on small rows
            out = forward(rows, weight, None, eps) if cap is None else forward(rows, weight, None, eps, max_fused_n=cap)
            y = out[0].view(x.shape)
        return plus_bias(y, bias)

    return triton


# ---------------------------------------------------------------------------------------------
# native: torch's own F.rms_norm (a fused kernel on CUDA in recent torch, a composite on CPU)
# ---------------------------------------------------------------------------------------------


def _native_run(x, weight, bias, residual, eps):
    if residual is not None:
        s = x + residual
        return plus_bias((F.rms_norm(s, (s.shape[-1],), weight, eps), s), bias)
    return plus_bias(F.rms_norm(x, (x.shape[-1],), weight, eps), bias)


def _native_bind(x, weight, bias, residual):
    if residual is not None:
        return _general(TABLE["native"], residual)
    rms = torch.rms_norm
    if bias is None:

        def native(x, weight, bias, eps):
            return rms(x, x.shape[-1:], weight, eps)

        return native

    def native_bias(x, weight, bias, eps):
        y = rms(x, x.shape[-1:], weight, eps)
        return y + (bias if bias.dtype == y.dtype else bias.to(y.dtype))

    return native_bias


# ---------------------------------------------------------------------------------------------
# torch: the plain formula, differentiated by autograd (the reference; what Inductor fuses)
# ---------------------------------------------------------------------------------------------


def _torch_run(x, weight, bias, residual, eps):
    from normswap.kernels.reference import rms_norm_reference

    return plus_bias(rms_norm_reference(x, weight, eps, residual), bias)


def _always(device_type, dtype) -> bool:
    return True


# ---------------------------------------------------------------------------------------------
# compiled: torch.compile of the plain formula (Inductor), where compiling pays (CUDA); not ranked by
# `auto` (a compile costs seconds a shape), named by the study's `--kernels best` when it times faster
# ---------------------------------------------------------------------------------------------


def _formula(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@functools.cache
def _compiled_formula():
    from normswap.compile_cache import compiled

    return compiled(_formula, dynamic=False)


def _compiled_run(x, weight, bias, residual, eps):
    if residual is not None:
        s = x + residual
        return plus_bias((_compiled_formula()(s, weight, eps), s), bias)
    return plus_bias(_compiled_formula()(x, weight, eps), bias)


ANY_DEVICE = ("cpu", "cuda", "mps", "xpu", "meta")

register(
    Impl(
        name="cpu",
        devices=("cpu",),
        dtypes=CPU_DTYPES,
        weight=True,
        residual=True,
        backward=True,
        ranked=True,
        ready=cpu_ready,
        run=_cpu_run,
        bind=_cpu_bind,
        unavailable=_cpu_unavailable,
        what="normswap's compiled C++ kernel (fused residual add and backward; one C++ call)",
    )
)
register(
    Impl(
        name="triton",
        devices=("cuda",),
        also_on=triton_interpreting,
        dtypes=FLOATS,
        weight=True,
        residual=True,
        backward=True,
        ranked=True,
        ready=_triton_ready,
        run=_through_ops("triton"),
        bind=_triton_bind,
        unavailable=lambda: (
            "the Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1 for CPU tensors)"
            if triton_importable()
            else "triton is not installed"
        ),
        what="normswap's Triton kernels (one-pass forward, persistent backward with fp32 dγ partials)",
    )
)
register(
    Impl(
        name="native",
        devices=ANY_DEVICE,
        dtypes=FLOATS,
        weight=True,
        residual=True,
        backward=True,
        ranked=True,
        ready=_always,
        run=_native_run,
        bind=_native_bind,
        unavailable=lambda: "",
        what="torch's own F.rms_norm (fused on CUDA in recent torch; a composite on CPU)",
        weight_in_x_dtype=True,
        torch_own=True,
    )
)
register(
    Impl(
        name="composite",
        devices=ANY_DEVICE,
        dtypes=FLOATS,
        weight=True,
        residual=True,
        backward=True,
        ranked=True,
        ready=_always,
        run=_through_ops("composite"),
        bind=lambda x, weight, bias, residual: _general(TABLE["composite"], residual),
        unavailable=lambda: "",
        what="the plain-torch formula with a hand-written backward (always available)",
    )
)
register(
    Impl(
        name="torch",
        devices=ANY_DEVICE,
        dtypes=(*FLOATS, torch.float64),
        weight=True,
        residual=True,
        backward=True,
        ranked=False,
        ready=_always,
        run=_torch_run,
        bind=lambda x, weight, bias, residual: _general(TABLE["torch"], residual),
        unavailable=lambda: "",
        what="the plain formula differentiated by autograd: the reference, float64, and what Inductor fuses",
    )
)
register(
    Impl(
        name="compiled",
        devices=("cuda",),
        dtypes=FLOATS,
        weight=True,
        residual=True,
        backward=True,
        ranked=False,
        ready=_always,
        run=_compiled_run,
        bind=lambda x, weight, bias, residual: _general(TABLE["compiled"], residual),
        unavailable=lambda: (
            "torch.compile of the formula is a candidate on CUDA tensors only "
            "(on a CPU a compile costs tens of seconds a shape and the C++ kernel is one pass already)"
        ),
        what="torch.compile of the plain formula (Inductor); not ranked by auto: the study times it where it pays",
    )
)
