"""The study's held-out set: disjoint blocks spread evenly over the data's validation split.

One contiguous stretch of text (the first N tokens of the split) measures the arms on a few
chapters of one book; blocks taken at an even stride over the whole split (up to
``SPREAD_OVER`` × the blocks wanted) sample its variety with the same number of tokens. The
blocks never overlap (each is one packed block of the split), and the split never meets the
training split (normswap.data's document-hash split). Every arm and seed is scored on the same
blocks, so the per-block losses pair across arms (results.py reads the held-out sampling error
from them).
"""

from __future__ import annotations

import torch

from normswap.errors import NormswapError

SPREAD_OVER = 16  # read at most this many times the wanted blocks before picking evenly among them


def heldout_blocks(tokenizer, data_spec: str, seq_len: int, max_tokens: int, split: str = "validation") -> dict:
    """``{"blocks": LongTensor [n, seq_len], "read": blocks available, "stride": blocks between picks}``."""
    from normswap.data import load_documents, pack_tokens

    want = max(1, max_tokens // seq_len)
    pool = []
    for block in pack_tokens(tokenizer, load_documents(data_spec, split), seq_len):
        pool.append(block)
        if len(pool) >= want * SPREAD_OVER:
            break
    if not pool:
        raise NormswapError(f"the {split} split of {data_spec} holds fewer than {seq_len} tokens: lower --seq-len")
    n = min(want, len(pool))
    stride = len(pool) / n
    picks = [int(i * stride) for i in range(n)]  # distinct: stride >= 1
    return {"blocks": torch.stack([pool[i] for i in picks]), "read": len(pool), "stride": stride}
