"""How sure a perplexity difference is: a block bootstrap over the scored tokens, and the warnings
an evaluation writes when its held-out text is too thin for the difference it shows.

Every model scores the same text. Its per-token losses are cut into consecutive blocks of
``BLOCK_TOKENS`` (neighbouring tokens are not independent; blocks roughly are), the blocks are
resampled with replacement ``RESAMPLES`` times, and the 2.5th and 97.5th percentiles of the
resampled ratio (model / baseline) are the 95 % interval. Models that share the baseline's
tokenizer are paired (the same blocks resampled for both, so what they have in common cancels);
otherwise each is resampled on its own. The generator is seeded: the same results give the same
interval. A range that contains 1 is no measured change: the report does not colour it.
"""

from __future__ import annotations

import torch

BLOCK_TOKENS = 128
RESAMPLES = 2000
LEVEL = 0.95
SEED = 0
# Fewer scored tokens than this and an evaluation says so in results.json ``warnings``.
THIN_TOKENS = 16384
# A change smaller than this (0.1 %) is shown as no change anyway, so it needs no warning.
SHOWN_CHANGE = 0.001


def _block_sums(nll: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = nll.numel()
    starts = torch.arange(0, n, BLOCK_TOKENS)
    sums = torch.stack([nll[s : s + BLOCK_TOKENS].sum() for s in starts.tolist()])
    counts = torch.tensor([min(BLOCK_TOKENS, n - s) for s in starts.tolist()], dtype=torch.float64)
    return sums.double(), counts


def ratio_intervals(nll: torch.Tensor, base: torch.Tensor, *, n_bytes: int) -> dict:
    """``{perplexity: {low, high, ...}, bits_per_byte: {...}}`` of the model (per-token losses
    ``nll``, nats) against the baseline (``base``) on the same text of ``n_bytes`` bytes."""
    gen = torch.Generator().manual_seed(SEED)
    sm, cm = _block_sums(nll)
    sb, cb = _block_sums(base)
    paired = nll.numel() == base.numel()
    idx_m = torch.randint(0, len(sm), (RESAMPLES, len(sm)), generator=gen)
    idx_b = idx_m if paired else torch.randint(0, len(sb), (RESAMPLES, len(sb)), generator=gen)
    mean_m = sm[idx_m].sum(1) / cm[idx_m].sum(1)
    mean_b = sb[idx_b].sum(1) / cb[idx_b].sum(1)
    ppl = torch.exp(mean_m - mean_b)
    bpb = (mean_m * nll.numel()) / (mean_b * base.numel())  # total NLL over the same bytes
    q = torch.tensor([(1 - LEVEL) / 2, (1 + LEVEL) / 2], dtype=torch.float64)
    method = (
        f"{'paired ' if paired else ''}bootstrap over blocks of {BLOCK_TOKENS} scored tokens "
        f"({len(sm)} blocks, {RESAMPLES} resamples, seed {SEED}), {LEVEL:.0%} percentile interval of the ratio"
    )
    out = {}
    for key, values in (("perplexity", ppl), ("bits_per_byte", bpb)):
        low, high = torch.quantile(values, q).tolist()
        out[key] = {"low": low, "high": high, "level": LEVEL, "blocks": len(sm), "method": method}
    return out


def thin_evidence(rows: list[dict], baseline: str | None, tokens: int, *, capped_at: int | None = None) -> list[str]:
    """results.json ``warnings`` about the perplexity evidence: too few held-out tokens for any
    difference, and each shown difference that its interval does not resolve.

    ``capped_at``: the ``--max-tokens`` cap when it cut the text. The cut lands on a word boundary
    (perplexity.truncate_text drops a word the cap split), so a text cut at 16,384 tokens scores up to
    a word fewer (16,383 on the embedded test split): that is the cap the user chose, not thin text,
    and the scored count is judged as the cap."""
    warnings = []
    if max(tokens, capped_at or 0) < THIN_TOKENS:
        warnings.append(
            f"only {tokens:,} held-out tokens were scored (fewer than {THIN_TOKENS:,}): perplexity differences "
            "carry wide intervals and are coloured only where the interval excludes no change; "
            "evaluate more text for a firmer answer"
        )
    for row in rows:
        ratio = (row.get("ratios") or {}).get("perplexity")
        iv = (row.get("quality_intervals") or {}).get("perplexity")
        if row["name"] == baseline or ratio is None or iv is None or abs(ratio - 1) < SHOWN_CHANGE:
            continue
        if iv["low"] <= 1.0 <= iv["high"]:
            warnings.append(
                f"{row['name']}: perplexity {(ratio - 1) * 100:+.2f} % against {baseline} is not a measured "
                f"difference on {tokens:,} held-out tokens: its {iv['level']:.0%} interval "
                f"[{(iv['low'] - 1) * 100:+.2f} %, {(iv['high'] - 1) * 100:+.2f} %] contains no change"
            )
    return warnings
