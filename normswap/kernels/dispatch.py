"""Run one RMSNorm implementation by name (API convention), below both the public `rms_norm`
and the autotuner that times the implementations against each other."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from normswap.errors import NormswapError

_is_compiling = torch.compiler.is_compiling


def call_impl(impl, x, weight, residual, eps):
    """One implementation by name, API convention (y or (y, summed)); inputs already validated."""
    if impl == "cpu" and x.dtype in CPU_DTYPES and not _is_compiling():  # Dynamo cannot trace pybind
        ext = cpu_ext()
        return ext.norm(x, weight, None, eps) if residual is None else ext.add_norm(x, residual, weight, None, eps)
    if impl == "native":
        if residual is not None:
            s = x + residual
            return F.rms_norm(s, (s.shape[-1],), weight, eps), s
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    from normswap.kernels import _ops  # registers torch.ops.normswap.* on first use

    y, _, summed = _ops.apply(x, weight, residual, float(eps), impl)
    return (y, summed) if residual is not None else y


CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ext = None


def cpu_ext():
    global _ext
    if _ext is None:
        from normswap.kernels import _ops

        if not _ops.cpu_fast_available():
            raise NormswapError("the compiled CPU kernel is not available (needs a C++ compiler and ninja)")
        _ext = _ops.cpu_extension()
    return _ext
