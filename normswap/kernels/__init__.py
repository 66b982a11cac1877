"""RMSNorm kernels. PLACEHOLDER (owned by the kernels work): plain torch reference for now."""

from __future__ import annotations

import torch


def rms_norm(x, weight=None, eps=1e-5, residual=None):
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(x.dtype)
    if weight is not None:
        y = y * weight
    return (y, x) if residual is not None else y
