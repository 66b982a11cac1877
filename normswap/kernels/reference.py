"""The RMSNorm formula in plain PyTorch, written once, and the composite backend built on it.

Numerics contract shared by every backend (documented in docs and checked by the tests):
statistics and the whole normalise-and-scale computation run in float32 (float64 for float64
input), and the result is rounded once, to the input's dtype (like PyTorch's fused LayerNorm,
which is what convert replaces). The weight takes part at its own precision (upcast), so fp32
master weights under bf16 autocast are not rounded to bf16 before use. A residual is added as the
model would add it (`x + residual`, PyTorch promotion; the API promotes both before calling a
backend), and that sum is what gets normalised and returned.

`normalize` is that formula. It is differentiable by autograd, and it is what runs where no
kernel should: the `NORMSWAP_KERNEL=torch` backend, float64 verification, dtypes a kernel does
not cover, and torch.compile (Inductor sees plain ops and fuses the residual add, the norm and
their neighbours into one loop).
"""

from __future__ import annotations

import torch


def normalize(x, weight=None, eps=1e-5, residual=None):
    """(y, rstd, summed): y = x̂·w rounded once to x's dtype, rstd = 1/sqrt(mean(x²) + eps) in the
    accumulation dtype with x's leading shape, summed = x + residual (None without residual)."""
    summed = None
    if residual is not None:
        summed = x + residual
        x = summed
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf * rstd
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(x.dtype), rstd.squeeze(-1), summed


def rms_norm_reference(x, weight=None, eps=1e-5, residual=None):
    """The API's return convention over `normalize`: y, or (y, x + residual)."""
    y, _, summed = normalize(x, weight, eps, residual)
    return (y, summed) if residual is not None else y


# ---------------------------------------------------------------------------------------------
# Composite backend: same calling convention as the kernels (2-D rows, explicit backward).
# ---------------------------------------------------------------------------------------------


def forward(x, weight, residual, eps):
    """x [N, H] -> (y [N, H] in x.dtype, rstd fp32 [N], x + residual or None), no autograd."""
    with torch.no_grad():
        y, rstd, summed = normalize(x, weight, eps, residual.to(x.dtype) if residual is not None else None)
    return y, rstd.float(), summed


def backward(dy, xin, rstd, weight):
    """Gradients of y = x·rstd·w: (dx [N, H] in xin.dtype, dw [H] in the accumulation dtype or None).

    dx = rstd · (g − x̂ · mean(g·x̂)), g = dy·w, x̂ = x·rstd; dw = Σ_rows dy·x̂.
    """
    acc = torch.float64 if xin.dtype == torch.float64 else torch.float32
    h = xin.shape[-1]
    r = rstd.to(acc).unsqueeze(-1)
    xhat = xin.to(acc) * r
    dyf = dy.to(acc)
    dw = (dyf * xhat).sum(0) if weight is not None else None
    g = dyf * weight.to(acc) if weight is not None else dyf
    c = (g * xhat).sum(-1, keepdim=True).div_(h)
    dx = (g - xhat * c).mul_(r)
    return dx.to(xin.dtype), dw
