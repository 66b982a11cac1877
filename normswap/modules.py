"""The RMSNorm module that convert puts where each LayerNorm was.

Parameter names (`weight`, `bias`) match nn.LayerNorm's so that a converted checkpoint keeps the
source's state-dict keys; `weight` is None when γ was folded into the readers (it is then 1),
`bias` is None unless β was kept on the norm.

The eager call is the hot path (a decode step is a few microseconds of work per norm, so host-side
Python decides its cost): the module asks normswap.kernels.choose once per kind of call — dtype,
CUDA or not, few or many rows, gradient mode — and keeps the function it answers with; every later
call of that kind goes straight to it. `_apply` (``.to()``, ``.cuda()``, ``.half()``) and a changed
decision (normswap.kernels.choose.drop_decisions) drop what was kept.
"""

from __future__ import annotations

import torch
from torch import nn

from normswap.kernels import FEW_ROWS, bind, call_kind, describe, rms_norm
from normswap.kernels.choose import binders

_is_compiling = torch.compiler.is_compiling
_is_exporting = torch.compiler.is_exporting
_grad_enabled = torch.is_grad_enabled


def _empty_binds():
    # [is CUDA][gradient enabled][few rows] -> {dtype: fn}: list indexing by bool costs less than
    # building a tuple key for every call
    return [[[{}, {}], [{}, {}]], [[{}, {}], [{}, {}]]]


class RMSNorm(nn.Module):
    # a record of normswap.kernels' table this module always runs (None: what the chooser decides per
    # kind of call); the study sets it per arm (its --kernels choice)
    backend: str | None = None

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
        # kind of call in words -> the implementation it ran (eval's results.json records these);
        # kept when the decisions are dropped: it says what ran, not what will
        self.kernels_ran = {}
        self.unbind()

    def forward(self, x, residual=None):
        """y = RMSNorm(x) (+ bias); with `residual`, returns (RMSNorm(x + residual), x + residual)."""
        if residual is None and not _is_compiling():
            # `self.weight` on a module is a Python-level __getattr__ (~2.5 µs a parameter measured
            # here, a quarter of a decode-sized norm's cost); the dict behind it is read directly.
            # A parametrized or otherwise replaced attribute (FSDP's views) takes the ordinary lookup.
            params = self._parameters
            try:
                weight, bias = params["weight"], params["bias"]
            except KeyError:
                weight, bias = self.weight, self.bias
            fn = self._binds[x.is_cuda][_grad_enabled()][x.numel() <= self._few].get(x.dtype)
            if fn is None:
                fn = self._bind(x, weight, bias)
            return fn(x, weight, bias, self.eps)
        # torch.onnx.export traces through torch.export (is_compiling and is_exporting are true):
        # asked only here, so eager calls pay nothing for it (is_in_onnx_export costs microseconds)
        if _is_exporting() and torch.onnx.is_in_onnx_export():
            return self._onnx_forward(x, residual)
        return rms_norm(x, self.weight, self.eps, residual, bias=self.bias, backend=self.backend)

    def _bind(self, x, weight, bias):
        """Ask the chooser, once, what calls of x's kind run, keep the answer, and record it."""
        grad = _grad_enabled()  # decided per gradient mode, as the calls look it up
        kind = call_kind(x, weight, bias, grad=grad)
        bound = bind(x, weight, bias, backend=self.backend, grad=grad)
        self._binds[x.is_cuda][grad][x.numel() <= self._few][x.dtype] = bound.fn
        self.kernels_ran[describe(kind)] = bound.name
        binders.add(self)
        return bound.fn

    def unbind(self):
        """Forget the kept decisions: the next call of each kind decides again."""
        self._binds = _empty_binds()
        self._few = FEW_ROWS * self.hidden_size

    def __getstate__(self):
        # kept decisions are this process's (closures, a loaded extension): a copy decides again
        state = dict(super().__getstate__())
        state["_binds"], state["kernels_ran"] = _empty_binds(), {}
        return state

    def _apply(self, fn, recurse=True):
        # a new device or dtype for the parameters: decisions taken for the old ones no longer hold
        self.unbind()
        return super()._apply(fn, recurse)

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
