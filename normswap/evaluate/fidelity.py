"""How closely a model still computes what a reference (the unconverted source) computes.

Perplexity is not defined for an encoder (BERT, RoBERTa, MiniLM sentence encoders), so encoders
are compared with a reference model on the same held-out text instead:

* ``hidden_cosine``: mean over tokens of the cosine between the model's last hidden state and the
  reference's (1.0 = same direction; what a classifier head reads);
* ``embedding_cosine`` / ``embedding_cosine_min``: mean and worst cosine between mean-pooled
  sentence embeddings (each sentence of the text embedded on its own, padding masked out: what a
  sentence-embedding model such as all-MiniLM-L6-v2 returns);
* ``masked_loss`` / ``masked_perplexity``: cross-entropy at 15 % masked positions (the same
  positions for every model, drawn with ``seed``), for models with a masked-LM head;
* ``top1_agreement``: share of those masked positions where the model's best guess equals the
  reference's.
"""

from __future__ import annotations

import math
import re

import torch

from normswap.errors import NormswapError

MASK_RATE = 0.15
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
MIN_SENTENCE_WORDS = 3


def _row_tokens(tokenizer, seq_len: int) -> int:
    """Text tokens in one fidelity row: seq_len less [CLS] and [SEP] when the tokenizer has them."""
    framed = tokenizer.cls_token_id is not None and tokenizer.sep_token_id is not None
    return seq_len - 2 if framed else seq_len


def _too_short(have: int, inner: int, seq_len: int, where: str) -> NormswapError:
    hint = f"lower --seq-len to {have + seq_len - inner} or less, or give more text" if have >= 16 else "give more text"
    return NormswapError(
        f"fidelity: {where} holds {have} tokens, fewer than the {inner} of one row (--seq-len {seq_len}): {hint}"
    )


def require_fidelity_text(
    tokenizer, text: str, *, max_tokens: int, seq_len: int, where: str = "the evaluation text"
) -> None:
    """Refuse, before any model is loaded, a text too short for one fidelity row or without a sentence."""
    have = len(tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens])
    inner = _row_tokens(tokenizer, seq_len)
    if have < inner:
        raise _too_short(have, inner, seq_len, where)
    if not sentences(text, 1):
        raise NormswapError(f"fidelity: {where} holds no sentence of {MIN_SENTENCE_WORDS} or more words")


def token_blocks(tokenizer, text: str, max_tokens: int, seq_len: int) -> torch.Tensor:
    """Consecutive [CLS] … [SEP] rows of exactly seq_len tokens from the text (at most max_tokens)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    framed = tokenizer.cls_token_id is not None and tokenizer.sep_token_id is not None
    inner = _row_tokens(tokenizer, seq_len)
    rows = [ids[i : i + inner] for i in range(0, len(ids) - inner + 1, inner)]
    if not rows:
        raise _too_short(len(ids), inner, seq_len, "the evaluation text")
    if framed:
        rows = [[tokenizer.cls_token_id] + r + [tokenizer.sep_token_id] for r in rows]
    return torch.tensor(rows, dtype=torch.long)


def special_mask(ids: torch.Tensor, tokenizer) -> torch.Tensor:
    special = torch.zeros_like(ids, dtype=torch.bool)
    for tid in (tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id):
        if tid is not None:
            special |= ids == tid
    return special


def fixed_mask(ids: torch.Tensor, tokenizer, seed: int, rate: float = MASK_RATE) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids with the chosen positions replaced by [MASK], chosen positions); the same for every model."""
    g = torch.Generator().manual_seed(seed)
    chosen = (torch.rand(ids.shape, generator=g) < rate) & ~special_mask(ids, tokenizer)
    masked = ids.clone()
    if tokenizer.mask_token_id is not None:
        masked[chosen] = tokenizer.mask_token_id
    return masked, chosen


def sentences(text: str, limit: int) -> list[str]:
    """The text's first ``limit`` sentences (lines or ./!/? ends) of at least three words."""
    out = []
    for s in _SENTENCE_END.split(text):
        s = s.strip()
        if len(s.split()) >= MIN_SENTENCE_WORDS:
            out.append(s)
            if len(out) >= limit:
                break
    return out


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _last_hidden(out) -> torch.Tensor:
    hs = getattr(out, "hidden_states", None)
    return hs[-1] if hs is not None else out.last_hidden_state


