"""Tiny randomised instances of an architecture: its config shrunk to a few layers of width 64, built
in float64 with γ far from 1 and β and biases non-zero, so a wrong conversion cannot pass by luck
and a forward pass costs milliseconds. Discovery traces one; the family check converts another.
"""

from __future__ import annotations

import copy

import torch

from normswap.errors import DiscoveryError, first_line

_SIZES = {
    # config attribute -> tiny value (applied to the config and every sub-config that has it)
    "num_hidden_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "num_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "embed_dim": 64,
    "dim": 64,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "n_inner": 128,
    "hidden_dim": 128,
    "projection_dim": 32,
    "projection_size": 64,
    "head_dim": 16,
    "kv_channels": 16,
    "rotary_dim": 8,
    "image_size": 32,
    "patch_size": 8,
    "max_source_positions": 32,
    "max_target_positions": 64,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "vocab_size": 256,
}


def shrink_config(config):
    """A copy of ``config`` with tiny sizes, so a float64 instance costs milliseconds."""
    config = copy.deepcopy(config)

    def visit(cfg, depth=0):
        if depth > 2:
            return
        for attr, value in _SIZES.items():
            have = getattr(cfg, attr, None)
            if isinstance(have, int) and not isinstance(have, bool) and have > value:
                try:
                    setattr(cfg, attr, value)
                except Exception:
                    pass
        for attr in ("num_heads", "num_attention_heads"):
            heads = getattr(cfg, attr, None)
            if isinstance(heads, (list, tuple)) and heads and all(isinstance(h, int) and h > 0 for h in heads):
                # per-stage heads (Swin's 3, 6, 12, 24) must divide the shrunk widths: powers of two do
                setattr(cfg, attr, [1 << (h.bit_length() - 1) for h in heads])
        kv = getattr(cfg, "num_key_value_heads", None)
        if isinstance(kv, int) and kv > 1:
            cfg.num_key_value_heads = 2
        elif (
            "num_key_value_heads" in vars(cfg)
            and kv is None
            and isinstance(getattr(cfg, "num_attention_heads", None), int)
        ):
            cfg.num_key_value_heads = cfg.num_attention_heads  # None means "as many as query heads"
        vocab = getattr(cfg, "vocab_size", None)
        for attr in (
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
            "decoder_start_token_id",
            "sep_token_id",
            "cls_token_id",
        ):
            v = getattr(cfg, attr, None)
            if isinstance(vocab, int) and isinstance(v, int) and v >= vocab:
                setattr(cfg, attr, vocab - 1)
        for attr in ("layer_types",):
            v = getattr(cfg, attr, None)
            n = getattr(cfg, "num_hidden_layers", None)
            if isinstance(v, list) and isinstance(n, int):
                setattr(cfg, attr, v[:n])
        for name in list(vars(cfg)):
            sub = getattr(cfg, name, None)
            if hasattr(sub, "to_dict") and sub is not cfg and hasattr(sub, "model_type"):
                visit(sub, depth + 1)

    visit(config)
    return config


def model_class(config):
    from normswap.checkpoint.load import model_class_for

    return model_class_for(config)


def tiny_instance(config, cls=None, *, seed=0, shrink=True, dtype=torch.float64):
    """A randomised float64 (or ``dtype``) model of ``config``'s architecture (γ far from 1, β and biases non-zero)."""
    from normswap.architectures.randomize import randomize_

    cfg = shrink_config(config) if shrink else copy.deepcopy(config)
    cls = cls or model_class(cfg)
    torch.manual_seed(seed)
    try:
        model = cls.from_config(cfg) if hasattr(cls, "from_config") else cls._from_config(cfg)
    except Exception as e:
        raise DiscoveryError(
            f"cannot build a tiny {getattr(cfg, 'model_type', '?')} model: {first_line(e, 200)}"
        ) from None
    model = model.to(dtype).eval()
    randomize_(model, seed)
    return model
