"""Pure-PyTorch RMSNorm: the plain reference and the fastest composite we found for CPU.

Numerics contract shared by every backend (documented in docs and checked by the tests):
statistics and the whole normalise-and-scale computation run in float32, and the result is
rounded once, to the input's dtype (like PyTorch's fused LayerNorm, which is what convert
replaces). The weight takes part at its own precision (upcast to fp32), so fp32 master weights
under bf16 autocast are not rounded to bf16 before use. A residual is added as the model would
add it (`x + residual`, PyTorch promotion; the API promotes both before calling a backend), and
that sum is what gets normalised and returned.
"""

from __future__ import annotations

import math

import torch


def rms_norm_reference(x, weight=None, eps=1e-5, residual=None):
    """Plain autograd composite: the `NORMSWAP_KERNEL=torch` backend and the tests' oracle shape."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    y = y.to(x.dtype)
    return (y, x) if residual is not None else y


# ---------------------------------------------------------------------------------------------
# Fast composite, same calling convention as the kernels (2-D contiguous, explicit backward).
# ---------------------------------------------------------------------------------------------


def forward(x, weight, residual, eps):
    """x [N, H] -> (y [N, H] in x.dtype, rstd fp32 [N], x + residual or None).

    rstd = 1/sqrt(mean(x²) + eps) is computed as sqrt(H) / sqrt(‖x‖² + H·eps): vector_norm is a
    single fused vectorised reduction on CPU, several times faster than pow+mean (see
    shared/reference/kernels.md).
    """
    summed = None
    if residual is not None:
        summed = x + residual.to(x.dtype)
        x = summed
    h = x.shape[-1]
    xf = x.float() if x.dtype != torch.float32 else x
    sq = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_()
    rstd = sq.add_(h * eps).rsqrt_().mul_(math.sqrt(h))
    y = xf * rstd
    if weight is not None:
        y.mul_(weight.float())
    return y.to(x.dtype), rstd.squeeze(-1), summed


def backward(dy, xin, rstd, weight):
    """Gradients of y = x·rstd·w: (dx [N, H] in xin.dtype, dw fp32 [H] or None).

    dx = rstd · (g − x̂ · mean(g·x̂)), g = dy·w, x̂ = x·rstd; dw = Σ_rows dy·x̂ (fp32).
    """
    h = xin.shape[-1]
    r = rstd.unsqueeze(-1)
    xhat = xin.float() * r
    dyf = dy.float()
    dw = (dyf * xhat).sum(0) if weight is not None else None
    g = dyf * weight.float() if weight is not None else dyf
    c = (g * xhat).sum(-1, keepdim=True).div_(h)
    dx = (g - xhat * c).mul_(r)
    return dx.to(xin.dtype), dw
