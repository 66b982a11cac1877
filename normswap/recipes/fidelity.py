"""How closely a converted encoder (BERT-style, masked LM) still computes what its source did.

Perplexity is not defined for a masked LM, so an encoder recipe compares every model with the
unconverted source on the same held-out text instead:

* ``hidden_cosine``: mean over tokens of the cosine between the model's last hidden state and
  the source's (1.0 = same direction; what a downstream head or a sentence embedding reads);
* ``masked_loss`` / ``masked_perplexity``: cross-entropy at 15% masked positions (the same
  positions for every model, drawn with the recipe's seed) - the pre-training objective;
* ``top1_agreement``: share of those masked positions where the model's best guess equals the
  source's.
"""

from __future__ import annotations

import math

import torch

from normswap.errors import NormswapError


def _batch(tokenizer, text: str, max_tokens: int, seq_len: int) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    inner = seq_len - 2 if tokenizer.cls_token_id is not None and tokenizer.sep_token_id is not None else seq_len
    rows = [ids[i:i + inner] for i in range(0, len(ids) - inner + 1, inner)]
    if not rows:
        raise NormswapError(f"fidelity: the evaluation text has fewer than {inner} tokens")
    if inner != seq_len:
        rows = [[tokenizer.cls_token_id] + r + [tokenizer.sep_token_id] for r in rows]
    return torch.tensor(rows, dtype=torch.long)


def _mask(batch: torch.Tensor, tokenizer, seed: int, rate: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    special = torch.zeros_like(batch, dtype=torch.bool)
    for tid in (tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id):
        if tid is not None:
            special |= batch == tid
    chosen = (torch.rand(batch.shape, generator=g) < rate) & ~special
    masked = batch.clone()
    if tokenizer.mask_token_id is not None:
        masked[chosen] = tokenizer.mask_token_id
    return masked, chosen


def _run(model, ids: torch.Tensor, micro: int = 8):
    device = next(model.parameters()).device
    hidden, logits = [], []
    with torch.inference_mode():
        for i in range(0, ids.shape[0], micro):
            out = model(input_ids=ids[i:i + micro].to(device), output_hidden_states=True)
            hidden.append(out.hidden_states[-1].float().cpu())
            lg = getattr(out, "logits", None)
            logits.append(lg.float().cpu() if lg is not None else None)
    return torch.cat(hidden), (torch.cat(logits) if all(x is not None for x in logits) else None)


def fidelity(entries, source_name: str, *, data="embedded", split="test", max_tokens=8192, seq_len=None, seed=0) -> dict:
    """({model name: {hidden_cosine, masked_loss, masked_perplexity, top1_agreement, tokens}}, data info)."""
    from normswap.data import load_text
    from normswap.evaluate.perplexity import model_context

    source = next((e for e in entries if e.name == source_name), None)
    if source is None:
        raise NormswapError(f"fidelity: no model named {source_name} to compare with")
    ctx = model_context(source.model) or 512
    seq_len = min(seq_len or 128, ctx)
    text = load_text(data, split)
    ids = _batch(source.tokenizer, text, max_tokens, seq_len)
    masked, chosen = _mask(ids, source.tokenizer, seed)
    src_hidden, _ = _run(source.model, ids)
    _, src_logits = _run(source.model, masked)
    src_top = src_logits[chosen].argmax(-1) if src_logits is not None else None
    out = {}
    for e in entries:
        hidden, _ = (src_hidden, None) if e is source else _run(e.model, ids)
        _, logits = (None, src_logits) if e is source else _run(e.model, masked)
        cos = torch.nn.functional.cosine_similarity(hidden, src_hidden, dim=-1).mean().item()
        row = {"hidden_cosine": cos, "tokens": int(ids.numel()), "masked_positions": int(chosen.sum())}
        if logits is not None and chosen.any() and source.tokenizer.mask_token_id is not None:
            sel = logits[chosen]
            loss = torch.nn.functional.cross_entropy(sel, ids[chosen]).item()
            row.update(masked_loss=loss, masked_perplexity=math.exp(min(loss, 700)))
            if src_top is not None:
                row["top1_agreement"] = (sel.argmax(-1) == src_top).float().mean().item()
        out[e.name] = row
    # what was read, in the shape of results.json's `data` (the report needs it when no
    # perplexity was measured); the batch is the first `tokens` tokens of the split
    info = {"spec": str(data), "split": split, "characters": len(text), "characters_available": len(text),
            "bytes": len(text.encode("utf-8")), "words": len(text.split()), "max_tokens": max_tokens,
            "truncated": int(ids.numel()) < len(text), "cap_tokenizer_of": source_name, "seq_len": seq_len,
            "stride": seq_len, "batch_size": int(ids.shape[0]), "fidelity_tokens": int(ids.numel())}
    return out, info
