"""How sure a perplexity difference is: a block bootstrap over the scored tokens, and the warnings
an evaluation writes when its held-out text is too thin for the difference it shows.

Every model scores the same text. Its per-token losses are cut into consecutive blocks of
``BLOCK_TOKENS`` (neighbouring tokens are not independent; blocks roughly are), the blocks are
resampled with replacement ``RESAMPLES`` times (normswap/stats/bootstrap.py ``token_block_means``),
and the 2.5th and 97.5th percentiles of the resampled ratio (model / baseline) are the 95 % interval.
Models that share the baseline's tokenizer are paired (the same blocks resampled for both, so what
they have in common cancels); otherwise each is resampled on its own. The generator is seeded: the
same results give the same interval. A range that contains 1 is no measured change: the report does not colour it.
"""

from __future__ import annotations

from normswap.stats.bootstrap import percentile_interval, token_block_means
from normswap.stats.levels import LEVEL
from normswap.stats.verdicts import contains

BLOCK_TOKENS = 128
RESAMPLES = 2000
SEED = 0
# Fewer scored tokens than this and an evaluation says so in results.json ``warnings``.
THIN_TOKENS = 16384
# A change smaller than this (0.1 %) is shown as no change anyway, so it needs no warning.
SHOWN_CHANGE = 0.001


def ratio_intervals(nll, base, *, n_bytes: int) -> dict:
    """``{perplexity: {low, high, ...}, bits_per_byte: {...}}`` of the model (per-token losses
    ``nll``, nats, a torch tensor) against the baseline (``base``) on the same text of ``n_bytes`` bytes."""
    mean_m, mean_b, blocks, paired = token_block_means(nll, base, block=BLOCK_TOKENS, resamples=RESAMPLES, seed=SEED)
    ppl = (mean_m - mean_b).exp()
    bpb = (mean_m * nll.numel()) / (mean_b * base.numel())  # total NLL over the same bytes
    method = (
        f"{'paired ' if paired else ''}bootstrap over blocks of {BLOCK_TOKENS} scored tokens "
        f"({blocks} blocks, {RESAMPLES} resamples, seed {SEED}), {LEVEL:.0%} percentile interval of the ratio"
    )
    out = {}
    for key, values in (("perplexity", ppl), ("bits_per_byte", bpb)):
        low, high = percentile_interval(values)
        out[key] = {"low": low, "high": high, "level": LEVEL, "blocks": blocks, "method": method}
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
        if contains(iv, 1.0):
            warnings.append(
                f"{row['name']}: perplexity {(ratio - 1) * 100:+.2f} % against {baseline} is not a measured "
                f"difference on {tokens:,} held-out tokens: its {iv['level']:.0%} interval "
                f"[{(iv['low'] - 1) * 100:+.2f} %, {(iv['high'] - 1) * 100:+.2f} %] contains no change"
            )
    return warnings
