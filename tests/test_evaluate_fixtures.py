"""Shared builders for the eval/report tests: a real byte-level BPE trained on the embedded
corpus and tiny GPT-2 checkpoints saved as real safetensors directories.

(Imported by tests/test_evaluate*.py and tests/test_report*.py; it holds no tests itself.)
"""

from __future__ import annotations

import functools
import itertools

import torch


@functools.cache
def kjv_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from normswap.data import load_documents

    docs = list(itertools.islice(load_documents("embedded", "train"), 200))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def tiny_gpt2(seed: int = 0, n_positions: int = 128, vocab_size: int = 512, n_layer: int = 2, n_embd: int = 64):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=4,
        vocab_size=vocab_size,
        n_positions=n_positions,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    # Randomise the norms' affine parameters so LayerNorm's centring and beta matter.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.normal_(1.0, 0.2)
                m.bias.normal_(0.0, 0.2)
    return model.eval()


def save_tiny(path, seed: int = 0, **kwargs):
    model = tiny_gpt2(seed, **kwargs)
    model.save_pretrained(path)
    kjv_tokenizer().save_pretrained(path)
    return str(path)
