"""The default study's model: kjv-gpt2's architecture reading bytes (``--tokens bytes``).

Why bytes. The study asks whether RMSNorm trains as well as LayerNorm, and that question only has
an answer once the models have learned something a count model cannot: a loss both arms reach by
learning nothing is equal by construction. On the 2-core budget (≈ 0.8 M training tokens per arm)
the shipped BPE-4096 model never gets below the count bigram on the same tokens (measured: 1,200
steps, 4.713 vs 4.529 nats, by a quality probe run before this model was chosen): most of its 1.3 M
parameters are a 4096 × 128 embedding that a few hundred thousand tokens cannot train. The same
4 layers × 128 over a 257-entry vocabulary (each UTF-8 byte a token, plus end-of-text) put 0.84 M
of its parameters into the layers, and at 400 steps of 16 × 128 bytes reach 1.874 nats against the
byte bigram's 2.291 (a probe that was not committed) — the regime where the norm is doing work. The default reads
them as 32 windows of 64 bytes a step (config.py: more independent windows learn faster), and at
300 steps every arm ends 0.37-0.43 nats below the bigram (results/study-20261201T1642Z/).

The tokenizer is a real 🤗 fast tokenizer (byte-level BPE with no merges: token id = byte value,
GPT-2's byte-to-unicode alphabet), so TrainStream, the held-out blocks, the count baselines and
lm-eval read it like any other; nothing is downloaded.
"""

from __future__ import annotations

import copy

EOS = "<|endoftext|>"
VOCAB = 257  # 256 bytes + end-of-text
TOKENS = ("auto", "bytes", "model")  # --tokens; auto: bytes for the default study, MODEL's own otherwise


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE's alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer():
    """Token id = byte value (0-255), end-of-text 256; decode(encode(s)) == s for any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=EOS, model_max_length=1 << 20
    )


def byte_config(config):
    """``config`` with the byte vocabulary (its embedding and head resized, every other size kept)."""
    config = copy.deepcopy(config)
    config.vocab_size = VOCAB
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, VOCAB - 1)
    return config


def wants_bytes(tokens: str, model_given: bool) -> bool:
    return tokens == "bytes" or (tokens == "auto" and not model_given)


def describe(config) -> dict:
    """results.json ``setup.design``'s model part."""
    return {
        "tokens": "bytes",
        "vocab_size": VOCAB,
        "layers": getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", None),
        "width": getattr(config, "n_embd", None) or getattr(config, "hidden_size", None),
        "why": "kjv-gpt2's 4 × 128 architecture over bytes (32 windows of 64 bytes a step): at this budget "
        "the BPE-4096 model stays behind the "
        "count bigram (most of its parameters are an embedding too large to train on ~0.8 M tokens); over bytes "
        "the same layers learn past the byte bigram, where the norm has work to do (study/bytes_model.py)",
    }
