"""The shipped reference model (normswap:kjv-gpt2), its listing, and `normswap models`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import checked_run

from normswap.assets.models import list_models, model_path
from normswap.data import load_text
from normswap.errors import NormswapError

NAME = "kjv-gpt2"
SHIPPED = ["kjv-gpt2", "kjv-neox"]  # one sequential-residual and one parallel-residual family
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # Everything here must work with no network at all.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module", params=SHIPPED)
def shipped(request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    meta = json.loads((path / "normswap_model.json").read_text())
    return model, tokenizer, meta


@torch.no_grad()
def _perplexity(model, ids: torch.Tensor, ctx: int, max_windows: int | None = None) -> float:
    """Non-overlapping ctx windows, every token but each window's first predicted (the method the
    training script records); written out again here so the recorded number is checked, not trusted."""
    windows = list(ids.split(ctx))[:max_windows]
    nll, count = 0.0, 0
    full = [w for w in windows if len(w) == ctx]
    groups = [torch.stack(full[i : i + 64]) for i in range(0, len(full), 64)] + [
        w[None] for w in windows if len(w) < ctx
    ]
    for w in groups:
        logits = model(w).logits.float()
        nll += torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), w[:, 1:].flatten(), reduction="sum"
        ).item()
        count += w[:, 1:].numel()
    return math.exp(nll / count)


def test_shipped_model_is_a_layernorm_lm_that_loads_offline_and_generates(shipped):
    model, tokenizer, meta = shipped
    cfg = model.config
    expected = {"gpt2": ("GPT2LMHeadModel", True), "gpt_neox": ("GPTNeoXForCausalLM", False)}
    cls, tied = expected[cfg.model_type]
    assert type(model).__name__ == cls and meta["family"] == cfg.model_type
    assert getattr(cfg, "layer_norm_epsilon", getattr(cfg, "layer_norm_eps", None)) == 1e-5
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 * cfg.num_hidden_layers + 1 and all(m.bias is not None for m in norms)
    # Trained norms: gains and biases moved away from their 1/0 initialisation.
    assert any(not torch.allclose(m.weight, torch.ones_like(m.weight)) for m in norms)
    assert any(m.bias.abs().max() > 1e-3 for m in norms)
    out_emb, in_emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (out_emb.data_ptr() == in_emb.data_ptr()) == tied
    assert meta["parameters"] == sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in model_path(meta["name"]).iterdir())
    assert size < 20e6, "shipped assets must stay a few MB"

    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    prompt = tokenizer("And God said unto Moses,", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    new = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    words = new.split()
    assert len(words) >= 5 and sum(w.strip(".,;:").isalpha() for w in words) >= 0.7 * len(words), new


def test_tokenizer_round_trips_held_out_text(shipped):
    _, tokenizer, _ = shipped
    text = load_text("embedded", "test")[:5000]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 4096
    # A real subword vocabulary, learned from the corpus: far fewer tokens than bytes.
    assert len(ids) < 0.4 * len(text.encode())


def test_recorded_heldout_perplexity_reproduces_and_beats_random_init(shipped):
    model, tokenizer, meta = shipped
    ctx = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    vocab = model.config.vocab_size
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI box is small and shared; one thread avoids oversubscription
    try:
        ids = torch.tensor(tokenizer(load_text("embedded", "validation"), add_special_tokens=False)["input_ids"])
        ppl = _perplexity(model, ids, ctx)
        torch.manual_seed(0)
        random_model = type(model)(model.config).eval()
        random_ppl = _perplexity(random_model, ids, ctx, max_windows=20)
    finally:
        torch.set_num_threads(threads)
    recorded = meta["evaluation"]["validation"]["perplexity"]
    assert ppl == pytest.approx(recorded, rel=5e-3)
    assert ppl < 0.2 * vocab, f"shipped model is barely trained: ppl {ppl:.1f} vs vocab {vocab}"
    # Negative control: the same architecture untrained sits at vocabulary-size perplexity.
    assert random_ppl > 0.5 * vocab
    assert meta["evaluation"]["test"]["perplexity"] < 0.2 * vocab


def test_list_models_and_model_path():
    rows = list_models()
    assert [r["name"] for r in rows] == sorted(SHIPPED)
    for row in rows:
        for key in ("name", "path", "family", "parameters", "perplexity", "description", "context_length"):
            assert row[key] is not None, key
        assert Path(row["path"]) == model_path(row["name"])
        assert 1e6 < row["parameters"] < 5e6
        assert row["perplexity"] < 0.2 * row["vocab_size"]
    assert {r["family"] for r in rows} == {"gpt2", "gpt_neox"}
    assert model_path(f"normswap:{NAME}") == model_path(NAME)
    with pytest.raises(NormswapError, match=rf"no shipped model named 'nope'; available: .*{NAME}"):
        model_path("nope")


def test_load_model_resolves_the_shipped_spec():
    import normswap

    for name, model_type in (("kjv-gpt2", "gpt2"), ("kjv-neox", "gpt_neox")):
        model = normswap.load_model(f"normswap:{name}")
        assert model.config.model_type == model_type
        assert normswap.load_tokenizer(f"normswap:{name}").eos_token == "<|endoftext|>"


def test_cli_models_json_and_table():
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    out = checked_run(
        [sys.executable, "-m", "normswap", "models", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert {"name", "path", "family", "parameters", "perplexity", "description"} <= set(rows[0])
    assert {r["name"] for r in rows} == set(SHIPPED)
    table = checked_run(
        [sys.executable, "-m", "normswap", "models"], capture_output=True, text=True, env=env, timeout=120
    )
    assert table.returncode == 0 and "VAL PPL" in table.stdout
    assert all(f"normswap:{n}" in table.stdout for n in SHIPPED)


@pytest.mark.slow
def test_training_script_smoke(tmp_path):
    """The script that produced the shipped model runs end to end and writes a loadable model."""
    out = tmp_path / "m"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "train_reference.py"),
            "--size",
            "test",
            "--out",
            str(out),
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "gpt2"
    tok = AutoTokenizer.from_pretrained(out)
    meta = json.loads((out / "normswap_model.json").read_text())
    assert meta["training"]["steps"] == 3 and meta["parameters"] == sum(p.numel() for p in model.parameters())
    assert len(tok) <= 512 and model.config.n_layer == 1
    assert not list(tmp_path.glob(".m.tmp-*"))  # written atomically: no temp dir left behind
