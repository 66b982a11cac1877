"""Speed, memory and diagnostics: sane numbers, no side effects on the models, and the
properties the report relies on."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from test_evaluate_fixtures import kjv_tokenizer, tiny_gpt2

from normswap.data import load_text
from normswap.evaluate.diagnostics import diagnostics, fixed_batch
from normswap.evaluate.memory import peak_memory, resident_bytes
from normswap.evaluate.throughput import SpeedConfig, measure_speed
from normswap.model_facts import norm_modules


def test_speed_numbers_are_sane_and_leave_the_weights_alone():
    a = tiny_gpt2(seed=0)
    b = copy.deepcopy(a)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    cfg = SpeedConfig(batch_size=2, seq_len=32, repeats=3, min_time=0.02, prompt_len=8, new_tokens=6)
    out = measure_speed([("a", a), ("b", b)], cfg)
    for name in ("a", "b"):
        tps = out[name]["tokens_per_second"]
        for key in ("forward", "train_step", "generate", "prefill", "decode"):
            assert math.isfinite(tps[key]) and tps[key] > 0, (name, key)
        assert 0 < out[name]["norm_time_share"] < 1
        assert out[name]["norm_time"]["layers"] == 5  # 2 blocks x (ln_1, ln_2) + ln_f
        # the norms are timed by the instrument: the forward's 5 norm calls replayed, paired with the baseline's
        assert out[name]["norm_time"]["calls_per_forward"] == 5
        assert out[name]["speed_setup"]["calls_per_measurement"]["norms"] >= 1
    assert out["b"]["speed_setup"]["paired"]["norms"]["pairs"] == 3 and "norms" not in out["a"]["speed_setup"]["paired"]
    # that the numbers follow the model they name is tests/test_speed_sensitivity.py's job (a known
    # slowdown must show); a ratio range here would pass for almost any timing code
    # lr=0 AdamW steps ran, yet every weight is bit-identical and the model is back in eval mode.
    for k, v in a.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not a.training


def test_norm_modules_found_by_class_name_outermost_only():
    from normswap.convert import convert_model

    model = tiny_gpt2()
    assert [n for n, _ in norm_modules(model)] == [
        "transformer.h.0.ln_1",
        "transformer.h.0.ln_2",
        "transformer.h.1.ln_1",
        "transformer.h.1.ln_2",
        "transformer.ln_f",
    ]
    convert_model(model, mode="exact")
    assert {type(m).__name__ for _, m in norm_modules(model)} == {"RMSNorm"}
    assert len(norm_modules(model)) == 5


def test_peak_memory_counts_the_step_and_grows_with_the_batch():
    model = tiny_gpt2(n_embd=128)
    small = peak_memory(model, 1, 32)
    large = peak_memory(model, 8, 32)
    # the tracker is part of the torch normswap pins: its absence is a failure, not a skip
    assert small["peak_memory_bytes"] is not None, f"no CPU memory tracker: {small.get('reason')}"
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # At least weights + AdamW's two moments are alive at the peak.
    assert small["peak_memory_bytes"] >= 3 * weights
    # Resident after the step: weights plus AdamW's exp_avg and exp_avg_sq (and step counters).
    assert (
        3 * weights
        <= small["resident_bytes"]
        <= 3 * weights + resident_bytes(model) + 8 * len(list(model.parameters()))
    )
    assert large["peak_memory_bytes"] > small["peak_memory_bytes"]
    assert large["breakdown"]["activation"] > small["breakdown"]["activation"]


def test_diagnostics_loss_matches_the_model_and_exact_conversion_centres_the_stream():
    from normswap.convert import convert_model

    tok = kjv_tokenizer()
    text = load_text("embedded", "test")[:4000]
    batch = fixed_batch(tok, text, 2, 64)
    assert batch.shape == (2, 64)
    model = tiny_gpt2(seed=5)
    before = diagnostics(model, batch)
    with torch.no_grad():
        direct = float(model(input_ids=batch, labels=batch).loss)
    assert before["loss"] == pytest.approx(direct, rel=1e-6)
    assert before["grad_norm"] > 0
    assert all(p.grad is None for p in model.parameters())  # diagnostics leave no gradients behind

    converted = copy.deepcopy(model)
    convert_model(converted, mode="exact")
    after = diagnostics(converted, batch)
    assert after["loss"] == pytest.approx(before["loss"], rel=1e-4)
    assert [lay["name"] for lay in after["layers"]] == [lay["name"] for lay in before["layers"]]
    # Before: the inputs of the norms have a per-token mean (LayerNorm removes it); after an
    # exact conversion the residual stream is centred, so RMSNorm's input has none.
    assert max(lay["token_mean_abs"] for lay in before["layers"]) > 1e-3
    assert max(lay["token_mean_abs"] for lay in after["layers"]) < 1e-5
    for b, a in zip(before["layers"], after["layers"]):
        assert a["rms"] <= b["rms"] + 1e-6  # centring can only lower the RMS


def test_compiled_speed_compares_compiled_models():
    """--compile: both models run under torch.compile (Inductor) and the speed setup says so;
    per-module norm timing, which would break the compiled graph, is left out."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    a = tiny_gpt2(seed=0)
    b = copy.deepcopy(a)
    cfg = SpeedConfig(
        batch_size=2,
        seq_len=16,
        repeats=1,
        min_time=0.0,
        max_calls=1,
        kinds=("forward", "train_step", "norm_share"),
        compile=True,
    )
    out = measure_speed([("a", a), ("b", b)], cfg)
    # one graph serves both (same class; parameters are graph inputs), none if nothing was compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "the models were not compiled"
    for name in ("a", "b"):
        # the training step runs through the compiled module too (a truthiness test on it used to raise)
        assert out[name]["tokens_per_second"]["forward"] > 0 and out[name]["tokens_per_second"]["train_step"] > 0
        assert out[name]["norm_time_share"] is None
    assert not isinstance(a.forward, torch.nn.Module) and type(a).__name__ == "GPT2LMHeadModel"  # models not replaced


