"""Low-precision checks of the two norms themselves, against a float64 reference.

The comparison protocol's table: rows that are constant (σ = 0: LayerNorm divides ~0 by √ε), of
magnitude 1e-6 and 1e4, far from centred (mean 1e3 ≫ σ: LayerNorm's x − μ cancels, RMSNorm's
divisor keeps μ², the "RMS ≥ σ" argument) and ordinary N(0, 1), in bf16 and fp16, at several
widths. For each, LayerNorm (PyTorch's ``F.layer_norm``), RMSNorm (PyTorch's ``F.rms_norm``) and
normswap's RMSNorm (``normswap.kernels.rms_norm``) run forward and backward in the low dtype; the
same input (as rounded to that dtype), γ and upstream gradient run through the float64 formula.

Error unit: the dtype's machine epsilon relative to the reference's largest magnitude,
``max|y − y_ref| / (max|y_ref| · eps_dtype)`` — about 1 is as good as the format allows; a
non-finite result is ``inf``. One number per output: y, dL/dx, dL/dγ.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from normswap.errors import first_line

CASES = {
    "normal": lambda g, r, w: torch.randn(r, w, generator=g, dtype=torch.float64),
    "constant": lambda g, r, w: torch.full((r, w), 3.0, dtype=torch.float64),
    "tiny 1e-6": lambda g, r, w: torch.randn(r, w, generator=g, dtype=torch.float64) * 1e-6,
    "huge 1e4": lambda g, r, w: torch.randn(r, w, generator=g, dtype=torch.float64) * 1e4,
    "offset mean 1e3": lambda g, r, w: torch.randn(r, w, generator=g, dtype=torch.float64) + 1e3,
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
WIDTHS = (64, 768, 4096)
ROWS = 8
EPS = 1e-5


def _ln(x, w, eps):
    return F.layer_norm(x, (x.shape[-1],), w, None, eps)


def _rms_torch(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _rms_normswap(x, w, eps):
    from normswap.kernels import rms_norm

    return rms_norm(x, w, eps)


def _ref_ln(x, w, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w


def _ref_rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


IMPLS = {  # name -> (norm, its float64 reference)
    "LayerNorm (torch)": (_ln, _ref_ln),
    "RMSNorm (torch)": (_rms_torch, _ref_rms),
    "RMSNorm (normswap)": (_rms_normswap, _ref_rms),
}


def _err(y, ref, eps_dtype) -> float:
    y = y.double()
    if not torch.isfinite(y).all():
        return math.inf
    scale = float(ref.abs().max())
    diff = float((y - ref).abs().max())
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / (scale * eps_dtype)


def _run(fn, x, w, dy):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = fn(x, w, EPS)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def check_case(case: str, dtype_name: str, width: int, impl: str, device="cpu") -> dict:
    g = torch.Generator().manual_seed(width)
    dtype = DTYPES[dtype_name]
    x = CASES[case](g, ROWS, width).to(dtype)
    w = (1 + 0.1 * torch.randn(width, generator=g, dtype=torch.float64)).to(dtype)
    dy = torch.randn(ROWS, width, generator=g, dtype=torch.float64).to(dtype)
    fn, ref_fn = IMPLS[impl]
    row = {"case": case, "dtype": dtype_name, "width": width, "impl": impl}
    try:
        y, dx, dw = _run(fn, x.to(device), w.to(device), dy.to(device))
    except (RuntimeError, NotImplementedError) as e:
        return dict(row, error=first_line(e, 200))
    ry, rdx, rdw = _run(ref_fn, x.double(), w.double(), dy.double())
    e = torch.finfo(dtype).eps
    return dict(row, forward=_err(y.cpu(), ry, e), grad_x=_err(dx.cpu(), rdx, e), grad_weight=_err(dw.cpu(), rdw, e))


def precision_table(device="cpu") -> list[dict]:
    """Every (case, dtype, width, implementation): the errors of y, dx and dγ in units of the dtype's ε."""
    return [dict(r) for r in _table(str(device))]


@functools.cache
def _table(device: str) -> tuple:
    # deterministic for a device (fixed inputs, same kernels): computed once per process
    return tuple(check_case(c, d, w, i, device) for c in CASES for d in DTYPES for w in WIDTHS for i in IMPLS)


def worst(row: dict) -> float:
    vals = [row.get(k) for k in ("forward", "grad_x", "grad_weight")]
    return math.inf if "error" in row or any(v is None for v in vals) else max(vals)


def compare(rows: list[dict], *, factor: float = 2.0) -> dict:
    """Where RMSNorm (torch) and LayerNorm (torch) differ by more than ``factor`` in their worst error."""
    by = {(r["case"], r["dtype"], r["width"], r["impl"]): r for r in rows}
    better, worse, same = [], [], []
    for (case, dt, w, impl), ln in by.items():
        if impl != "LayerNorm (torch)":
            continue
        rms = by.get((case, dt, w, "RMSNorm (torch)"))
        if rms is None:
            continue
        a, b = worst(rms), worst(ln)
        key = f"{case} / {dt} / {w}"
        if (math.isfinite(b) and not math.isfinite(a)) or (
            math.isfinite(a) and math.isfinite(b) and a > factor * max(b, 1e-12) and a > 1
        ):
            worse.append(key)
        elif (math.isfinite(a) and not math.isfinite(b)) or (
            math.isfinite(a) and math.isfinite(b) and b > factor * max(a, 1e-12) and b > 1
        ):
            better.append(key)
        else:
            same.append(key)
    return {"factor": factor, "rms_better": better, "rms_worse": worse, "similar": len(same)}
