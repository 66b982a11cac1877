"""RMSNorm kernels behind one function.

    rms_norm(x, weight=None, eps=1e-5, residual=None, *, bias=None) -> y  |  (y, x + residual)

Backends, chosen per call by the environment variable NORMSWAP_KERNEL:
- ``auto`` (default): in eager mode the fastest implementation measured on this machine for the
  call's (device, dtype, width, rows, gradient) — normswap's compiled C++ kernel on CPU, its
  Triton kernels on CUDA, torch's own ``F.rms_norm``, or the plain composite — see
  normswap.kernels.autotune; under torch.compile the plain formula, which Inductor fuses with the
  residual add and its neighbours.
- ``triton``: the Triton kernels (on CPU tensors only with TRITON_INTERPRET=1, for tests).
- ``torch``: the plain PyTorch formula differentiated by autograd (the reference).
- ``cpu`` / ``composite`` / ``native``: force one implementation (benchmarks and tests).

Dtype rule (all backends, also under autocast): statistics and the normalise-and-scale run in
float32 and the result is rounded once to x's dtype; the weight is used at its own precision and
its gradient comes back in its dtype; with a residual, the sum follows PyTorch's type promotion
exactly as `x + residual` would (bf16 + fp32 -> fp32), is rounded to that dtype, and is both
normalised and returned; y then has the sum's dtype. Autocast does not change any of this: like HF's
LlamaRMSNorm, the norm returns the dtype it was given.

Per-call cost: where `auto` chose normswap's C++ kernel on CPU for a kind of call (dtype, width,
few/many rows, weight dtype; decided once and memoised), the call goes straight to one C++
function (``norm`` / ``add_norm`` in csrc/rms_norm_cpu.cpp) that checks the arguments, adds the
bias and, only when a gradient is needed, builds one C++ autograd node — no Python
autograd.Function, no custom-op dispatcher, no Python-side checks — so a decode-sized call costs
less than F.layer_norm's (bench/README.md, tiny shapes).
"""

from __future__ import annotations

import os

import torch

from normswap.errors import NormswapError
from normswap.kernels import autotune as _autotune
from normswap.kernels.dispatch import CPU_DTYPES, call_impl, cpu_ext

_is_compiling = torch.compiler.is_compiling

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
    """Read NORMSWAP_KERNEL again on the next call (after the environment changed in this process)."""
    global _requested, _centre_rows
    _requested = _centre_rows = None


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

        wanted = requested_backend() in ("auto", "cpu")
        _centre_rows = cpu_ext().centered_embedding if wanted and _ops.cpu_fast_available() else False
    if _centre_rows and table.is_cpu and table.dtype in _CENTRE_DTYPES and ids.dtype == torch.long:
        return _centre_rows(table.contiguous(), ids)
    return None


def _auto_impl(x, weight, residual):
    """The measured choice for this call. Memoised per (device, dtype, width, few rows, γ dtype);
    the gradient question (a few µs of attribute reads) is asked only where the choice with and
    without gradient differ."""
    h = x.shape[-1]
    key = (x.device, x.dtype, h, x.numel() <= 16 * h, None if weight is None else weight.dtype)
    impl = _autotune.chosen.get(key)
    if impl is None:
        impl = _autotune.chosen[key] = _choose(x, weight, h)
    if impl.__class__ is tuple:  # (without gradient, with gradient)
        grad = torch.is_grad_enabled() and (
            x.requires_grad
            or (weight is not None and weight.requires_grad)
            or (residual is not None and residual.requires_grad)
        )
        impl = impl[grad]
    return impl


def _choose(x, weight, h):
    picks = []
    for grad in (False, True):
        pick = "composite"
        for name in _autotune.ranking(x.device, x.dtype, h, x.numel() // max(1, h), grad):
            # native F.rms_norm takes a slow path, and rounds γ, when γ's dtype differs from x's
            if name == "native" and weight is not None and weight.dtype != x.dtype:
                continue
            pick = name
            break
        picks.append(pick)
    return picks[0] if picks[0] == picks[1] else tuple(picks)


def _direct_cpu(key, x, weight):
    """The C++ extension when `auto` runs normswap's CPU kernel for this kind of call with and
    without gradient (so the call can skip every Python-side step), else False. Memoised."""
    direct = False
    if x.dtype in CPU_DTYPES and _choose(x, weight, key[1]) == "cpu":
        direct = cpu_ext()
    _autotune.direct[key] = direct
    return direct


def _add_bias(out, bias, residual):
    # β in the output's dtype: a float32 bias must not promote a bf16 activation
    if residual is None:
        return out + bias.to(out.dtype)
    return out[0] + bias.to(out[0].dtype), out[1]


def rms_norm(x, weight=None, eps=1e-5, residual=None, *, bias=None, backend=None):
    """RMSNorm over the last dimension of x (+ bias), optionally fused with a residual add.

    Returns y, or (y, x + residual) when residual is given. Differentiable in x, weight, bias and
    residual. `backend` overrides NORMSWAP_KERNEL for this call.
    """
    if backend is None and not _is_compiling() and x.is_cpu and requested_backend() == "auto":
        h = x.shape[-1] if x.dim() else 0
        key = (x.dtype, h, x.numel() <= 16 * h, None if weight is None else weight.dtype)
        ext = _autotune.direct.get(key)
        if ext is None:
            ext = _direct_cpu(key, x, weight) if x.dim() else False
        if ext and (residual is None or residual.dtype == x.dtype):
            if residual is None:
                return ext.norm(x, weight, bias, eps)
            return ext.add_norm(x, residual, weight, bias, eps)
    backend = requested_backend() if backend is None else backend
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
    if backend == "auto":
        if x.dtype == torch.float64 or _is_compiling():
            # float64 is for verification (convert checks its algebra to ~1e-15; the kernels
            # compute in float32); under torch.compile Inductor fuses the plain formula itself
            backend = "torch"
        else:
            backend = _auto_impl(x, weight, residual)
    elif backend not in BACKENDS:
        raise NormswapError(f"unknown RMSNorm backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "torch" or x.dtype == torch.float64:
        from normswap.kernels.reference import rms_norm_reference

        out = rms_norm_reference(x, weight, eps, residual)
    else:
        out = call_impl(backend, x, weight, residual, eps)
    return out if bias is None else _add_bias(out, bias, residual)


def backend_for(device, dtype=torch.float32, hidden: int = 768, rows: int = 1024, grad: bool = False) -> str:
    """The implementation `auto` runs on a device for calls of this kind (measured on first use)."""
    from normswap.kernels import _ops, autotune

    backend = requested_backend()
    if backend != "auto":
        return _ops.resolve(backend, torch.device(device)) if backend not in ("torch", "native") else backend
    return autotune.ranking(torch.device(device), dtype, hidden, rows, grad)[0]


__all__ = [
    "rms_norm",
    "centered_rows",
    "requested_backend",
    "reread_requested_backend",
    "backend_for",
    "call_impl",
    "BACKENDS",
]
