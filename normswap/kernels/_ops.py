"""torch.library custom ops wrapping the RMSNorm backends, with fake impls and autograd.

Registering the kernels as opaque custom ops is what lets torch.compile trace a model that uses
them (Dynamo never looks inside, the fake impls give it shapes) and what puts our hand-written
backward, not an autograd trace of the forward, on the tape.

The backend is resolved when the op *executes*, not when it is traced, so a compiled graph does
not bake in the CPU extension's build state, and `auto` can ask `cpu.available()` (which may
build lazily) outside of Dynamo.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

# module-level so tests can lower it and exercise the looped (wide-row) Triton kernels on
# small inputs; None means the kernel module's default
TRITON_MAX_FUSED_N: Optional[int] = None

_cpu_ok: Optional[bool] = None


def cpu_fast_available() -> bool:
    """Whether the compiled CPU fast path (normswap.kernels.cpu, built by the CPU work) loads."""
    global _cpu_ok
    if _cpu_ok:
        return True
    try:
        from normswap.kernels import cpu  # noqa: PLC0415  (may not exist in every build)
    except ImportError:
        _cpu_ok = False
        return False
    try:
        _cpu_ok = bool(cpu.available())
    except Exception:  # the contract says it never raises; be safe anyway
        _cpu_ok = False
    return _cpu_ok


def resolve(backend: str, device: torch.device) -> str:
    """Concrete implementation for a requested backend: 'triton', 'cpu' or 'composite'."""
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if _triton_importable() else "composite"
        if device.type == "cpu" and cpu_fast_available():
            return "cpu"
        return "composite"
    if backend == "cpu" and not cpu_fast_available():
        from normswap.errors import NormswapError

        raise NormswapError("NORMSWAP_KERNEL=cpu but the compiled CPU kernel is not available (needs a C++ compiler and ninja)")
    return backend


_triton_state: Optional[bool] = None


def _triton_importable() -> bool:
    global _triton_state
    if _triton_state is None:
        try:
            import triton  # noqa: F401

            _triton_state = True
        except ImportError:
            _triton_state = False
    return _triton_state


def _module(impl: str):
    if impl == "triton":
        from normswap.kernels import triton_kernels as m
    elif impl == "cpu":
        from normswap.kernels import cpu as m
    else:
        from normswap.kernels import reference as m
    return m


def _rows(t: Tensor, h: int, contiguous: bool) -> Tensor:
    t2 = t.reshape(-1, h)
    if contiguous or t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


@torch.library.custom_op("normswap::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Optional[Tensor], residual: Optional[Tensor], eps: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(y like x, rstd fp32 [*x.shape[:-1]], x + residual or an empty tensor)."""
    impl = resolve(backend, x.device)
    h = x.shape[-1]
    need_contig = impl == "cpu"  # the C++ contract takes contiguous rows; Triton takes row strides
    x2 = _rows(x, h, need_contig)
    r2 = _rows(residual.to(x.dtype), h, need_contig) if residual is not None else None
    w = weight.contiguous() if weight is not None else None
    m = _module(impl)
    if impl == "triton" and TRITON_MAX_FUSED_N is not None:
        y, rstd, summed = m.forward(x2, w, r2, eps, max_fused_n=TRITON_MAX_FUSED_N)
    else:
        y, rstd, summed = m.forward(x2, w, r2, eps)
    y = y.reshape(x.shape)
    rstd = rstd.reshape(x.shape[:-1])
    summed = summed.reshape(x.shape) if summed is not None else x.new_empty((0,))
    return y, rstd, summed


@rms_norm_fwd.register_fake
def _(x, weight, residual, eps, backend):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x.new_empty((0,))
    return y, rstd, summed


@torch.library.custom_op("normswap::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, xin: Tensor, rstd: Tensor, weight: Optional[Tensor], backend: str) -> tuple[Tensor, Tensor]:
    """(dx like xin, dweight in weight's dtype or an empty tensor)."""
    impl = resolve(backend, xin.device)
    h = xin.shape[-1]
    need_contig = impl == "cpu"
    dy2 = _rows(dy.to(xin.dtype), h, need_contig)
    x2 = _rows(xin, h, need_contig)
    r = rstd.reshape(-1).contiguous()
    w = weight.contiguous() if weight is not None else None
    m = _module(impl)
    if impl == "triton" and TRITON_MAX_FUSED_N is not None:
        dx, dw = m.backward(dy2, x2, r, w, max_fused_n=TRITON_MAX_FUSED_N)
    else:
        dx, dw = m.backward(dy2, x2, r, w)
    dx = dx.reshape(xin.shape)
    dw = dw.to(weight.dtype) if weight is not None else xin.new_empty((0,))
    return dx, dw


@rms_norm_bwd.register_fake
def _(dy, xin, rstd, weight, backend):
    dx = torch.empty_like(xin, memory_format=torch.contiguous_format)
    dw = torch.empty_like(weight) if weight is not None else xin.new_empty((0,))
    return dx, dw


def _setup_context(ctx, inputs, output):
    x, weight, residual, eps, backend = inputs
    _, rstd, summed = output
    ctx.has_residual = residual is not None
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.backend = backend
    ctx.save_for_backward(summed if residual is not None else x, rstd, weight)


def _backward(ctx, dy, drstd, dsummed):
    xin, rstd, weight = ctx.saved_tensors
    dx, dw = torch.ops.normswap.rms_norm_bwd(dy, xin, rstd, weight, ctx.backend)
    if ctx.has_residual and dsummed is not None and dsummed.numel():
        dx = dx + dsummed  # the summed stream feeds the next block: its gradient flows to x and r
    dres = dx.to(ctx.residual_dtype) if ctx.has_residual else None
    dweight = dw if weight is not None else None
    return dx, dweight, dres, None, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
