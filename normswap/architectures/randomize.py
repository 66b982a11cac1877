"""Randomise a model's parameters so that a wrong conversion cannot pass by luck.

Discovery checks every description it produces on a tiny instance whose γ, β, biases and
embeddings are far from their initialisation (γ≠1, β≠0, nothing zero-mean): with the defaults a
conversion that dropped γ or β, or skipped centring, would still reproduce the outputs.
"""

from __future__ import annotations

import torch


def randomize_(model, seed: int = 0):
    """Move every parameter well away from its initialisation, norms included."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
            if p.dim() == 1 and name.endswith("weight"):  # γ: positive, far from 1
                p.copy_(0.5 + torch.rand(p.shape, generator=gen).to(p.dtype) * 1.5)
            elif p.dim() == 1:  # β and biases
                p.copy_(noise * 0.2 + 0.1)
            else:  # matrices and tables: add a common offset so nothing is zero-mean
                p.add_(noise * 0.05 + 0.02)
    return model
