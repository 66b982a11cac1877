"""RMSNorm kernels behind one function.

    rms_norm(x, weight=None, eps=1e-5, residual=None, *, bias=None) -> y  |  (y, x + residual)
    bind(x, weight, bias, residual=None) -> Bound(name, fn)  (the decision, made once per kind of call)

Every implementation is one record of one table (normswap.kernels.implementations: ``cpu``, normswap's
compiled C++ kernel; ``triton``, its Triton kernels; ``native``, torch's own ``F.rms_norm``;
``composite``, the formula with a hand-written backward; ``torch``, the formula differentiated by
autograd), and one module decides which record a kind of call runs (normswap.kernels.choose: the
setting NORMSWAP_KERNEL, ``auto``'s measured ranking from normswap.kernels.autotune, the compile
rule). Nothing else in normswap reads the setting or compares implementation names.

Dtype rule (all implementations, also under autocast): statistics and the normalise-and-scale run in
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

import torch

from normswap.kernels import choose as _choose
from normswap.kernels.choose import Bound, CallKind, backend_for, bind, call_kind, describe
from normswap.kernels.implementations import FEW_ROWS, checked_call, cpu_ext, cpu_ready

_is_compiling = torch.compiler.is_compiling


def requested_backend() -> str:
    """The implementation NORMSWAP_KERNEL asks for (``auto`` when unset)."""
    return _choose.setting()


# the compiled centred lookup, or False where it is not used; decided on the first call
_centre_rows = None
_CENTRE_DTYPES = (torch.float32, torch.float64)


def centered_rows(table, ids):
    """Rows of a [V, H] ``table`` looked up by int64 ``ids``, each minus its mean, computed without
    gradient in one compiled call (csrc: ``centered_embedding``) — a converted model's tied token
    table per decoded token. None where that call does not apply (not CPU, another dtype, the
    compiled kernel unavailable or NORMSWAP_KERNEL asking for another implementation on CPU tensors):
    the caller then computes the formula itself."""
    global _centre_rows
    if _centre_rows is None:
        wanted = _choose.setting_on("cpu") in (_choose.AUTO, "cpu")
        _centre_rows = cpu_ext().centered_embedding if wanted and cpu_ready() else False
        _choose.binders.add(_CentreRows)  # a new setting decides again
    if _centre_rows and table.is_cpu and table.dtype in _CENTRE_DTYPES and ids.dtype == torch.long:
        return _centre_rows(table.contiguous(), ids)
    return None


class _CentreRows:
    """The centred lookup's decision, dropped with every other one."""

    @staticmethod
    def unbind():
        global _centre_rows
        _centre_rows = None


def rms_norm(x, weight=None, eps=1e-5, residual=None, *, bias=None, backend=None):
    """RMSNorm over the last dimension of x (+ bias), optionally fused with a residual add.

    Returns y, or (y, x + residual) when residual is given. Differentiable in x, weight, bias and
    residual. ``backend`` names the implementation for this call (it raises if that one cannot run
    it). The general entry point: every call's shapes are checked; the converted module's own calls
    take :func:`bind`'s function instead.
    """
    if backend is None and not _is_compiling() and x.dim():
        impl = _choose.decide_call(call_kind(x, weight, bias, residual), x, weight, bias, residual)
    else:
        rows = x.numel() // max(1, x.shape[-1] if x.dim() else 1)
        impl = _choose.decide(call_kind(x, weight, bias, residual), backend, rows)
    return checked_call(impl, x, weight, bias, residual, eps)


__all__ = [
    "rms_norm",
    "bind",
    "CallKind",
    "call_kind",
    "describe",
    "Bound",
    "FEW_ROWS",
    "centered_rows",
    "requested_backend",
    "backend_for",
]
