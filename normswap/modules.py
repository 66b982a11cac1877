"""The RMSNorm module that convert puts where each LayerNorm was.

Parameter names (`weight`, `bias`) match nn.LayerNorm's so that a converted checkpoint keeps the
source's state-dict keys; `weight` is None when γ was folded into the readers (it is then 1),
`bias` is None unless β was kept on the norm.
"""

from __future__ import annotations

import torch
from torch import nn

from normswap.kernels import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, elementwise_affine=True, bias=False, device=None, dtype=None):
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(self.hidden_size, **factory)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(self.hidden_size, **factory)) if bias else None

    def forward(self, x, residual=None):
        """y = RMSNorm(x) (+ bias); with `residual`, returns (RMSNorm(x + residual), x + residual)."""
        # one call: on CPU the bias is added inside the C++ function (normswap.kernels, per-call cost)
        return rms_norm(x, self.weight, self.eps, residual, bias=self.bias)

    def extra_repr(self):
        return f"{self.hidden_size}, eps={self.eps}, weight={self.weight is not None}, bias={self.bias is not None}"
