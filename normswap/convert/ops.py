"""The tensor arithmetic of a conversion, one function per derivation op.

Every output tensor is a function of *source* tensors only (never of another output), computed in
float64 and cast once at the end, so the in-memory and streaming paths give bitwise-equal results
whatever order they visit tensors in.
"""

from __future__ import annotations

import torch

COMPUTE_DTYPE = torch.float64


def _in_axis(layout):
    # nn.Linear weight is [out, in]; Conv1D is [in, out].
    return 1 if layout == "linear" else 0


def _out_axis(layout):
    return 0 if layout == "linear" else 1


def source_keys(op: dict) -> list[str]:
    """The source tensors an op reads."""
    keys = [op.get(k) for k in ("src", "weight", "gamma", "beta")]
    return [k for k in keys if k]


def compute(op: dict, fetch) -> torch.Tensor:
    """Evaluate one derivation; ``fetch(key)`` returns a source tensor (any dtype/device)."""
    kind = op["op"]
    if kind == "ones":
        return torch.ones(op["size"], dtype=COMPUTE_DTYPE)
    if kind == "copy":
        return fetch(op["src"]).to(COMPUTE_DTYPE)
    if kind == "center_rows":
        w = fetch(op["src"]).to(COMPUTE_DTYPE)
        return w - w.mean(dim=-1, keepdim=True)
    if kind == "linear_weight":
        w = fetch(op["src"]).to(COMPUTE_DTYPE)
        if op.get("gamma"):
            g = fetch(op["gamma"]).to(COMPUTE_DTYPE)
            w = w * (g.unsqueeze(0) if op["layout"] == "linear" else g.unsqueeze(1))
        if op.get("center"):
            w = w - w.mean(dim=_out_axis(op["layout"]), keepdim=True)
        return w
    if kind == "linear_bias":
        b = fetch(op["src"]).to(COMPUTE_DTYPE) if op.get("src") else torch.zeros(op["size"], dtype=COMPUTE_DTYPE)
        if op.get("beta"):
            w = fetch(op["weight"]).to(COMPUTE_DTYPE)
            beta = fetch(op["beta"]).to(COMPUTE_DTYPE)
            # y = W (γ⊙n + β) + c  =>  c' = c + W β   (with the *original* W)
            b = b + (w @ beta if op["layout"] == "linear" else beta @ w)
        if op.get("center"):
            b = b - b.mean()
        return b
    raise ValueError(f"unknown conversion op {kind!r}")
