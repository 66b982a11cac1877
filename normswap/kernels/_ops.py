"""torch.library custom ops wrapping the RMSNorm backends, with fake impls and autograd.

Registering the kernels as opaque custom ops is what lets torch.compile trace a model that uses
them (Dynamo never looks inside, the fake impls give it shapes) and what puts our hand-written
backward, not an autograd trace of the forward, on the tape.

The op takes the name of the record it runs (normswap.kernels.implementations: ``triton``, ``cpu`` or
``composite``; normswap.kernels.choose decided which); its kernels are looked up when the op
*executes*, not when it is traced.
"""

from __future__ import annotations

import torch
from torch import Tensor

# module-level so tests can lower it and exercise the looped (wide-row) Triton kernels on
# small inputs; None means the kernel module's default
TRITON_MAX_FUSED_N: int | None = None


def _module(impl: str):
    """The kernels (forward, backward on 2-D rows) behind a record the op runs."""
    if impl == "triton":
        from normswap.kernels import triton_kernels as m
    elif impl == "cpu":
        from normswap.kernels import cpu as m
    else:
        from normswap.kernels import reference as m
    return m


def _rows(t: Tensor, h: int, contiguous: bool) -> Tensor:
    # fast path first: eager calls on small inputs are dominated by these Python-level checks
    t2 = t if t.dim() == 2 else t.reshape(-1, h)
    if t2.stride(-1) != 1 or (contiguous and not t2.is_contiguous()):
        t2 = t2.contiguous()
    return t2


def forward_impl(x: Tensor, weight: Tensor | None, residual: Tensor | None, eps: float, backend: str):
    """(y like x, rstd fp32 [*x.shape[:-1]], x + residual or None)."""
    impl = backend
    h = x.shape[-1]
    need_contig = impl == "cpu"  # the C++ contract takes contiguous rows; Triton takes row strides
    x2 = _rows(x, h, need_contig)
    r2 = (
        _rows(residual if residual.dtype == x.dtype else residual.to(x.dtype), h, need_contig)
        if residual is not None
        else None
    )
    w = weight if weight is None or weight.is_contiguous() else weight.contiguous()
    m = _module(impl)
    if impl == "triton" and TRITON_MAX_FUSED_N is not None:
        y, rstd, summed = m.forward(x2, w, r2, eps, max_fused_n=TRITON_MAX_FUSED_N)
    else:
        y, rstd, summed = m.forward(x2, w, r2, eps)
    if x.dim() != 2:
        y = y.reshape(x.shape)
        rstd = rstd.reshape(x.shape[:-1])
        summed = summed.reshape(x.shape) if summed is not None else None
    return y, rstd, summed


@torch.library.custom_op("normswap::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: Tensor, weight: Tensor | None, residual: Tensor | None, eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    """(y like x, rstd fp32 [*x.shape[:-1]], x + residual or an empty tensor)."""
    y, rstd, summed = forward_impl(x, weight, residual, eps, backend)
    # a custom op cannot return None, and must not return an alias of an input
    return y, rstd, (summed if summed is not None else x.new_empty((0,)))


@rms_norm_fwd.register_fake
def _(x, weight, residual, eps, backend):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x.new_empty((0,))
    return y, rstd, summed


def backward_impl(dy: Tensor, xin: Tensor, rstd: Tensor, weight: Tensor | None, backend: str):
    """(dx like xin, dweight in weight's dtype or an empty tensor)."""
    impl = backend
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


@torch.library.custom_op("normswap::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, xin: Tensor, rstd: Tensor, weight: Tensor | None, backend: str) -> tuple[Tensor, Tensor]:
    """(dx like xin, dweight in weight's dtype or an empty tensor)."""
    return backward_impl(dy, xin, rstd, weight, backend)


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


def _backward(ctx, dy, drstd, dsummed, bwd=None):
    xin, rstd, weight = ctx.saved_tensors
    if dy is None:  # only the summed stream was used downstream
        dy = torch.zeros_like(xin)
    dx, dw = (bwd or torch.ops.normswap.rms_norm_bwd)(dy, xin, rstd, weight, ctx.backend)
    if ctx.has_residual and dsummed is not None:
        dx = dx + dsummed  # the summed stream feeds the next block: its gradient flows to x and r
    # x and r get the same gradient tensor, as they would from PyTorch's own `x + r`
    dres = dx.to(ctx.residual_dtype) if ctx.has_residual else None
    dweight = dw if weight is not None else None
    return dx, dweight, dres, None, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerRMSNorm(torch.autograd.Function):
    """The same forward/backward as the custom op, without the custom-op dispatch machinery
    (~100 µs a call in eager mode, which would dominate small and decode-sized inputs)."""

    # forward(ctx, ...) rather than a separate setup_context: with setup_context, apply() binds
    # arguments through inspect.signature on every call, which costs more than a small kernel
    @staticmethod
    def forward(ctx, x, weight, residual, eps, backend):
        output = forward_impl(x, weight, residual, eps, backend)
        _setup_context(ctx, (x, weight, residual, eps, backend), output)
        ctx.mark_non_differentiable(output[1])
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' backward is not itself differentiable
    def backward(ctx, dy, drstd, dsummed):
        return _backward(ctx, dy, drstd, dsummed, bwd=backward_impl)


def apply(x, weight, residual, eps: float, backend: str):
    """(y, rstd, summed-or-empty) through the cheapest path that is still correct here:
    the custom op while torch.compile traces (a backend named explicitly stays one opaque op),
    the autograd.Function in eager mode, and the bare forward when nothing needs a gradient."""
    if torch.compiler.is_compiling():
        return torch.ops.normswap.rms_norm_fwd(x, weight, residual, eps, backend)
    if torch.is_grad_enabled() and (
        x.requires_grad
        or (weight is not None and weight.requires_grad)
        or (residual is not None and residual.requires_grad)
    ):
        return _EagerRMSNorm.apply(x, weight, residual, eps, backend)
    return forward_impl(x, weight, residual, eps, backend)
