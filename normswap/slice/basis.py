"""The rotation: an orthogonal d × d basis whose last column is the all-ones direction u = 1/√d.

In an exact conversion's stream every vector is centred, so u carries no energy: it is the first
direction deleted and the sliced model needs no centring anywhere. The other d − 1 columns span
u⊥ and are ordered by what the chosen basis says matters most:

- ``pca``: the eigenvectors of Σ (the stream's uncentred second moments, summed over every
  norm's input, float64) restricted to u⊥, by descending eigenvalue, after a damping of
  ``DAMPING`` × the mean of Σ's diagonal (SliceGPT's choice: it keeps a nearly singular Σ
  well conditioned and changes no eigenvector);
- ``random``: a seeded random orthogonal basis of u⊥ (the control: same shapes, no alignment with
  the data).

Every basis is returned as the full d × d matrix [kept ..., deleted ..., u]; the caller keeps the
first k columns.
"""

from __future__ import annotations

import math

import torch

DAMPING = 0.01  # × mean diagonal of Σ (SliceGPT, Ashkboos et al. 2024)


def complement_of_ones(d: int) -> torch.Tensor:
    """A d × (d − 1) float64 matrix with orthonormal columns spanning u⊥ (u = 1/√d): the first
    d − 1 columns of the Householder reflection that maps u to the last axis."""
    u = torch.full((d,), 1.0 / math.sqrt(d), dtype=torch.float64)
    v = u.clone()
    v[-1] -= 1.0
    norm = float(v.norm())
    h = torch.eye(d, dtype=torch.float64)
    if norm > 1e-12:  # d == 1: u already is the last axis
        v /= norm
        h -= 2.0 * torch.outer(v, v)
    return h[:, : d - 1].contiguous()


def ones_direction(d: int) -> torch.Tensor:
    return torch.full((d, 1), 1.0 / math.sqrt(d), dtype=torch.float64)


def pca_basis(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, eigenvalues): Q is d × d, columns the principal directions of ``sigma`` within u⊥ in
    descending order, u last; the eigenvalues (d − 1, descending, undamped) go with them."""
    d = sigma.shape[0]
    sigma = sigma.to(torch.float64)
    b = complement_of_ones(d)
    inner = b.T @ sigma @ b
    inner = 0.5 * (inner + inner.T)
    damp = DAMPING * float(torch.diagonal(sigma).mean()) if d > 0 else 0.0
    values, vectors = torch.linalg.eigh(inner + damp * torch.eye(d - 1, dtype=torch.float64))
    order = torch.argsort(values, descending=True)
    q = torch.cat([b @ vectors[:, order], ones_direction(d)], dim=1)
    return q, (values[order] - damp)


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A seeded random orthogonal n × n float64 matrix (QR of a Gaussian, signs fixed so the
    distribution is uniform: Haar)."""
    gen = torch.Generator().manual_seed(int(seed))
    g = torch.randn(n, n, generator=gen, dtype=torch.float64)
    qr, r = torch.linalg.qr(g)
    return qr * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones((), dtype=torch.float64))


def random_basis(d: int, seed: int) -> torch.Tensor:
    """A seeded random orthogonal d × d basis, u last."""
    return torch.cat([complement_of_ones(d) @ random_orthogonal(d - 1, seed), ones_direction(d)], dim=1)


def kept_energy(sigma: torch.Tensor, q_kept: torch.Tensor) -> float:
    """The share of ``sigma``'s trace (the stream's energy) inside the span of ``q_kept``'s columns."""
    total = float(torch.trace(sigma))
    if total <= 0:
        return 1.0
    return float(torch.einsum("ik,ij,jk->", q_kept, sigma.to(torch.float64), q_kept)) / total


def width_for(d: int, fraction: float, round_to: int) -> int:
    """k = min(d − 1, round(d·(1 − F) / round_to)·round_to), at least round_to (and at least 1):
    F = 0 deletes only u (exact)."""
    step = max(1, int(round_to))
    k = int(round(d * (1.0 - float(fraction)) / step)) * step
    return max(1, min(d - 1, max(k, min(step, d - 1))))
