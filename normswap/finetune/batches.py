"""Training and held-out batches for the fine-tune.

Training data is an endless, deterministic stream of seq-len blocks: each epoch streams the
training split's documents through a seeded shuffle buffer (so a corpus of any size is never held
in memory), packs them with ``normswap.data.pack_tokens`` and yields the blocks. The whole run's
data position is one integer, the number of blocks consumed; resuming re-creates the epoch's
document order from the seed and skips the consumed blocks inside ``pack_tokens`` (tokenised, never
materialised), so a resumed run reads exactly the blocks an uninterrupted run would.

Every process reads the same global stream and takes its own rows of each global batch, so the
optimizer sees the same global batch whatever the number of processes.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

import torch

from normswap.errors import NormswapError

SHUFFLE_BUFFER_DOCS = 2048


def _shuffled(docs: Iterable[str], seed: int, buffer: int) -> Iterator[str]:
    """Reservoir-style shuffle buffer: bounded memory, deterministic for a given seed."""
    rng = random.Random(seed)
    pool: list[str] = []
    for doc in docs:
        if len(pool) < buffer:
            pool.append(doc)
            continue
        i = rng.randrange(len(pool))
        yield pool[i]
        pool[i] = doc
    rng.shuffle(pool)
    yield from pool


class TrainStream:
    """Endless iterator of training blocks with a resumable position (blocks consumed)."""

    def __init__(
        self,
        tokenizer,
        data_spec: str,
        seq_len: int,
        seed: int,
        *,
        position: int = 0,
        shuffle_buffer: int = SHUFFLE_BUFFER_DOCS,
        split: str = "train",
    ):
        self.tokenizer = tokenizer
        self.data_spec = data_spec
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.split = split
        self.position = 0
        self.epoch = 0
        self.epoch_lengths: list[int] = []  # [blocks per epoch], counted lazily when a resume needs it
        self._it = None
        self._fresh = True
        self._in_epoch = 0
        if position:
            self._seek(position)

    def _epoch_iter(self, epoch: int, skip: int) -> Iterator[torch.Tensor]:
        from normswap.data import load_documents, pack_tokens

        docs = _shuffled(load_documents(self.data_spec, self.split), self.seed * 1_000_003 + epoch, self.shuffle_buffer)
        return pack_tokens(self.tokenizer, docs, self.seq_len, skip_blocks=skip)

    def _epoch_length(self) -> int:
        if not self.epoch_lengths:
            from normswap.data import load_documents, pack_tokens

            n = sum(1 for _ in pack_tokens(self.tokenizer, load_documents(self.data_spec, self.split), self.seq_len))
            if n == 0:
                raise NormswapError(
                    f"the {self.split} split of {self.data_spec} holds fewer than {self.seq_len} tokens: "
                    "lower --seq-len or give more data"
                )
            self.epoch_lengths.append(n)
        return self.epoch_lengths[0]

    def _seek(self, position: int) -> None:
        """Place the stream after ``position`` blocks (as if that many had been read)."""
        # Every epoch packs the same documents (only their order changes) into one stream whose
        # final partial block is dropped, so all epochs hold the same number of blocks. Counting
        # them costs a full tokenising pass, so we first assume the position lies in epoch 0 and
        # count only if that epoch runs out during the skip.
        if self.epoch_lengths:
            epoch, in_epoch = divmod(position, self.epoch_lengths[0])
        else:
            epoch, in_epoch = 0, position
        self.epoch, self._in_epoch, self.position = epoch, in_epoch, position
        self._fresh = True  # nothing read from this iterator yet
        self._it = self._epoch_iter(epoch, in_epoch)

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        if self._it is None:
            self._it = self._epoch_iter(self.epoch, 0)
            self._fresh = True
        for _ in range(3):
            try:
                block = next(self._it)
            except StopIteration:
                if self._fresh and self._in_epoch > 0 and not self.epoch_lengths:
                    self._epoch_length()  # the skip ran past epoch 0: now place it exactly
                    self._seek(self.position)
                    continue
                if self._in_epoch == 0:
                    raise NormswapError(
                        f"the {self.split} split of {self.data_spec} holds fewer than {self.seq_len} tokens: "
                        "lower --seq-len or give more data"
                    ) from None
                self.epoch += 1
                self._in_epoch = 0
                self._it = self._epoch_iter(self.epoch, 0)
                self._fresh = True
                continue
            self._fresh = False
            self._in_epoch += 1
            self.position += 1
            return block
        raise NormswapError(f"the {self.split} split of {self.data_spec} yields no training blocks")

    def take(self, n: int) -> torch.Tensor:
        """The next n blocks as one [n, seq_len] batch."""
        return torch.stack([next(self) for _ in range(n)])


def eval_blocks(tokenizer, data_spec: str, seq_len: int, max_tokens: int, split: str = "validation") -> torch.Tensor:
    """The held-out set: the first max_tokens of the split (in corpus order), as [n, seq_len] blocks."""
    from normswap.data import load_documents, pack_tokens

    want = max(1, max_tokens // seq_len)
    blocks = []
    for block in pack_tokens(tokenizer, load_documents(data_spec, split), seq_len):
        blocks.append(block)
        if len(blocks) >= want:
            break
    if not blocks:
        raise NormswapError(f"the {split} split of {data_spec} holds fewer than {seq_len} tokens: lower --seq-len")
    return torch.stack(blocks)


def fingerprint(batch: torch.Tensor) -> int:
    """A cheap order-sensitive checksum of a token batch (to show which rows each process read)."""
    flat = batch.reshape(-1).to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64)
    return int((flat * weights).sum() % 2_147_483_647)


def training_data_record(data_spec: str, split: str) -> dict:
    """What the fine-tune trained on, for its manifest (``finetune.training_data``): the source as
    given and resolved, the split, and for a local or embedded source how many documents and
    characters that split holds. An evaluation of the same source leaves these documents out
    (evaluate/heldout.py); the split rule (a hash of each document's text, data/sources.py) sends a
    document to the same split every time, so the record names them without copying them."""
    from pathlib import Path

    from normswap.data import load_documents
    from normswap.data.sources import split_rule

    path = Path(str(data_spec)).expanduser()
    record = {
        "spec": str(data_spec),
        "path": str(path.resolve()) if path.exists() else None,
        "split": split,
        "rule": split_rule(str(data_spec)) if split == "train" else "all of it (--eval-data names the held-out set)",
        "documents": None,
        "characters": None,
    }
    if record["path"] is not None or str(data_spec) == "embedded":  # counting a hub dataset would stream it again
        docs = chars = 0
        for doc in load_documents(data_spec, split):
            docs, chars = docs + 1, chars + len(doc)
        record.update(documents=docs, characters=chars)
    return record


# Training text is tokenised for the header up to this many characters; past it the token count is
# extrapolated from the characters (a 400 MB corpus is not tokenised twice just to be described).
HEADER_TOKENISED_CHARS = 2_000_000
# More passes over the training split than this and the header warns: the model memorises the
# text, and its held-out loss on a few documents says little.
MANY_PASSES = 4.0


def corpus_header(tokenizer, data_spec: str, split: str, eval_tokens: int, eval_docs_spec, eval_split, tokens_needed):
    """(lines, passes): what the fine-tune will read, said before it loads the model — documents and
    tokens of the training split and of the held-out set, and how many passes over the training
    text the run makes (a warning line when that is more than MANY_PASSES). ``eval_tokens``: the
    held-out tokens the run scores; ``tokens_needed``: steps × batch × seq-len."""
    from normswap.data import load_documents
    from normswap.network import data_needs_hub

    if data_needs_hub(data_spec):
        return [f"data: {data_spec} ({split} split; a hub dataset is not counted ahead)"], None
    docs, chars, tokens, counted_chars = _split_counts(tokenizer, data_spec, split)
    exact = counted_chars >= chars
    train_tokens = tokens if exact else round(tokens * chars / max(counted_chars, 1))
    held_docs = sum(1 for _ in load_documents(eval_docs_spec, eval_split))
    passes = tokens_needed / max(train_tokens, 1)
    lines = [
        f"data: {data_spec}: {_docs(docs)} to train on ({'' if exact else '~'}{train_tokens:,} tokens, "
        f"{split} split); held out: {eval_tokens:,} tokens from {_docs(held_docs)} ({eval_split} split"
        + (f" of {eval_docs_spec}" if str(eval_docs_spec) != str(data_spec) else "")
        + f"); this run reads {tokens_needed:,} tokens: {passes:.1f} passes over the training text"
    ]
    if passes > MANY_PASSES:
        lines.append(
            f"warning: {passes:.0f} passes over {_docs(docs)}: past a few passes the model learns this "
            f"text by heart, and a held-out loss on {eval_tokens:,} tokens from {_docs(held_docs)} is thin "
            "evidence of healing; give more text (--data) or fewer --steps"
        )
    return lines, passes


def _split_counts(tokenizer, data_spec: str, split: str) -> tuple[int, int, int, int]:
    """(documents, characters, tokens, tokenised characters) of a split, for the header. The
    embedded corpus is package data that never changes, so its count is kept for the process (keyed
    by the tokenizer's full definition): tokenising 2 M characters costs seconds, and a process
    running several fine-tunes on it (the recipe runner, the test suite) pays that once."""
    from normswap.data import load_documents, token_stream

    key = _embedded_key(tokenizer, split) if str(data_spec) == "embedded" else None
    if key is not None and key in _EMBEDDED_COUNTS:
        return _EMBEDDED_COUNTS[key]
    docs = chars = tokens = counted_chars = 0
    for doc in load_documents(data_spec, split):
        docs, chars = docs + 1, chars + len(doc)
        if counted_chars < HEADER_TOKENISED_CHARS:
            tokens += sum(len(ids) for ids in token_stream(tokenizer, [doc], add_eos=True))
            counted_chars += len(doc)
    if key is not None:
        _EMBEDDED_COUNTS[key] = (docs, chars, tokens, counted_chars)
    return docs, chars, tokens, counted_chars


_EMBEDDED_COUNTS: dict[tuple, tuple[int, int, int, int]] = {}


def _embedded_key(tokenizer, split: str):
    """What the embedded split's token count depends on (normswap.data.tokenizer_fingerprint) and
    how much of it is counted; None (no caching) for a tokenizer without one to fingerprint."""
    from normswap.data import tokenizer_fingerprint

    fingerprint = tokenizer_fingerprint(tokenizer)
    return None if fingerprint is None else (*fingerprint, split, HEADER_TOKENISED_CHARS)


def _docs(n: int) -> str:
    return f"{n:,} document" + ("" if n == 1 else "s")
