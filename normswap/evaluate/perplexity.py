"""Token perplexity with strided sliding windows, plus tokenizer-independent bits per byte and
word perplexity.

The windowing is the one described in the transformers documentation ("Perplexity of
fixed-length models"): windows of ``seq_len`` tokens start every ``stride`` tokens; each window
scores only the tokens no earlier window scored, and the overlap is context. stride == seq_len
gives disjoint windows (fast, least context); a smaller stride gives every scored token more
context (slower, lower perplexity).

One deliberate addition: the tokenizer's BOS token (EOS when it has none, as lm-eval does) is put
in front of the text as context, so *every* token of the text is scored. Bits per byte and word
perplexity then cover exactly the bytes and words of the text, and a document shorter than the
window gets the same number as lm-eval's ``loglikelihood_rolling``.

The result does not depend on the batch size: windows are formed first, batching only groups
windows of equal length, and the NLL is summed in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from normswap.errors import NormswapError
from normswap.model_facts import context_length

LN2 = math.log(2.0)


@dataclass
class PerplexityResult:
    perplexity: float
    bits_per_byte: float
    word_perplexity: float
    nll_nats: float  # total negative log-likelihood of the scored tokens
    tokens: int  # scored tokens (= tokens of the text)
    bytes: int
    words: int
    windows: int
    seq_len: int
    stride: int


def _exp(x: float) -> float:
    """e**x, infinite past float's range: text with next to no words (a file of NUL bytes is one
    200,000-character "word") has a word perplexity beyond any float, which is a result, not an error."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def count_words(text: str) -> int:
    """Whitespace-separated words; equals lm-eval's ``len(re.split(r"\\s+", doc))`` for stripped text."""
    return len(text.split())


