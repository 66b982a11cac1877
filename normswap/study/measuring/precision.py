"""Kernel accuracy: the norm kernels themselves in bf16 / fp16, against float64 — judged on the
information their output keeps, not on each function's own output scale.

This is a separate section of the study, never its stability verdict (stability.py judges that
from training runs). Inputs: rows that are constant (σ = 0), of magnitude 1e-6 and 1e4, far from
centred (mean 1e3 ≫ σ: LayerNorm's x − μ cancels in the low dtype, RMSNorm's divisor keeps μ² and
its output is ≈ γ·1 plus a tiny centred part) and ordinary N(0, 1), at several widths. The input
is rounded to the low dtype once; every reference is computed in float64 from that same rounded
input, so the rounding of the input is not counted against any kernel.

Per kernel (the one each arm actually runs, see ``kernels_for``) and case:

* ``forward`` / ``grad_x`` / ``grad_weight``: ‖y − y_exact‖ / ‖y_exact‖ in units of the dtype's ε
  (y_exact: the kernel's own function in float64 — LayerNorm's for the LayerNorm kernel); non-finite
  output is ``inf``;
* ``information_error``: how far the output, un-scaled by γ and standardised per row, is from the
  float64 LayerNorm of the same input (the centred, standardised input: the information a norm's
  reader can use), ‖ẑ − ln_exact‖ / ‖ln_exact‖ in ε — relative to the exact LayerNorm, for every
  kernel alike;
* ``correlation``: the mean over rows of the Pearson correlation of the output with that float64
  LayerNorm (1: the centred input kept; on rows of mean 1e3 and σ 10 RMSNorm's output is ≈ γ·1 and
  the centred part survives only in its last bits);

``compare`` says, per (case, dtype, width), where the RMSNorm kernel keeps less (or more) of the
centred input than the LayerNorm kernel, by more than ``factor`` in 1 − correlation.
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
    "offset mean 1e3": lambda g, r, w: torch.randn(r, w, generator=g, dtype=torch.float64) * 10 + 1e3,
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
WIDTHS = (64, 768, 4096)
ROWS = 8
EPS = 1e-5
FACTOR = 2.0  # a kernel keeps "less" when its 1 − correlation is more than this factor above the other's
FLOOR = 1e-4  # ... and above this (below it both keep the centred input to the format's precision)


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


LAYERNORM, RMSNORM_TORCH, RMSNORM_NORMSWAP = "LayerNorm (torch)", "RMSNorm (torch)", "RMSNorm (normswap)"
IMPLS = {  # name -> (kernel, its own function in float64)
    LAYERNORM: (_ln, _ref_ln),
    RMSNORM_TORCH: (_rms_torch, _ref_rms),
    RMSNORM_NORMSWAP: (_rms_normswap, _ref_rms),
}


def kernel_for_label(label: str | None, kind: str) -> str | None:
    """The table's kernel for a unit's ``norm_kernel`` label (kind ``layernorm`` / ``rmsnorm``): normswap's
    kernels are normswap's; every other RMSNorm (torch's op, composite, or torch.compile of the same formula)
    is judged as F.rms_norm."""
    if kind == "layernorm":
        return LAYERNORM
    if kind != "rmsnorm":
        return None
    return RMSNORM_NORMSWAP if label and "normswap" in label.lower() else RMSNORM_TORCH


def kernels_for(units: list[dict], kernels_option: str, arm_kinds: dict[str, str]) -> dict[str, str]:
    """arm -> the table's kernel it ran: from the units' ``norm_kernel`` label where recorded, else
    from ``--kernels`` (normswap: normswap's RMSNorm kernels; otherwise PyTorch's)."""
    out = {}
    for arm, kind in arm_kinds.items():
        label = next((u.get("norm_kernel") for u in units if u.get("arm") == arm and u.get("norm_kernel")), None)
        if label is None and kind == "rmsnorm":
            label = "normswap" if kernels_option == "normswap" else "torch"
        k = kernel_for_label(label, kind)
        if k is not None:
            out[arm] = k
    return out


def _rel_err(y, ref, eps_dtype) -> float:
    """‖y − ref‖ / ‖ref‖ in units of eps (a zero reference: the RMS error, a normalised output's scale being 1)."""
    y = y.double()
    if not torch.isfinite(y).all():
        return math.inf
    diff = float(torch.linalg.vector_norm(y - ref))
    scale = float(torch.linalg.vector_norm(ref))
    if scale == 0.0:
        scale = math.sqrt(ref.numel())
    return diff / (scale * eps_dtype)


def _standardise(z):
    z = z - z.mean(-1, keepdim=True)
    sd = torch.sqrt((z * z).mean(-1, keepdim=True))
    return z / sd


def _information(y, w, ln_exact, eps_dtype) -> dict:
    """How much of the centred, standardised input (``ln_exact``, float64 LayerNorm, γ = 1) the output keeps."""
    y = y.double()
    rows = [i for i in range(ln_exact.shape[0]) if float(ln_exact[i].abs().max()) > 0]
    if not torch.isfinite(y).all():
        return {"information_error": math.inf, "correlation": None}
    if not rows:  # constant rows: there is no centred input to keep
        return {"information_error": None, "correlation": None}
    z = y[rows] / w.double()
    ref = ln_exact[rows]
    corrs = []
    for zi, ri in zip(z, ref):
        zc = zi - zi.mean()
        den = float(torch.linalg.vector_norm(zc) * torch.linalg.vector_norm(ri))
        corrs.append(float((zc * ri).sum()) / den if den > 0 else 0.0)
    zs = _standardise(z)
    zs = torch.where(torch.isfinite(zs), zs, torch.zeros_like(zs))  # a row with no spread kept nothing
    return {
        "information_error": _rel_err(zs, ref, eps_dtype),
        "correlation": sum(corrs) / len(corrs),
    }


def _run(fn, x, w, dy):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = fn(x, w, EPS)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def check_case(case: str, dtype_name: str, width: int, impl: str, device="cpu") -> dict:
    g = torch.Generator().manual_seed(width)
    dtype = DTYPES[dtype_name]
    x = CASES[case](g, ROWS, width).to(dtype)  # the input as the kernel sees it
    w = (1 + 0.1 * torch.randn(width, generator=g, dtype=torch.float64)).to(dtype)
    dy = torch.randn(ROWS, width, generator=g, dtype=torch.float64).to(dtype)
    fn, ref_fn = IMPLS[impl]
    row = {"case": case, "dtype": dtype_name, "width": width, "impl": impl}
    try:
        y, dx, dw = _run(fn, x.to(device), w.to(device), dy.to(device))
    except (RuntimeError, NotImplementedError) as e:
        return dict(row, error=first_line(e, 200))
    xd, wd = x.double(), w.double()
    ry, rdx, rdw = _run(ref_fn, xd, wd, dy.double())
    ln_exact = _ref_ln(xd, torch.ones_like(wd), EPS)
    e = torch.finfo(dtype).eps
    y = y.cpu()
    return dict(
        row,
        forward=_rel_err(y, ry, e),
        grad_x=_rel_err(dx.cpu(), rdx, e),
        grad_weight=_rel_err(dw.cpu(), rdw, e),
        **_information(y, wd, ln_exact, e),
    )


def precision_table(device="cpu", impls=None) -> list[dict]:
    """Every (case, dtype, width, kernel): errors of y, dx, dγ and the information kept (see the module)."""
    impls = tuple(impls) if impls else tuple(IMPLS)
    return [dict(r) for r in _table(str(device), impls)]


@functools.cache
def _table(device: str, impls: tuple) -> tuple:
    # deterministic for a device (fixed inputs, same kernels): computed once per process
    return tuple(check_case(c, d, w, i, device) for c in CASES for d in DTYPES for w in WIDTHS for i in impls)


def worst(row: dict) -> float:
    vals = [row.get(k) for k in ("forward", "grad_x", "grad_weight")]
    return math.inf if "error" in row or any(v is None for v in vals) else max(vals)


def lost(row: dict | None) -> float | None:
    """1 − correlation with the centred input (inf: non-finite output; None: nothing to keep or no row)."""
    if row is None or "error" in row:
        return None
    if row.get("information_error") == math.inf:
        return math.inf
    c = row.get("correlation")
    return None if c is None else max(0.0, 1.0 - c)


def compare(rows: list[dict], *, rms_kernel: str = RMSNORM_TORCH, factor: float = FACTOR) -> dict:
    """Where ``rms_kernel`` keeps more (``rms_better``) or less (``rms_worse``) of the centred input than
    LayerNorm's kernel: 1 − correlation with the float64 LayerNorm apart by more than ``factor`` (and above
    FLOOR). Each function is judged against the exact LayerNorm, never against its own output scale."""
    by = {(r["case"], r["dtype"], r["width"], r["impl"]): r for r in rows}
    better, worse, same, details = [], [], [], {}
    for (case, dt, w, impl), ln in by.items():
        if impl != LAYERNORM or (case, dt, w, rms_kernel) not in by:
            continue
        rms = by[(case, dt, w, rms_kernel)]
        a, b = lost(rms), lost(ln)
        key = f"{case} / {dt} / {w}"
        if a is None or b is None:
            same.append(key)
            continue
        details[key] = {"rms_lost": a, "layernorm_lost": b}
        if a > max(factor * b, FLOOR):
            worse.append(key)
        elif b > max(factor * a, FLOOR):
            better.append(key)
        else:
            same.append(key)
    return {
        "factor": factor,
        "floor": FLOOR,
        "rms_kernel": rms_kernel,
        "judged_on": "1 − correlation of each kernel's output with the float64 LayerNorm of the same input",
        "rms_better": better,
        "rms_worse": worse,
        "similar": len(same),
        "lost": details,
    }


def kernel_accuracy(device, arm_kernels: dict[str, str]) -> dict:
    """results.json's ``precision`` section: the table for the kernels the arms ran, and the comparison of
    each RMSNorm kernel with LayerNorm's."""
    used = sorted(set(arm_kernels.values()) | {LAYERNORM}, key=list(IMPLS).index)
    rows = precision_table(device=device, impls=used)
    rms_used = [k for k in used if k != LAYERNORM]
    comparisons = {k: compare(rows, rms_kernel=k) for k in rms_used}
    first = comparisons[rms_used[0]] if rms_used else compare(rows)
    return {"rows": rows, "arm_kernels": arm_kernels, "compare": first, "compare_by_kernel": comparisons}


def arm_kind(arm: str) -> str | None:
    """Which norm an arm's residual-stream norms are (None: neither, e.g. DyT)."""
    if arm.startswith("rmsnorm"):
        return "rmsnorm"
    if arm.startswith("layernorm"):
        return "layernorm"
    return None
