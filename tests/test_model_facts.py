"""normswap/model_facts.py: the one rule for which modules are norms (and of which kind), and the one
reader of a model's context length, that convert, discovery, the fine-tune and the evaluation share."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig

from normswap.model_facts import (
    context_length,
    declared_eps,
    is_layernorm,
    is_rmsnorm,
    layout_of,
    norm_kind,
    norm_modules,
)
from normswap.modules import RMSNorm


def test_norm_kind_by_class_name():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    assert norm_kind(nn.LayerNorm(8)) == "layer" and is_layernorm(nn.LayerNorm(8))
    assert norm_kind(LlamaRMSNorm(8)) == "rms" and is_rmsnorm(LlamaRMSNorm(8))
    assert norm_kind(RMSNorm(8)) == "rms"
    assert norm_kind(T5LayerNorm(8)) == "rms" and not is_layernorm(T5LayerNorm(8))  # RMSNorm under a LayerNorm name
    assert norm_kind(nn.GroupNorm(2, 8)) == "other"
    assert norm_kind(nn.Linear(8, 8)) is None

    # negative control: a converted model's class is named Normswap...: "RMS" inside a word is not RMSNorm
    # (counted as a norm, its timing and diagnostics hooks ran on the whole model)
    NormswapGPT2LMHeadModel = type("NormswapGPT2LMHeadModel", (nn.Module,), {})
    assert norm_kind(NormswapGPT2LMHeadModel()) is None


def test_norm_modules_are_outermost_norms_in_module_order():
    Wrapper = type("OuterNorm", (nn.Module,), {})
    outer = Wrapper()
    outer.inner = nn.LayerNorm(4)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), outer, RMSNorm(4))
    assert [n for n, _ in norm_modules(model)] == ["1", "2", "3"]


def test_eps_and_layout():
    assert declared_eps(nn.LayerNorm(4, eps=1e-6)) == 1e-6
    assert declared_eps(nn.Linear(4, 4)) is None
    from transformers.pytorch_utils import Conv1D

    assert (
        layout_of(nn.Linear(2, 3)),
        layout_of(Conv1D(3, 2)),
        layout_of(nn.Embedding(5, 2)),
        layout_of(nn.ReLU()),
    ) == ("linear", "conv1d", "embedding", None)


def test_context_length_whatever_key_the_family_uses():
    assert context_length(AutoConfig.for_model("gpt2", n_positions=77)) == 77
    assert context_length(AutoConfig.for_model("gpt_neox", max_position_embeddings=99)) == 99
    assert (
        context_length(AutoConfig.for_model("clip", text_config={"max_position_embeddings": 33})) == 33
    )  # the text tower's
    assert context_length(AutoConfig.for_model("xlnet")) is None  # -1: no limit
    model = nn.Module()
    model.config = AutoConfig.for_model("gpt2", n_positions=12)
    assert context_length(model) == 12
    assert context_length(torch.nn.Linear(2, 2)) is None