def prefix_token_id(tokenizer) -> int | None:
    if tokenizer.bos_token_id is not None:
        return tokenizer.bos_token_id
    return tokenizer.eos_token_id


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def window_plan(length: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first) for each window over a sequence of ``length`` ids.

    A window feeds ids [begin, end) (at most ``seq_len``) to the model, which predicts ids
    [begin + 1, end + 1); only ids [first, end + 1) - the ones no earlier window scored - count.
    Id 0 has no context and is never scored. Windows start every ``stride`` ids; the last one is
    moved back so that it ends at the last id with a full ``seq_len`` of context (the transformers
    recipe lets it shrink instead; aligning it keeps every window the same length and makes
    stride == seq_len identical to lm-eval's rolling log-likelihood).
    """
    if seq_len < 1:
        raise NormswapError(f"--seq-len must be at least 1 (got {seq_len})")
    if not 1 <= stride <= seq_len:
        raise NormswapError(f"--stride must be between 1 and --seq-len ({seq_len}); got {stride}")
    plan = []
    last_input = length - 1  # the last id is only ever a target
    scored_until = 1
    begin = 0
    while scored_until < length:
        end = begin + seq_len
        if end >= last_input:
            end = last_input
            begin = max(0, end - seq_len)
        plan.append((begin, end, scored_until))
        scored_until = end + 1
        begin += stride
    return plan


def model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


@torch.inference_mode()
def sequence_nll(
    model, ids: list[int], *, seq_len: int, stride: int, batch_size: int = 8, token_nll: list | None = None
) -> tuple[float, int, int]:
    """(total NLL in nats, scored tokens, windows) of ``ids[1:]`` given the windows above.
    ``token_nll``: a list that receives each scored token's NLL (float64), in text order."""
    if batch_size < 1:
        raise NormswapError(f"--batch-size must be at least 1 (got {batch_size})")
    context = context_length(model)
    if context is not None and seq_len > context:
        raise NormswapError(f"--seq-len {seq_len} is longer than the model's context ({context} tokens)")
    plan = window_plan(len(ids), seq_len, stride)
    device = model_device(model)
    data = torch.tensor(ids, dtype=torch.long)
    total = 0.0
    scored = 0
    pieces = []  # (first scored id, its window's per-token NLL) when token_nll is asked for
    # Group windows of equal length so no padding (and no attention mask) is ever needed.
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for w in plan:
        groups.setdefault(w[1] - w[0], []).append(w)
    for _width, windows in groups.items():
        for i in range(0, len(windows), batch_size):
            chunk = windows[i : i + batch_size]
            inputs = torch.stack([data[b:e] for b, e, _ in chunk]).to(device)
            logits = model(input_ids=inputs, use_cache=False).logits
            for row, (b, e, first) in enumerate(chunk):
                # logits at input position p predict the id at p + 1
                pred = logits[row, first - 1 - b : e - b].float()
                target = data[first : e + 1].to(device)
                nll = F.cross_entropy(pred, target, reduction="sum")
                total += float(nll.double())
                if token_nll is not None:
                    pieces.append((first, F.cross_entropy(pred, target, reduction="none").double().cpu()))
                scored += e + 1 - first
    if token_nll is not None:
        token_nll.extend(t for _, t in sorted(pieces, key=lambda p: p[0]))
    return total, scored, len(plan)


def perplexity(
    model,
    tokenizer,
    text: str,
    *,
    seq_len: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    token_nll: list | None = None,
) -> PerplexityResult:
    """Perplexity, bits per byte and word perplexity of ``text`` (one stream)."""
    return document_perplexity(
        model, tokenizer, [text], seq_len=seq_len, stride=stride, batch_size=batch_size, token_nll=token_nll
    )


def document_perplexity(
    model,
    tokenizer,
    documents,
    *,
    seq_len: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    token_nll: list | None = None,
) -> PerplexityResult:
    """Like :func:`perplexity`, scoring each document on its own (each gets the prefix token)
    and aggregating NLL, tokens, bytes and words over all of them - lm-eval's definition for
    ``loglikelihood_rolling`` tasks."""
    context = context_length(model)
    if seq_len is None:
        seq_len = min(context or 512, 512)
    if stride is None:
        stride = max(seq_len // 2, 1)
    prefix = prefix_token_id(tokenizer)
    nll = 0.0
    tokens = n_bytes = words = windows = 0
    for doc in documents:
        ids = encode(tokenizer, doc)
        if not ids:
            continue
        # Without a prefix token the first id is only context and is not scored.
        seq = [prefix] + ids if prefix is not None else ids
        d_nll, d_tokens, d_windows = sequence_nll(
            model, seq, seq_len=seq_len, stride=stride, batch_size=batch_size, token_nll=token_nll
        )
        nll += d_nll
        tokens += d_tokens
        windows += d_windows
        n_bytes += len(doc.encode("utf-8"))
        words += count_words(doc)
    if tokens == 0:
        raise NormswapError("no text to evaluate: the evaluation text is empty")
    return PerplexityResult(
        perplexity=_exp(nll / tokens),
        bits_per_byte=nll / LN2 / max(n_bytes, 1),
        word_perplexity=_exp(nll / max(words, 1)),
        nll_nats=nll,
        tokens=tokens,
        bytes=n_bytes,
        words=words,
        windows=windows,
        seq_len=seq_len,
        stride=stride,
    )


def held_out_text(documents, tokenizer, max_tokens: int | None) -> tuple[str, bool, int]:
    """The text an evaluation scores: the documents joined by blank lines and cut by truncate_text;
    also whether it was cut, and how many characters the whole split holds.

    Only the documents the cap can reach are kept and tokenised (in bounded pieces): once the kept
    documents hold more than ``max_tokens`` tokens, one more is kept (so the cut never lands near
    the end of the kept text, where the tokenizer could see it differently) and the rest are only
    counted. The result is truncate_text's on the whole split, without the split in memory.
    """
    from normswap.data.packing import token_stream

    kept: list[str] = []
    tokens = available = 0
    settled = False
    for i, doc in enumerate(documents):
        available += len(doc) + (2 if i else 0)
        if settled:
            continue
        settled = bool(max_tokens) and tokens > max_tokens  # this is the one more document
        kept.append(doc)
        if max_tokens and not settled:
            tokens += sum(len(ids) for ids in token_stream(tokenizer, [doc], add_eos=False))
    text, truncated = truncate_text("\n\n".join(kept), tokenizer, max_tokens)
    return text, truncated, available


def truncate_text(text: str, tokenizer, max_tokens: int | None) -> tuple[str, bool]:
    """The longest prefix of ``text`` that ends on a word boundary and holds at most
    ``max_tokens`` tokens of ``tokenizer``; (text, truncated?).

    Every model in a run is then scored on the *same* characters, so bits per byte and word
    perplexity compare across tokenizers.
    """
    if not max_tokens or max_tokens <= 0:
        return text, False
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=getattr(tokenizer, "is_fast", False))
    ids = enc["input_ids"]
    if len(ids) <= max_tokens:
        return text, False
    if "offset_mapping" in enc:
        cut = enc["offset_mapping"][max_tokens - 1][1]
    else:
        cut = len(tokenizer.decode(ids[:max_tokens]))
    head = text[:cut]
    # Drop a possibly split last word so that word counts are whole words.
    space = max(head.rfind(" "), head.rfind("\n"))
    if space > 0:
        head = head[:space]
    return head.rstrip(), True
