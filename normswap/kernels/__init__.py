"""RMSNorm kernels behind one function, and the one place that decides which kernel a call runs.

    rms_norm(x, weight=None, eps=1e-5, residual=None, *, bias=None) -> y  |  (y, x + residual)
    bind(x, weight, bias, residual=None) -> Bound(name, fn)  (the decision, made once per kind of call)

Backends, chosen by the environment variable NORMSWAP_KERNEL (read once per process):
- ``auto`` (default): in eager mode the fastest implementation measured on this machine for the
  kind of call (device, dtype, width, few/many rows, γ, residual, gradient) at the call's own
  shape — normswap's compiled C++ kernel on CPU, its Triton kernels on CUDA, torch's own
  ``F.rms_norm``, or the plain composite — see normswap.kernels.autotune; under torch.compile the
  plain formula, which Inductor fuses with the residual add and its neighbours.
- ``triton``: the Triton kernels for CUDA tensors. A CPU tensor (convert's verification, a CPU
  eval in the same process) keeps what ``auto`` chooses there, with one warning; with
  TRITON_INTERPRET=1 (tests) the kernels run on CPU tensors too. Only an explicit
  ``backend="triton"`` argument refuses a CPU tensor.
- ``torch``: the plain PyTorch formula differentiated by autograd (the reference).
- ``cpu`` / ``composite`` / ``native``: force one implementation (benchmarks and tests).

Dtype rule (all backends, also under autocast): statistics and the normalise-and-scale run in
float32 and the result is rounded once to x's dtype; the weight is used at its own precision and
its gradient comes back in its dtype; with a residual, the sum follows PyTorch's type promotion
exactly as `x + residual` would (bf16 + fp32 -> fp32), is rounded to that dtype, and is both
normalised and returned; y then has the sum's dtype. Autocast does not change any of this: like HF's
LlamaRMSNorm, the norm returns the dtype it was given.

Per-call cost: :func:`bind` returns a function of ``(x, weight, bias, eps)`` that goes straight to
the chosen implementation — the C++ extension's ``norm`` itself on CPU (it checks the arguments,
adds the bias and builds one C++ autograd node only when a gradient is needed), ``torch.rms_norm``
behind one line on CUDA — so a caller that keeps the bound function (normswap.modules.RMSNorm does,
per kind of call) pays no per-call decision at all.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from normswap.errors import NormswapError
from normswap.kernels import autotune as _autotune
from normswap.kernels.dispatch import CPU_DTYPES, call_impl, cpu_ext

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled

BACKENDS = ("auto", "triton", "torch", "cpu", "composite", "native")


# NORMSWAP_KERNEL is read once, on the first call: os.environ.get costs about as much as a small
# norm's whole dispatch, and the setting is a process-wide choice. normswap.testing.kernel_backend
# changes it for a block (it sets the variable and has it read again).
_requested: str | None = None


def requested_backend() -> str:
    """The backend NORMSWAP_KERNEL asks for (``auto`` when unset)."""
    global _requested
    if _requested is None:
        value = os.environ.get("NORMSWAP_KERNEL", "auto").strip().lower() or "auto"
        if value not in BACKENDS:
            raise NormswapError(f"NORMSWAP_KERNEL={value!r} is not one of {', '.join(BACKENDS)}")
        _requested = value
    return _requested


def reread_requested_backend() -> None:
    """Read NORMSWAP_KERNEL again on the next call (after the environment changed in this process);
    every bound decision is dropped with it (modules bind again on their next call)."""
    global _requested, _centre_rows, _warned_triton_on_cpu
    _requested = _centre_rows = None
    _warned_triton_on_cpu = False
    _autotune.drop_decisions()


# the compiled centred lookup, or False where it is not used; decided on the first call
_centre_rows = None
_CENTRE_DTYPES = (torch.float32, torch.float64)


def centered_rows(table, ids):
    """Rows of a [V, H] ``table`` looked up by int64 ``ids``, each minus its mean, computed without
    gradient in one compiled call (csrc: ``centered_embedding``) — a converted model's tied token
    table per decoded token. None where that call does not apply (not CPU, another dtype, the
    compiled kernel unavailable or NORMSWAP_KERNEL asking for another backend): the caller then
    computes the formula itself."""
    global _centre_rows
    if _centre_rows is None:
        from normswap.kernels import _ops

        wanted = requested_backend() in ("auto", "cpu", "triton")  # triton: CUDA only; CPU work keeps auto's
        _centre_rows = cpu_ext().centered_embedding if wanted and _ops.cpu_fast_available() else False
    if _centre_rows and table.is_cpu and table.dtype in _CENTRE_DTYPES and ids.dtype == torch.long:
        return _centre_rows(table.contiguous(), ids)
    return None


# ---------------------------------------------------------------------------------------------
# the decision: which implementation a kind of call runs, and the function that runs it
# ---------------------------------------------------------------------------------------------


class Bound(NamedTuple):
    """What a kind of call runs: ``name`` (an implementation of BACKENDS) and ``fn``, called as
    ``fn(x, weight, bias, eps) -> y`` (no residual) or ``fn(x, residual, weight, bias, eps) ->
    (y, x + residual)``."""

    name: str
    fn: Callable


FEW_ROWS = 16  # at most this many rows is a "few rows" call (decode: bound by launch and host cost)

_warned_triton_on_cpu = False
# the functional API's memo: kind of call -> implementation name (dropped with every other decision)
_chosen = _autotune.chosen


def call_kind(x, weight, bias, residual=None, grad=None) -> tuple:
    """The key every decision is made and remembered under: (device type, device index, dtype,
    width, few rows, γ's dtype or None, β present, residual dtype or None, gradient)."""
    h = x.shape[-1] if x.dim() else 0
    if grad is None:
        grad = _needs_grad(x, weight, bias, residual)
    return (
        x.device.type,
        x.device.index,
        x.dtype,
        h,
        x.numel() <= FEW_ROWS * max(1, h),
        None if weight is None else weight.dtype,
        bias is not None,
        None if residual is None else residual.dtype,
        bool(grad),
    )


def _needs_grad(x, weight, bias, residual) -> bool:
    return _grad_enabled() and (
        x.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
        or (residual is not None and residual.requires_grad)
    )


def describe(kind: tuple) -> str:
    """A kind of call in words, e.g. ``cuda bfloat16 ×1600, many rows, γ, inference``."""
    dev, _, dtype, h, few, wdt, has_b, rdt, grad = kind
    parts = [f"{dev} {str(dtype).replace('torch.', '')} ×{h}", "few rows" if few else "many rows"]
    parts += ["γ"] if wdt is not None else []
    parts += ["β"] if has_b else []
    parts += ["+residual"] if rdt is not None else []
    parts.append("training" if grad else "inference")
    return ", ".join(parts)


def choose(x, weight, bias=None, residual=None, backend=None, grad=None) -> str:
    """The implementation a call like this one runs (``backend`` overrides NORMSWAP_KERNEL)."""
    requested = _request(backend, x.device.type)
    if x.dtype == torch.float64 or requested == "torch":
        # float64 is for verification (convert checks its algebra to ~1e-15; the kernels compute in
        # float32)
        return "torch"
    if _is_compiling():
        # Inductor fuses the plain formula (and the residual add) itself; a named backend stays one
        # opaque custom op
        return "torch" if requested == "auto" else requested
    if requested != "auto":
        return requested
    if grad is None:
        grad = _needs_grad(x, weight, bias, residual)
    h = x.shape[-1]
    for name in _autotune.ranking(
        x.device, x.dtype, h, x.numel() // max(1, h), grad, weight=weight is not None, residual=residual is not None
    ):
        # native F.rms_norm takes a slow path, and rounds γ, when γ's dtype differs from x's
        if name == "native" and weight is not None and weight.dtype != x.dtype:
            continue
        return name
    return "composite"


def _request(backend, device_type: str) -> str:
    """What NORMSWAP_KERNEL (or an explicit ``backend``) asks of a call on ``device_type``: the
    setting ``triton`` means CUDA tensors, so elsewhere (without the interpreter) it asks for ``auto``,
    with one warning; an explicit ``backend="triton"`` stays as asked (and refuses a CPU tensor)."""
    requested = requested_backend() if backend is None else backend
    if requested not in BACKENDS:
        raise NormswapError(f"unknown RMSNorm backend {requested!r}; expected one of {', '.join(BACKENDS)}")
    if requested == "triton" and backend is None and device_type != "cuda" and not _triton_interpreting():
        _warn_triton_on_cpu()
        return "auto"
    return requested


def _triton_interpreting() -> bool:
    """Whether Triton kernels run on CPU tensors in this process (TRITON_INTERPRET=1: the tests)."""
    from normswap.kernels import _ops

    if not _ops.triton_importable():
        return False
    from normswap.kernels.triton_kernels import interpreter_active

    return interpreter_active()


def _warn_triton_on_cpu() -> None:
    global _warned_triton_on_cpu
    if not _warned_triton_on_cpu:
        _warned_triton_on_cpu = True
        warnings.warn(
            "NORMSWAP_KERNEL=triton applies to CUDA tensors: RMSNorm calls on CPU tensors (convert's "
            "verification, a CPU eval) run what NORMSWAP_KERNEL=auto chooses there",
            stacklevel=3,
        )


def bind(x, weight, bias=None, residual=None, backend=None, grad=None) -> Bound:
    """The decision for calls like this one, as a function that runs it with no further choice:
    see :class:`Bound`. The caller keeps it for as long as its calls stay of this kind
    (:func:`call_kind`); normswap.modules.RMSNorm keeps one per dtype, device type, few/many rows and
    gradient mode, and registers itself with ``autotune.binders`` so that a changed decision
    (NORMSWAP_KERNEL read again, the choices forgotten) reaches it."""
    name = choose(x, weight, bias, residual, backend, grad)
    return Bound(name, _function(name, x, weight, bias, residual))


def _function(name, x, weight, bias, residual):
    if name == "cpu" and x.dtype in CPU_DTYPES and (residual is None or residual.dtype == x.dtype):
        ext = cpu_ext()  # the C++ function itself: it adds the bias and builds its own autograd node
        return ext.norm if residual is None else ext.add_norm
    if name == "native" and residual is None:
        rms = torch.rms_norm
        if bias is None:

            def native(x, weight, bias, eps):
                return rms(x, x.shape[-1:], weight, eps)
        else:

            def native(x, weight, bias, eps):
                y = rms(x, x.shape[-1:], weight, eps)
                return y + (bias if bias.dtype == y.dtype else bias.to(y.dtype))

        return native
    if name == "triton" and residual is None:
        return _triton_function()
    if residual is None:

        def general(x, weight, bias, eps):
            return _run(name, x, weight, bias, None, eps)

        return general

    def general_add(x, residual, weight, bias, eps):
        return _run(name, x, weight, bias, residual, eps)

    return general_add


def _triton_function():
    """The Triton kernels behind as little host work as a call allows: inference goes straight to
    the launch (no autograd.Function, no backend resolution); a call that needs a gradient takes the
    autograd.Function, whose backward is the persistent Triton kernel (fp32 dγ partials)."""
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
        return y if bias is None else y + (bias if bias.dtype == y.dtype else bias.to(y.dtype))

    return triton


def _run(name, x, weight, bias, residual, eps):
    """One call through the named implementation, any kind: shapes checked, a residual of another
    dtype promoted as `x + residual` would, β added in the output's dtype."""
    h = x.shape[-1]
    if weight is not None and weight.shape != (h,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({h},)")
    if bias is not None and bias.shape != (h,):
        raise ValueError(f"rms_norm: bias has shape {tuple(bias.shape)}, expected ({h},)")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            # promote like `x + residual` (differentiably, so each gradient returns in its own dtype)
            dt = torch.result_type(x, residual)
            x, residual = x.to(dt), residual.to(dt)
    if name == "cpu" and x.dtype in CPU_DTYPES and not _is_compiling():
        ext = cpu_ext()
        return ext.norm(x, weight, bias, eps) if residual is None else ext.add_norm(x, residual, weight, bias, eps)
    if name == "torch" or x.dtype == torch.float64:
        from normswap.kernels.reference import rms_norm_reference

        out = rms_norm_reference(x, weight, eps, residual)
    else:
        out = call_impl(name, x, weight, residual, eps)
    if bias is None:
        return out
    # β in the output's dtype: a float32 bias must not promote a bf16 activation
    if residual is None:
        return out + bias.to(out.dtype)
    return out[0] + bias.to(out[0].dtype), out[1]


def rms_norm(x, weight=None, eps=1e-5, residual=None, *, bias=None, backend=None):
    """RMSNorm over the last dimension of x (+ bias), optionally fused with a residual add.

    Returns y, or (y, x + residual) when residual is given. Differentiable in x, weight, bias and
    residual. `backend` overrides NORMSWAP_KERNEL for this call. The general entry point: every
    call's shapes are checked; the converted module's own calls take :func:`bind`'s function instead.
    """
    if backend is None and not _is_compiling() and x.dim():
        kind = call_kind(x, weight, bias, residual)
        name = _chosen.get(kind)
        if name is None:
            name = _chosen[kind] = choose(x, weight, bias, residual, grad=kind[-1])
    else:
        name = choose(x, weight, bias, residual, backend)
    return _run(name, x, weight, bias, residual, eps)


def backend_for(device, dtype=torch.float32, hidden: int = 768, rows: int = 1024, grad: bool = False) -> str:
    """The implementation `auto` runs on a device for calls of this kind (measured on first use)."""
    from normswap.kernels import _ops, autotune

    device = torch.device(device)
    backend = _request(None, device.type)
    if backend != "auto":
        return _ops.resolve(backend, device) if backend not in ("torch", "native") else backend
    return autotune.ranking(device, dtype, hidden, rows, grad)[0]


__all__ = [
    "rms_norm",
    "bind",
    "choose",
    "call_kind",
    "describe",
    "Bound",
    "centered_rows",
    "requested_backend",
    "reread_requested_backend",
    "backend_for",
    "call_impl",
    "BACKENDS",
]
