"""The study's training batches: every row an independent draw of one block of the training split.

Why not the fine-tune's TrainStream. A TrainStream batch is ``batch_size`` *consecutive* blocks of
one shuffled stream of chapters, so the rows of a step come from one or two chapters. For a
fine-tune that is harmless; for a study of a few hundred steps from random weights it is not:
measured on the default byte model (400 steps × 16 × 128, one core each, the probe's optimizer),
consecutive blocks left the held-out loss at 2.441 nats after 100 steps where independent draws
reached 2.326, and the whole study stayed on the count bigram's plateau (2.24 against 2.29 at 400
steps, the first third-edition run) where independent draws pass it by far (an uncommitted probe: ~1.9).

The blocks are the training split packed once (normswap.data.pack_tokens, the fine-tune's packing:
documents in corpus order, end-of-text between them); a data-order seed draws row indices with
replacement from its own torch.Generator, so a unit's batches depend on its seed alone — the same
in any process, on a resume, beside any other arm.
"""

from __future__ import annotations

import torch

from normswap.errors import NormswapError

# The embedded corpus ships with the package and never changes, so its packed blocks are kept per
# process: tokenizing it takes ~1.5 s, which the runner, the baselines and every worker would
# otherwise pay again (and a test session many times). Keyed by normswap.data.tokenizer_fingerprint.
_EMBEDDED_BLOCKS: dict[tuple, torch.Tensor] = {}
EMBEDDED = "embedded"


def training_blocks_all(tokenizer, data_spec: str, seq_len: int, split: str) -> torch.Tensor:
    """Every block of the packed training split, [n, seq_len] (callers read it, never write it)."""
    from normswap.data import load_documents, pack_tokens, tokenizer_fingerprint

    tok = tokenizer_fingerprint(tokenizer) if data_spec == EMBEDDED else None
    key = (tok, seq_len, split)
    if tok is not None and key in _EMBEDDED_BLOCKS:
        return _EMBEDDED_BLOCKS[key]
    blocks = list(pack_tokens(tokenizer, load_documents(data_spec, split), seq_len))
    if not blocks:
        raise NormswapError(
            f"the {split} split of {data_spec} holds fewer than {seq_len} tokens: lower --seq-len or give more data"
        )
    out = torch.stack(blocks)
    if tok is not None:
        _EMBEDDED_BLOCKS[key] = out
    return out


class BlockSampler:
    """``take(n)``: n blocks drawn independently (with replacement) by data-order seed ``seed``."""

    def __init__(self, blocks: torch.Tensor, seed: int):
        self.blocks = blocks
        self.generator = torch.Generator().manual_seed(int(seed))

    def take(self, n: int) -> torch.Tensor:
        idx = torch.randint(len(self.blocks), (n,), generator=self.generator)
        return self.blocks[idx]


METHOD = (
    "each row of a batch an independent draw (with replacement, seeded by the arm's data-order seed) of one "
    "block of the packed training split (study/sampler.py)"
)
