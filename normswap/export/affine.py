"""Stock export: a norm's folded γ/β moved back into the LayerNorm the stock class has.

The conversion folds a norm's γ and β into the linears that read it: W′ = W·diag(γ) and
c′ = c + W·β. Where a reader has no bias in the stock class (GPT-NeoX's lm_head, GPT-J's q/k/v,
Falcon's query_key_value...), c′ has no place there; the norm's own bias does, because a
LayerNorm's output goes through the reader's weights: W′·(n + b) = W′·n + W′·b. So the stock
LayerNorm gets bias b with W′·b = W·β for every reader, and each reader that keeps a bias in the
stock class gives up what b now adds (c_stock = c′ − W′·b). Two ways to find b, both in float64:

- the norm's γ and β travel with the checkpoint (``restore``: a final norm folded into a head only):
  the stock LayerNorm gets γ and β themselves, and each reader its original weight W = W′·diag(1/γ);
  the stock model, bare model included, is then the original function;
- otherwise b = β/γ is recovered from the readers alone, as the least-squares solution of W′·b = c′
  over every reader without a stock bias.

Either way each reader without a stock bias must come out with no bias left (W′·b = c′ to the
rounding of the checkpoint's dtype); where no b does that, e.g. γ_j = 0 with W_j·β_j ≠ 0 (W′'s column
j is zero, so nothing in the norm reaches W·β's part from it), no stock form exists and export
refuses, naming the tensor and the option that avoids it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from normswap.errors import NormswapError
from normswap.model_facts import layout_of

F64 = torch.float64
# a reader's bias left over after b is taken out may be at most this many units of the checkpoint
# dtype's rounding of the terms it sums (|W′|·|b| + |c′|); γ_j = 0 with W_j·β_j ≠ 0 leaves O(1)
ROUNDING_UNITS = 64
AVOID = "reconvert the source with --gamma keep --beta keep to keep γ and β on the norms"


@dataclass
class Moved:
    """What the stock checkpoint holds instead of the converted tensors (float64 values by key)."""

    values: dict = field(default_factory=dict)
    absorbed: set = field(default_factory=set)  # added biases that moved into a norm: not written
    norms: dict = field(default_factory=dict)  # norm -> "gamma_beta" (γ and β restored) or "bias" (b solved)


def _matvec(w, layout, b):
    """W·b for a reader's weight in its layout (linear [out, in], conv1d [in, out])."""
    return w @ b if layout == "linear" else b @ w


def _scale_inputs(w, layout, inv):
    """W·diag(inv): the reader's input axis scaled."""
    return w * inv.unsqueeze(0) if layout == "linear" else w * inv.unsqueeze(1)


def _as_rows(w, layout):
    """W as [out, in] (the system W·b = c is solved row by row)."""
    return w if layout == "linear" else w.t()


def move_folded_affine(opened, stock_model, stock_keys, block, module_of, label: str) -> Moved:
    """For each converted norm whose folding left a bias the stock class has no place for, or whose
    γ/β travel with the checkpoint, the stock LayerNorm's γ/β and its readers' weights and biases."""
    moved = Moved()
    stock_keys = set(stock_keys)
    added = block.get("added_biases", {})
    dtype = opened.dtype
    unit = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    for name, rec in block.get("norms", {}).items():
        norm = module_of(stock_model, name)
        readers = [r for r in rec.get("readers", []) if module_of(stock_model, r) is not None]
        if norm is None or not readers:
            continue
        homeless = [r for r in readers if r in added and f"{r}.bias" not in stock_keys]
        restore = rec.get("restore", [])
        if not homeless and not restore:
            continue
        layouts = {r: layout_of(module_of(stock_model, r)) for r in readers}
        if any(layouts[r] not in ("linear", "conv1d") for r in readers):
            if homeless:
                raise NormswapError(
                    f"cannot export {label} as stock: the stock {block['source_class']} has no place for "
                    f"{homeless[0]}.bias, and {name}'s readers are not all Linear/Conv1D; {AVOID}"
                )
            continue
        weights = {r: opened.inputs.read(f"{r}.weight").to(F64) for r in readers}
        biases = {
            r: opened.inputs.read(f"{r}.bias").to(F64) if opened.inputs.disk_key(f"{r}.bias") else None for r in readers
        }
        gamma = _carried(opened, name, "weight", rec)
        beta = _carried(opened, name, "bias", rec)
        folded_gamma = rec["gamma"] == "fold"
        if (
            (not folded_gamma or gamma is not None)
            and (rec["beta"] != "fold" or beta is not None)
            and (gamma is None or bool((gamma != 0).all()))
        ):
            # γ and β back on the norm, each reader's weight back to W = W′·diag(1/γ)
            if gamma is not None:
                weights = {r: _scale_inputs(w, layouts[r], 1.0 / gamma) for r, w in weights.items()}
                moved.values[f"{name}.weight"] = gamma
                for r, w in weights.items():
                    moved.values[f"{r}.weight"] = w
            b = beta
            if gamma is not None and rec.get("bias"):  # β kept beside a folded γ is β/γ: γ·(β/γ) = β
                moved.values[f"{name}.bias"] = gamma * opened.inputs.read(f"{name}.bias").to(F64)
            moved.norms[name] = "gamma_beta"
        elif rec["beta"] == "fold" and homeless:
            b = _solve(weights, biases, layouts, homeless)
            moved.norms[name] = "bias"
        else:
            continue
        if b is None:
            continue
        if getattr(norm, "bias", None) is None:
            if bool((b != 0).any()):
                raise NormswapError(
                    f"cannot export {label} as stock: {name} has no bias in the stock {block['source_class']}, "
                    f"so β folded into its readers has no place there; {AVOID}"
                )
        else:
            moved.values[f"{name}.bias"] = b
        for r in readers:
            wb = _matvec(weights[r], layouts[r], b)
            c = biases[r] if biases[r] is not None else torch.zeros_like(wb)
            rest = c - wb
            if f"{r}.bias" in stock_keys:
                moved.values[f"{r}.bias"] = rest
                continue
            scale = _matvec(weights[r].abs(), layouts[r], b.abs()) + c.abs()
            worst = int((rest.abs() - ROUNDING_UNITS * unit * scale).argmax())
            if float(rest[worst].abs()) > ROUNDING_UNITS * unit * float(scale[worst]):
                raise NormswapError(
                    f"cannot export {label} as stock: the stock {block['source_class']} has no place for {r}.bias "
                    f"(β of {name} folded into a linear that has none), and it does not move back into {name}'s "
                    f"bias: no b gives W′·b = {r}.bias (|Δ| {float(rest[worst].abs()):.3g} at row {worst}: "
                    f"γ of {name} is 0 where W·β is not?); {AVOID}"
                )
            moved.absorbed.add(f"{r}.bias")
    return moved


def _carried(opened, name, attr, rec):
    """The norm's folded γ (attr weight) or β (bias) where the checkpoint carries a copy (``restore``)."""
    if attr not in rec.get("restore", []):
        return None
    key = f"{name}.folded_{attr}"
    return opened.inputs.read(key).to(F64) if opened.inputs.disk_key(key) else None


def _solve(weights, biases, layouts, homeless) -> torch.Tensor:
    """The b with W′_r·b = c′_r for every reader r without a stock bias (least squares, float64)."""
    a = torch.cat([_as_rows(weights[r], layouts[r]) for r in homeless])
    c = torch.cat([biases[r] for r in homeless])  # each is a bias the conversion added: present
    return torch.linalg.lstsq(a, c.unsqueeze(1), driver="gelsd").solution.squeeze(1)
