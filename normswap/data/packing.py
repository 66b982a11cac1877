"""Tokenise documents one small batch at a time and pack them into fixed-length blocks.

The stream is: tokens(doc0) EOS tokens(doc1) EOS ... cut into consecutive seq_len blocks; the
tail that does not fill a block is carried into the next document and the final partial block is
dropped. The same documents and tokenizer always give the same blocks, so a fine-tune resumes its
data position with `skip_blocks` (the skipped blocks are tokenised but never materialised as
tensors).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch

from normswap.errors import NormswapError

# Documents are tokenised this many at a time: batching makes fast tokenizers much quicker while
# memory stays bounded no matter how large the corpus is.
_BATCH_DOCS = 64
# A single document longer than this is tokenised in pieces cut just before whitespace; byte-level
# BPE pre-tokenises at those boundaries anyway, so the pieces give the same tokens.
_MAX_PIECE_CHARS = 100_000


def _eos_id(tokenizer) -> int:
    for attr in ("eos_token_id", "sep_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    raise NormswapError("the tokenizer defines no EOS token to separate documents; pack with add_eos=False")


def tokenizer_fingerprint(tokenizer) -> tuple | None:
    """What packing a fixed text with ``tokenizer`` depends on: the fast tokenizer's whole definition
    (vocabulary, merges, normaliser, added tokens) and the ids that separate documents. The key of
    the per-process caches of the embedded corpus (it never changes); None, no caching, for a
    tokenizer without a definition to fingerprint."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    digest = hashlib.sha256(backend.to_str().encode()).hexdigest()
    return (type(tokenizer).__name__, digest, tokenizer.eos_token_id, getattr(tokenizer, "sep_token_id", None))


def _pieces(doc: str) -> Iterator[str]:
    start = 0
    while len(doc) - start > _MAX_PIECE_CHARS:
        cut = start + _MAX_PIECE_CHARS
        # Cut before a run of whitespace so the following word keeps its leading space.
        back = doc.rfind(" ", start + 1, cut)
        nl = doc.rfind("\n", start + 1, cut)
        cut = max(back, nl) if max(back, nl) > start else cut
        yield doc[start:cut]
        start = cut
    yield doc[start:]


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    enc = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)
    return enc["input_ids"]


def token_stream(tokenizer, documents: Iterable[str], *, add_eos: bool = True) -> Iterator[list[int]]:
    """Yield the token ids of each document (with its trailing EOS when add_eos)."""
    eos = _eos_id(tokenizer) if add_eos else None
    batch: list[str] = []
    owners: list[int] = []  # which document each piece belongs to, to put EOS only at doc ends
    doc_index = 0

    def flush():
        ids_list = _encode_batch(tokenizer, batch)
        out: list[int] = []
        for i, ids in enumerate(ids_list):
            out.extend(ids)
            last_piece = i + 1 == len(ids_list) or owners[i + 1] != owners[i]
            if last_piece:
                if eos is not None:
                    out.append(eos)
                yield out
                out = []
        # pieces of a document never straddle batches (see below), so out is empty here

    for doc in documents:
        pieces = list(_pieces(doc))
        if batch and len(batch) + len(pieces) > _BATCH_DOCS:
            yield from flush()
            batch, owners = [], []
        batch.extend(pieces)
        owners.extend([doc_index] * len(pieces))
        doc_index += 1
    if batch:
        yield from flush()


def pack_tokens(
    tokenizer,
    documents: Iterable[str],
    seq_len: int,
    *,
    add_eos: bool = True,
    skip_blocks: int = 0,
) -> Iterator[torch.LongTensor]:
    """Stream LongTensor blocks of exactly seq_len tokens from the documents, in order.

    skip_blocks: number of leading blocks to skip (resume a run at its data position).
    """
    if seq_len < 1:
        raise NormswapError(f"sequence length must be positive, got {seq_len}")
    if skip_blocks < 0:
        raise NormswapError(f"skip_blocks must be >= 0, got {skip_blocks}")
    if isinstance(documents, str):  # one text, not an iterable of one-character documents
        documents = [documents]
    buf: list[int] = []
    index = 0
    for ids in token_stream(tokenizer, documents, add_eos=add_eos):
        buf.extend(ids)
        if len(buf) < seq_len:
            continue
        n_full = len(buf) // seq_len
        for b in range(n_full):
            if index >= skip_blocks:
                yield torch.tensor(buf[b * seq_len : (b + 1) * seq_len], dtype=torch.long)
            index += 1
        buf = buf[n_full * seq_len :]
