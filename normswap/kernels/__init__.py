"""RMSNorm kernels behind one function.

    rms_norm(x, weight=None, eps=1e-5, residual=None) -> y  |  (y, x + residual)

Backends, chosen per call by the environment variable NORMSWAP_KERNEL:
- ``auto`` (default): Triton on CUDA; on CPU the compiled C++ kernel (normswap.kernels.cpu) when it
  builds/loads, else a fast pure-PyTorch composite with a hand-written backward.
- ``triton``: the Triton kernels (on CPU tensors only with TRITON_INTERPRET=1, for tests).
- ``torch``: a plain PyTorch composite differentiated by autograd (the reference).
- ``cpu`` / ``composite``: force one CPU implementation (benchmarks and tests).

Dtype rule (all backends, also under autocast): statistics and the normalise-and-scale run in
float32 and the result is rounded once to x's dtype; the weight is used at its own precision and
its gradient comes back in its dtype; with a residual, the sum follows PyTorch's type promotion
exactly as `x + residual` would (bf16 + fp32 -> fp32), is rounded to that dtype, and is both
normalised and returned; y then has the sum's dtype. Autocast does not change any of this: like HF's
LlamaRMSNorm, the norm returns the dtype it was given.
"""

from __future__ import annotations

import os

import torch

from normswap.errors import NormswapError

BACKENDS = ("auto", "triton", "torch", "cpu", "composite")


def requested_backend() -> str:
    value = os.environ.get("NORMSWAP_KERNEL", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise NormswapError(f"NORMSWAP_KERNEL={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def rms_norm(x, weight=None, eps=1e-5, residual=None, *, backend=None):
    """RMSNorm over the last dimension of x, optionally fused with a residual add.

    Returns y, or (y, x + residual) when residual is given. Differentiable in x, weight and
    residual. `backend` overrides NORMSWAP_KERNEL for this call.
    """
    backend = requested_backend() if backend is None else backend
    h = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (h,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({h},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    if residual is not None and residual.dtype != x.dtype:
        # promote like `x + residual` (differentiably, so each gradient returns in its own dtype)
        dt = torch.result_type(x, residual)
        x, residual = x.to(dt), residual.to(dt)
    if x.dtype == torch.float64:
        # float64 is for verification and analysis (convert checks its algebra to ~1e-15 there);
        # every fused backend computes in float32, so stay in float64 with plain ops.
        if residual is not None:
            x = x + residual
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = y * weight.to(y.dtype)
        return (y, x) if residual is not None else y
    if backend == "torch":
        from normswap.kernels.reference import rms_norm_reference

        return rms_norm_reference(x, weight, eps, residual)
    if backend not in BACKENDS:
        raise NormswapError(f"unknown RMSNorm backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    from normswap.kernels import _ops  # registers torch.ops.normswap.* on first use

    y, _, summed = _ops.apply(x, weight, residual, float(eps), backend)
    return (y, summed) if residual is not None else y


def backend_for(device) -> str:
    """The implementation `auto` picks on a device: 'triton', 'cpu' or 'composite'."""
    import torch

    from normswap.kernels import _ops

    return _ops.resolve(requested_backend(), torch.device(device))


__all__ = ["rms_norm", "requested_backend", "backend_for", "BACKENDS"]