def test_compiled_models_each_get_their_own_recompile_budget(monkeypatch):
    """Models of one class share Dynamo's per-code-object graph cap; past it the later models ran
    eager (compiled decode measured at half speed). The cap scales with the number of models for
    the measurement only."""
    import torch._dynamo

    from normswap.evaluate import throughput

    seen = []
    monkeypatch.setattr(
        throughput,
        "_measure",
        lambda benches, cfg, *_: seen.append(torch._dynamo.config.recompile_limit) or ({}, {}),
    )
    default = torch._dynamo.config.recompile_limit
    a = tiny_gpt2(seed=0)
    models = [("a", a), ("b", copy.deepcopy(a)), ("c", copy.deepcopy(a))]
    throughput.measure_speed(models, SpeedConfig(repeats=1, compile=True))
    throughput.measure_speed(models, SpeedConfig(repeats=1, compile=False))
    assert seen == [3 * default, default]  # control: eager measurement leaves the cap alone
    assert torch._dynamo.config.recompile_limit == default  # restored afterwards


def test_a_model_without_norm_layers_has_no_norm_time_rather_than_a_zero_one():
    """Nothing to replay: the norms are not timed (an empty replay would time the loop alone and call
    the model's norms free), and the forward it would be a share of is not timed for it either."""
    a = tiny_gpt2(seed=0)
    b = copy.deepcopy(a)
    for block in b.transformer.h:
        block.ln_1, block.ln_2 = torch.nn.Identity(), torch.nn.Identity()
    b.transformer.ln_f = torch.nn.Identity()
    assert not norm_modules(b) and norm_modules(a)
    cfg = SpeedConfig(batch_size=2, seq_len=16, repeats=3, min_time=0.0, kinds=("norm_share",))
    out = measure_speed([("a", a), ("b", b)], cfg)
    assert out["a"]["norm_time"]["calls_per_forward"] == 5 and out["a"]["norm_time_share"] > 0
    assert out["b"]["norm_time"] is None and out["b"]["norm_time_share"] is None
    assert not out["b"]["speed_setup"]["paired"] and out["b"]["tokens_per_second"] == {}


def test_generate_fits_its_speed_budget_warm_up_included(monkeypatch):
    """A block of `generate` is one whole generation (a second or more for a large model decoding
    eagerly) and the instrument checks its budget only between rounds, so on the GPU the kind ran past
    --speed-budget. Counted beforehand from one timed generation, the pairs and the warm-up fit the
    budget. A virtual clock: each generation takes 1 s of it, nothing else any time."""
    from types import SimpleNamespace

    from normswap.evaluate import throughput

    now = [0.0]
    monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(throughput.ModelBench, "_generate", lambda self: now.__setitem__(0, now[0] + 1.0))
    a = tiny_gpt2(seed=0)
    cfg = SpeedConfig(batch_size=1, seq_len=8, prompt_len=4, new_tokens=2, speed_budget=40.0, warmup=1)
    benches = [
        throughput.ModelBench(n, m, cfg) for n, m in (("a", a), ("b", copy.deepcopy(a)), ("null", copy.deepcopy(a)))
    ]
    cmp = throughput.compare_kind(benches, "generate", cfg, "a", "null")
    spent = now[0] - 1.0  # after the first call, which pays lazy initialisation and is no measurement
    # 1 timed + 3 warm-up + 4 rounds x 2 pairs x 2 blocks x 2 generations = 36 s of a 40 s budget
    assert cmp.stop_reason == "max_pairs" and cmp["b"].pairs == 4 and spent == 36.0
    # negative control: a budget that fits no round still gets one pair, not none
    now[0] = 0.0
    small = throughput.compare_kind(benches, "generate", dataclasses.replace(cfg, speed_budget=2.0), "a", "null")
    assert small["b"].pairs == 1
