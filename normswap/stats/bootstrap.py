"""Percentile bootstraps, one for each way normswap's samples hang together.

- :func:`median_interval`: independent pairs (the timing instrument's per-pair ratios), resampled
  whole, of their median;
- :func:`seed_blocked_median_interval`: a two-stage bootstrap blocked by seed — seeds resampled,
  then the samples within each drawn seed — of the median of the pooled samples (steps within a seed
  are not independent, seeds are);
- :func:`token_block_means`: consecutive blocks of per-token losses resampled (neighbouring tokens
  are not independent; blocks roughly are), paired across two models that scored the same tokens;
- :func:`two_way_interval`: rows and columns of a table resampled together (seeds and held-out
  blocks), of any statistic of the drawn rows and columns.

Every generator is seeded: the same samples give the same interval. The percentiles are the
(1 − LEVEL)/2 and (1 + LEVEL)/2 quantiles of the resampled statistic.
"""

from __future__ import annotations

from collections.abc import Callable

from normswap.stats.levels import LEVEL


def median_interval(ratios: list[float], *, draws: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the median of ``ratios`` and its percentile-bootstrap interval.

    Each ratio is one whole pair, so resampling ratios resamples pairs: the two halves of a pair
    are never separated, which is what keeps the host's swings out of the interval."""
    import numpy as np

    r = np.asarray(ratios, dtype=np.float64)
    rng = np.random.default_rng(seed)
    meds = np.median(r[rng.integers(len(r), size=(draws, len(r)))], axis=1)
    tail = 50 * (1 - LEVEL)
    low, high = np.percentile(meds, [tail, 100 - tail])
    return float(np.median(r)), float(low), float(high)


def seed_blocked_median_interval(per_seed: dict, *, draws: int = 2000, seed: int = 0) -> dict | None:
    """``{median, low, high, samples, seeds}`` from ``{seed: [samples]}``: the pooled median and its
    bootstrap blocked by seed; None without any sample."""
    import numpy as np

    blocks = [np.asarray(q, dtype=np.float64) for q in per_seed.values() if q]
    if not blocks:
        return None
    rng = np.random.default_rng(seed)
    pooled = np.concatenate(blocks)
    lengths = np.array([len(b) for b in blocks])
    table = np.full((len(blocks), lengths.max()), np.nan)
    for i, b in enumerate(blocks):
        table[i, : len(b)] = b
    # every draw at once: seeds drawn with replacement, then as many samples as the drawn seed has,
    # drawn with replacement from it (positions past a shorter seed's length stay NaN, ignored)
    picked = rng.integers(len(blocks), size=(draws, len(blocks)))
    n = lengths[picked][..., None]
    steps = np.floor(rng.random((draws, len(blocks), lengths.max())) * n).astype(np.int64)
    values = table[picked[..., None], steps]
    values[np.arange(lengths.max()) >= n] = np.nan
    medians = np.nanmedian(values.reshape(draws, -1), axis=1)
    lo, hi = np.percentile(medians, [50 * (1 - LEVEL), 100 - 50 * (1 - LEVEL)])
    return {
        "median": float(np.median(pooled)),
        "low": float(lo),
        "high": float(hi),
        "samples": int(pooled.size),
        "seeds": len(blocks),
    }


def _block_sums(values, block: int):
    import torch

    n = values.numel()
    starts = torch.arange(0, n, block)
    sums = torch.stack([values[s : s + block].sum() for s in starts.tolist()])
    counts = torch.tensor([min(block, n - s) for s in starts.tolist()], dtype=torch.float64)
    return sums.double(), counts


def token_block_means(values, base, *, block: int, resamples: int, seed: int):
    """Block-bootstrap means of two per-token series (``values`` and ``base``, torch tensors): each cut
    into consecutive blocks of ``block`` tokens, the blocks resampled with replacement ``resamples``
    times; paired (the same blocks drawn for both) when both have as many tokens, else each drawn on
    its own. Returns ``(means, base_means, blocks, paired)``: the resampled per-token means of each
    (float64 tensors of ``resamples``) and the number of blocks of ``values``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    sm, cm = _block_sums(values, block)
    sb, cb = _block_sums(base, block)
    paired = values.numel() == base.numel()
    idx_m = torch.randint(0, len(sm), (resamples, len(sm)), generator=gen)
    idx_b = idx_m if paired else torch.randint(0, len(sb), (resamples, len(sb)), generator=gen)
    return sm[idx_m].sum(1) / cm[idx_m].sum(1), sb[idx_b].sum(1) / cb[idx_b].sum(1), len(sm), paired


def percentile_interval(values) -> tuple[float, float]:
    """(low, high): the (1 − LEVEL)/2 and (1 + LEVEL)/2 quantiles of a float64 torch tensor of resampled
    statistics (linear interpolation between order statistics)."""
    import torch

    q = torch.tensor([(1 - LEVEL) / 2, (1 + LEVEL) / 2], dtype=torch.float64)
    low, high = torch.quantile(values, q).tolist()
    return low, high


def two_way_interval(
    statistic: Callable[[list[int], list[int]], float], rows: int, cols: int, *, draws: int, generator
) -> tuple[float, float]:
    """(low, high) of ``statistic(row_indices, col_indices)`` over ``draws`` resamples of the rows and
    the columns (each with replacement, rows first, from the torch ``generator``): the order statistics
    at (1 − LEVEL)/2 and (1 + LEVEL)/2 of the sorted draws."""
    import torch

    boots = []
    for _ in range(draws):
        r_idx = torch.randint(rows, (rows,), generator=generator).tolist()
        c_idx = torch.randint(cols, (cols,), generator=generator).tolist()
        boots.append(statistic(r_idx, c_idx))
    boots.sort()
    return boots[int((1 - LEVEL) / 2 * draws)], boots[min(draws - 1, int((1 + LEVEL) / 2 * draws))]
