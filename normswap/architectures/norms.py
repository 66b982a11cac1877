"""Tell by behaviour whether a module computes LayerNorm, and how it is parametrised.

A module is LayerNorm-like when, on float64 inputs, its output is unchanged by adding a constant
to every feature of a token, and equals ``γ ⊙ (x - mean) / sqrt(var + ε) + β`` for per-feature
γ and β fitted from the outputs. The fitted γ is then matched against the module's own weight
(``γ = weight``, or ``γ = 1 + weight`` as in Nemotron's LayerNorm1P, or 1 when it has none) and β
against its bias, so the conversion knows which tensors hold γ and β. RMSNorm fails the shift
test; anything else fails the fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from normswap.model_facts import declared_eps

EPS_CANDIDATES = (1e-5, 1e-6, 1e-12, 1e-8, 1e-7, 1e-3, 1e-4, 1e-10)


@dataclass(frozen=True)
class NormSpec:
    hidden_size: int
    eps: float
    gamma_offset: float  # γ = weight + offset (0 for nn.LayerNorm, 1 for LayerNorm1P); None weight: γ = 1
    has_weight: bool
    has_bias: bool


def _layer_norm(x, eps):
    m = x.mean(-1, keepdim=True)
    v = (x - m).pow(2).mean(-1, keepdim=True)
    return (x - m) / torch.sqrt(v + eps)


def _close(a, b, rtol):
    return bool(((a - b).abs() <= rtol * (1 + b.abs())).all())


def layernorm_spec(module: nn.Module, shape) -> NormSpec | None:
    """The module's LayerNorm parameters, or None if it does not compute LayerNorm over the last axis."""
    if any(True for _ in module.children()):
        return None
    params = dict(module.named_parameters(recurse=False))
    if set(params) - {"weight", "bias"} or any(p.dim() != 1 for p in params.values()):
        return None
    hidden = int(shape[-1])
    if any(p.shape[0] != hidden for p in params.values()) or hidden < 2:
        return None
    gen = torch.Generator().manual_seed(0)
    rows = 32
    dev = next((p.device for p in params.values()), torch.device("cpu"))

    def run(x):
        try:
            with torch.no_grad():
                y = module(x.to(dev))
        except Exception:  # a module that does not take one tensor is not a norm
            return None
        return y.double().cpu() if isinstance(y, torch.Tensor) and y.shape == x.shape else None

    x = torch.randn(rows, hidden, generator=gen, dtype=torch.float64) * 2 + 0.5
    dtype = next((p.dtype for p in params.values()), torch.float64)
    x = x.to(dtype)
    y = run(x)
    if y is None:
        return None
    shift = torch.randn(rows, 1, generator=gen, dtype=torch.float64).to(dtype) * 3
    y_shift = run(x + shift)
    # norms that compute in float32 whatever the input (Cohere, OLMo) are exact to float32 only
    single = dtype != torch.float64 or bool((y == y.float().double()).all())
    tol = 1e-4 if single else 1e-7
    if y_shift is None or not _close(y_shift, y, tol):
        return None
    # small-variance rows make ε visible, so a wrong ε fails the fit
    x_small = (torch.randn(rows, hidden, generator=gen, dtype=torch.float64) * 2e-3).to(dtype)
    y_small = run(x_small)
    if y_small is None:
        return None
    xs, ys = torch.cat([x, x_small]).double(), torch.cat([y, y_small])
    declared = declared_eps(module)
    for eps in ([declared] if declared is not None else []) + list(EPS_CANDIDATES):
        n = _layer_norm(xs, eps)
        # per-feature least squares y = γ n + β
        nm, ym = n.mean(0), ys.mean(0)
        gamma = ((n - nm) * (ys - ym)).sum(0) / (n - nm).pow(2).sum(0)
        beta = ym - gamma * nm
        if not _close(gamma * n + beta, ys, tol):
            continue
        return _parametrisation(module, hidden, eps, gamma, beta, tol)
    return None


def _parametrisation(module, hidden, eps, gamma, beta, tol) -> NormSpec | None:
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    has_w = isinstance(weight, torch.Tensor)
    has_b = isinstance(bias, torch.Tensor)
    offset = None
    if has_w:
        w = weight.detach().double().cpu()
        for candidate in (0.0, 1.0):
            if _close(gamma, w + candidate, tol):
                offset = candidate
                break
    elif _close(gamma, torch.ones_like(gamma), tol):
        offset = 0.0
    if offset is None:
        return None
    expected_beta = bias.detach().double().cpu() if has_b else torch.zeros_like(beta)
    if not _close(beta, expected_beta, tol):
        return None
    return NormSpec(hidden_size=hidden, eps=float(eps), gamma_offset=offset, has_weight=has_w, has_bias=has_b)
