"""The RMSNorm module that convert puts where each LayerNorm was.

Parameter names (`weight`, `bias`) match nn.LayerNorm's so that a converted checkpoint keeps the
source's state-dict keys; `weight` is None when γ was folded into the readers (it is then 1),
`bias` is None unless β was kept on the norm.
"""

from __future__ import annotations

import torch
from torch import nn

from normswap.kernels import rms_norm

_is_compiling = torch.compiler.is_compiling
_is_exporting = torch.compiler.is_exporting


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, elementwise_affine=True, bias=False, device=None, dtype=None):
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        factory = {"device": device, "dtype": dtype}
        # registered even when absent (None), as nn.LayerNorm does, so forward finds both in
        # _parameters
        self.register_parameter(
            "weight", nn.Parameter(torch.ones(self.hidden_size, **factory)) if elementwise_affine else None
        )
        self.register_parameter("bias", nn.Parameter(torch.zeros(self.hidden_size, **factory)) if bias else None)

    def forward(self, x, residual=None):
        """y = RMSNorm(x) (+ bias); with `residual`, returns (RMSNorm(x + residual), x + residual)."""
        # `self.weight` on a module is a Python-level __getattr__ (~2.5 µs a parameter measured
        # here, a quarter of a decode-sized norm's cost); the dict behind it is read directly.
        # A parametrized or otherwise replaced attribute, or Dynamo, takes the ordinary lookup.
        params = self._parameters
        if "weight" in params and "bias" in params and not _is_compiling():
            weight, bias = params["weight"], params["bias"]
        else:
            # torch.onnx.export traces through torch.export (is_compiling and is_exporting are true):
            # asked only here, so eager calls pay nothing for it (is_in_onnx_export costs microseconds)
            if _is_exporting() and torch.onnx.is_in_onnx_export():
                return self._onnx_forward(x, residual)
            weight, bias = self.weight, self.bias
        # one call: on CPU the bias is added inside the C++ kernel (normswap.kernels, per-call cost)
        return rms_norm(x, weight, self.eps, residual, bias=bias)

    def _onnx_forward(self, x, residual):
        """What `torch.onnx.export` traces: torch's own rms_norm, which its exporter writes as one ONNX
        RMSNormalization node (opset 23), instead of the custom kernel's internals."""
        if residual is not None:
            x = x + residual
        # γ folded away: a constant scale of ones (RMSNormalization's scale input is required; the
        # exporter would otherwise compute one from x's shape in every run of the graph)
        weight = (
            self.weight if self.weight is not None else torch.ones(self.hidden_size, dtype=x.dtype, device=x.device)
        )
        y = torch.nn.functional.rms_norm(x, (self.hidden_size,), weight, self.eps)
        if self.bias is not None:
            y = y + self.bias
        return (y, x) if residual is not None else y

    def extra_repr(self):
        return f"{self.hidden_size}, eps={self.eps}, weight={self.weight is not None}, bias={self.bias is not None}"
