"""Corpora for fine-tuning and evaluation: the embedded KJV, local files, saved datasets, the hub.

Public API (see docs/architecture.md):
    load_documents(spec, split) -> Iterator[str]
    load_text(spec, split) -> str
    default_eval_split(spec) -> "all" for a user's file or directory, "test" for a corpus with splits
    finetune_splits(data, eval_data=None) -> (train split, held-out source, held-out split)
    pack_tokens(tokenizer, documents, seq_len, *, add_eos=True, skip_blocks=0) -> Iterator[LongTensor]
"""

from normswap.data.packing import pack_tokens, token_stream, tokenizer_fingerprint
from normswap.data.sources import (
    SPLITS,
    default_eval_split,
    finetune_splits,
    has_own_splits,
    hash_split,
    load_documents,
    load_text,
)

__all__ = [
    "SPLITS",
    "default_eval_split",
    "finetune_splits",
    "has_own_splits",
    "hash_split",
    "load_documents",
    "load_text",
    "pack_tokens",
    "token_stream",
    "tokenizer_fingerprint",
]