def run_blocks(model, ids: torch.Tensor, micro: int = 8) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(last hidden states, MLM logits or None) of the rows, in float32 on the CPU."""
    hidden, logits = [], []
    with torch.inference_mode():
        for i in range(0, ids.shape[0], micro):
            out = model(input_ids=ids[i : i + micro].to(_device(model)), output_hidden_states=True)
            hidden.append(_last_hidden(out).float().cpu())
            lg = getattr(out, "logits", None)
            logits.append(lg.float().cpu() if lg is not None else None)
    return torch.cat(hidden), (torch.cat(logits) if all(x is not None for x in logits) else None)


def sentence_embeddings(model, tokenizer, texts: list[str], seq_len: int, micro: int = 16) -> torch.Tensor:
    """Mean-pooled last hidden states (padding excluded), one row per text, float32 on the CPU."""
    rows = []
    with torch.inference_mode():
        for i in range(0, len(texts), micro):
            enc = tokenizer(
                texts[i : i + micro], padding=True, truncation=True, max_length=seq_len, return_tensors="pt"
            )
            mask = enc["attention_mask"].to(_device(model))
            out = model(input_ids=enc["input_ids"].to(_device(model)), attention_mask=mask, output_hidden_states=True)
            h = _last_hidden(out).float()
            m = mask.unsqueeze(-1).to(h.dtype)
            rows.append(((h * m).sum(1) / m.sum(1).clamp_min(1.0)).cpu())
    return torch.cat(rows)


def fidelity(
    entries,
    reference: str,
    text: str,
    *,
    max_tokens: int,
    seq_len: int,
    max_sentences: int = 256,
    seed: int = 0,
    progress=None,
) -> tuple[dict, dict]:
    """({model name: metrics}, what was read) for every entry against the entry named ``reference``.

    Models that do not read text (images, audio features) are compared on probe inputs instead
    (:func:`probe_fidelity`)."""
    from normswap.evaluate.kinds import PROBE_INPUT, model_kind

    say = progress or (lambda msg: None)
    ref = next((e for e in entries if e.name == reference), None)
    if ref is None:
        raise NormswapError(f"fidelity: no model named {reference} to compare with")
    if model_kind(ref.model) == PROBE_INPUT:
        return probe_fidelity(entries, reference, seed=seed, progress=progress)
    tok = ref.tokenizer
    ids = token_blocks(tok, text, max_tokens, seq_len)
    masked, chosen = fixed_mask(ids, tok, seed)
    sents = sentences(text, max_sentences)
    if not sents:
        raise NormswapError(f"fidelity: the evaluation text holds no sentence of {MIN_SENTENCE_WORDS} or more words")
    say(f"fidelity: reference {reference}")
    ref_hidden, _ = run_blocks(ref.model, ids)
    _, ref_logits = run_blocks(ref.model, masked)
    ref_top = ref_logits[chosen].argmax(-1) if ref_logits is not None else None
    ref_emb = sentence_embeddings(ref.model, tok, sents, seq_len)
    out = {}
    for e in entries:
        say(f"fidelity: {e.name}")
        hidden = ref_hidden if e is ref else run_blocks(e.model, ids)[0]
        logits = ref_logits if e is ref else run_blocks(e.model, masked)[1]
        emb = ref_emb if e is ref else sentence_embeddings(e.model, tok, sents, seq_len)
        per_sentence = torch.nn.functional.cosine_similarity(emb, ref_emb, dim=-1)
        row = {
            "reference": reference,
            "hidden_cosine": torch.nn.functional.cosine_similarity(hidden, ref_hidden, dim=-1).mean().item(),
            "embedding_cosine": per_sentence.mean().item(),
            "embedding_cosine_min": per_sentence.min().item(),
            "sentences": len(sents),
            "tokens": int(ids.numel()),
            "masked_positions": int(chosen.sum()),
            "masked_loss": None,
            "masked_perplexity": None,
            "top1_agreement": None,
        }
        if logits is not None and chosen.any() and tok.mask_token_id is not None:
            sel = logits[chosen]
            loss = torch.nn.functional.cross_entropy(sel, ids[chosen]).item()
            row.update(masked_loss=loss, masked_perplexity=math.exp(min(loss, 700)))
            if ref_top is not None:
                row["top1_agreement"] = (sel.argmax(-1) == ref_top).float().mean().item()
        out[e.name] = row
    info = {
        "fidelity_tokens": int(ids.numel()),
        "fidelity_rows": int(ids.shape[0]),
        "sentences": len(sents),
        "mask_rate": MASK_RATE,
        "mask_seed": seed,
        "seq_len": seq_len,
        "reference": reference,
    }
    return out, info


PROBE_BATCH = 8


def _main_output(outputs: dict) -> str:
    """The output a user reads first: the last hidden state, else the logits, else the first one."""
    return next((k for k in ("last_hidden_state", "logits") if k in outputs), next(iter(outputs)))


def probe_fidelity(
    entries, reference: str, *, seed: int = 0, batch: int = PROBE_BATCH, progress=None
) -> tuple[dict, dict]:
    """Fidelity of models without text input (ViT, CLIP, Whisper) to ``reference`` on seeded probe
    inputs of the right shape (images, audio features, decoder ids: architectures/probes.py).

    Per output (last hidden state, pooled output, logits …): the mean cosine between the model's and
    the reference's vectors along the last axis, the max |Δ| and the max |Δ| relative to the
    reference's largest value. ``hidden_cosine`` is the cosine of the main output (last hidden state,
    else logits), ``output_cosine`` the worst output's, ``max_abs_diff`` / ``max_rel_diff`` the worst
    over every output.
    """
    from normswap.architectures.probes import model_outputs, probe_inputs

    say = progress or (lambda msg: None)
    ref = next(e for e in entries if e.name == reference)
    inputs = probe_inputs(ref.model, batch=batch, seed=seed)
    say(
        f"fidelity: reference {reference} on probe inputs "
        f"{', '.join(f'{k} {list(v.shape)}' for k, v in inputs.items())}"
    )

    def outputs_of(model):
        device = _device(model)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        moved = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
        return {k: v.double().cpu() for k, v in model_outputs(model, moved, seed=seed).items()}

    ref_out = outputs_of(ref.model)
    main = _main_output(ref_out)
    out = {}
    for e in entries:
        say(f"fidelity: {e.name}")
        got = ref_out if e is ref else outputs_of(e.model)
        per = {}
        for key, r in ref_out.items():
            g = got.get(key)
            if g is None or g.shape != r.shape:
                raise NormswapError(
                    f"fidelity: {e.name} does not return {key} of shape {list(r.shape)} as {reference} does; "
                    "compare models of the same architecture"
                )
            diff = float((g - r).abs().max()) if r.numel() else 0.0
            cos = (
                torch.nn.functional.cosine_similarity(g.reshape(-1, r.shape[-1]), r.reshape(-1, r.shape[-1]), dim=-1)
                if r.dim() > 0 and r.shape[-1] > 1
                else None
            )
            per[key] = {
                "cosine": None if cos is None else cos.mean().item(),
                "max_abs_diff": diff,
                "max_rel_diff": diff / max(float(r.abs().max()), 1e-30),
            }
        cosines = [v["cosine"] for v in per.values() if v["cosine"] is not None]
        out[e.name] = {
            "reference": reference,
            "hidden_cosine": per[main]["cosine"],
            "output_cosine": min(cosines) if cosines else None,
            "max_abs_diff": max(v["max_abs_diff"] for v in per.values()),
            "max_rel_diff": max(v["max_rel_diff"] for v in per.values()),
            "main_output": main,
            "outputs": per,
            "embedding_cosine": None,
            "embedding_cosine_min": None,
            "sentences": 0,
            "tokens": 0,
            "masked_positions": 0,
            "masked_loss": None,
            "masked_perplexity": None,
            "top1_agreement": None,
        }
    info = {
        "reference": reference,
        "method": "probe inputs",
        "inputs": {k: list(v.shape) for k, v in inputs.items()},
        "seed": seed,
        "main_output": main,
    }
    return out, info
