"""finetune/step.py: the one optimizer step the fine-tune and the study share — its schedule, its
refusal of a non-finite step (weights unchanged), and the fp16 loss scaler's skip; each with the
ordinary step beside it as the negative control."""

from __future__ import annotations

import math

import pytest
import torch

from normswap.finetune.step import Schedule, TrainStep, precision_for


def _step(precision="fp32", clip=1.0):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, TrainStep(
        model, opt, Schedule(1e-2, 10, 2, kind="cosine", min_ratio=0.1), clip, precision_for(precision, "cpu")
    )


def test_schedule_warms_up_then_decays_to_the_floor():
    s = Schedule(1.0, 10, 2, kind="cosine", min_ratio=0.1)
    assert [round(s.lr(t), 6) for t in (1, 2)] == [0.5, 1.0]
    assert s.lr(10) == pytest.approx(0.1) and s.describe()["final_lr"] == pytest.approx(0.1)
    assert all(s.lr(t) >= s.lr(t + 1) for t in range(2, 10))
    assert Schedule(1.0, 10, 2, kind="constant").lr(10) == 1.0  # negative control: no decay
    with pytest.raises(ValueError):
        Schedule(1.0, 10, 2, kind="exponential")


def test_a_finite_step_updates_and_a_non_finite_one_is_refused():
    model, step = _step()
    x = torch.randn(8, 4)
    before = model.weight.detach().clone()
    assert step.begin(1) == pytest.approx(5e-3)
    loss = step.loss(lambda: model(x).pow(2).mean())
    step.backward(loss)
    norm = step.clip()
    up = step.update(float(loss), norm)
    assert up.applied and not torch.equal(model.weight, before)  # the ordinary step changes the weights
    assert all(p.grad is None for p in model.parameters())
    after = model.weight.detach().clone()
    loss = step.loss(lambda: model(x).pow(2).mean() * float("inf"))
    step.backward(loss)
    up = step.update(float(loss), step.clip())
    assert not up.applied and up.refused == "loss" and torch.equal(model.weight, after)


def test_fp16_overflow_is_skipped_by_the_scaler_not_applied():
    model, step = _step("fp16")
    assert step.scaler is not None and step.precision.dtype == torch.float16
    x = torch.randn(8, 4)
    before = model.weight.detach().clone()
    step.begin(1)
    loss = step.loss(lambda: model(x).float().pow(2).mean())
    step.backward(loss)
    for p in model.parameters():  # an overflowing gradient, as fp16 produces
        p.grad.fill_(float("inf"))
    up = step.update(float(loss), step.clip())
    assert up.skipped and not up.applied and torch.equal(model.weight, before) and math.isfinite(float(loss))


def test_param_groups_decay_matrices_only_for_finetune_and_study():
    """One rule for both callers: matrices and embeddings decay; norms, biases and scalars never."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from normswap.finetune.step import param_groups

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, n_positions=8, vocab_size=16))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])
    named = dict(model.named_parameters())
    assert any(p is named["transformer.ln_f.weight"] for p in no_decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == sum(p.numel() for p in named.values())


def test_run_is_the_whole_step_and_its_loss_hook_can_refuse_it():
    model, step = _step()
    x = torch.randn(8, 4)
    before = model.weight.detach().clone()
    loss, norm, up = step.run(lambda: model(x).pow(2).mean(), 1)
    assert up.applied and math.isfinite(loss) and norm > 0 and not torch.equal(model.weight, before)
    after = model.weight.detach().clone()
    loss, _, up = step.run(lambda: model(x).pow(2).mean(), 2, loss_hook=lambda v: v * float("inf"))
    assert up.refused == "loss" and torch.equal(model.weight, after)  # negative control: nothing applied
