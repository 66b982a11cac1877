"""`normswap slice SRC OUT` on disk: a checkpoint users load with stock transformers (normswap
installed or not), verified before it is published, and one-line refusals that write nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from normswap.assets.models import model_path

CALIBRATION = ("--calibration-tokens", "1024")


def _error_lines(err: str) -> list[str]:
    """The refusal itself: progress lines ("normswap: ...") may precede it; the error is one line."""
    return [line for line in err.splitlines() if line.startswith("normswap: error:")]


def _slice(src, out, *extra):
    from normswap.cli.main import main

    try:
        main(["slice", str(src), str(out), *CALIBRATION, *map(str, extra)])
    except SystemExit as e:
        assert e.code in (0, None), e.code


@pytest.fixture
def converted(built_once):
    """kjv-gpt2 converted exactly (tied head, final norm keeps γ: the head-adapter case)."""

    def build(path):
        from normswap.convert.pipeline import convert_checkpoint

        shutil.rmtree(path)
        convert_checkpoint(model_path("kjv-gpt2"), path)

    return built_once("slice-kjv-gpt2-converted", build)


@pytest.fixture
def sliced(built_once, converted):
    def build(path):
        shutil.rmtree(path)
        _slice(converted, path, "--fraction", "0.25")

    return built_once("slice-kjv-gpt2-sliced", build)


def test_sliced_checkpoint_declares_its_width_and_records_its_figures(sliced, converted):
    cfg = json.loads((sliced / "config.json").read_text())
    info = cfg["normswap"]["slice"]
    assert info["hidden_size"] == 128 and info["width"] == 96
    assert info["head_adapter"]["head"] == "lm_head"
    assert all(rec["hidden_size"] == 96 for rec in cfg["normswap"]["norms"].values())
    assert cfg["normswap"]["centered_outputs"] == []  # u deleted: nothing centred at run time
    # generate() uses the key/value cache as the source's does (the streamed writer once wrote the
    # run-time skeleton's use_cache=False into config.json)
    source_cfg = json.loads((Path(converted) / "config.json").read_text())
    assert cfg.get("use_cache", True) == source_cfg.get("use_cache", True) is not False
    figures = json.loads((sliced / "slice.json").read_text())
    assert figures["width"] == 96 and figures["verification"]["passed"]
    assert figures["parameters_after"] < figures["parameters_before"]
    assert set(figures["kept_energy"]) == set(cfg["normswap"]["norms"])
    assert all(0.9 < v <= 1 for v in figures["kept_energy"].values())
    card = (sliced / "README.md").read_text()
    assert "Sliced (normswap slice)" in card and "head adapter" in card and "transformer.h.0.ln_1" in card


def test_sliced_checkpoint_loads_without_normswap_installed(sliced, tmp_path):
    """AutoModelForCausalLM and AutoModel load it through the bundled modeling file alone and give
    normswap's own logits; the control: the same files without the declared width do not load."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['normswap'] = None\n")
    script = textwrap.dedent(f"""
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(sliced)!r}, trust_remote_code=True).eval()
        assert type(m.transformer.h[0].ln_1).__module__.startswith("transformers_modules")
        assert m.lm_head.weight is m.transformer.wte.weight and m.lm_head.weight.shape[1] == 96
        ids = torch.arange(20).unsqueeze(0)
        with torch.no_grad():
            torch.save(m(input_ids=ids).logits, {str(tmp_path / "logits.pt")!r})
            bare = AutoModel.from_pretrained({str(sliced)!r}, trust_remote_code=True).eval()
            assert bare(input_ids=ids).last_hidden_state.shape[-1] == 96
    """)
    env = dict(os.environ, PYTHONPATH=str(blocker))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import normswap

    with torch.no_grad():
        ours = normswap.load_model(sliced)(input_ids=torch.arange(20).unsqueeze(0)).logits
    assert torch.allclose(torch.load(tmp_path / "logits.pt"), ours, atol=1e-4)

    # control: without normswap.slice the class builds the 128-wide model, and the weights do not fit
    damaged = tmp_path / "no-width"
    shutil.copytree(sliced, damaged)
    cfg = json.loads((damaged / "config.json").read_text())
    del cfg["normswap"]["slice"]
    (damaged / "config.json").write_text(json.dumps(cfg))
    from transformers import AutoModelForCausalLM

    with pytest.raises(Exception, match="(?i)size|shape"):
        AutoModelForCausalLM.from_pretrained(damaged, trust_remote_code=True)


@pytest.mark.parametrize("planted", ["transformer.h.0.attn.c_proj.weight", "transformer.h.1.mlp.c_fc.weight"])
def test_a_wrong_rotation_of_one_writer_or_reader_is_refused(converted, tmp_path, run_cli, monkeypatch, planted):
    """One writer (c_proj) or reader (c_fc) rotated by the wrong matrix: the rotation-only check
    fails, exit 1, nothing published. The control is test_sliced_checkpoint_... (the same command
    without the plant publishes)."""
    import normswap.slice.streamed as streamed

    real = streamed.rotated_tensor

    def planted_tensor(key, value, stream, k, q):
        t = real(key, value, stream, k, q)
        if key != planted:
            return t
        axis = (stream.writes if planted in stream.writes else stream.reads)[planted]
        gen = torch.Generator().manual_seed(0)
        twist, _ = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64))
        return (t.movedim(axis, -1) @ twist.to(t.dtype)).movedim(-1, axis)

    monkeypatch.setattr(streamed, "rotated_tensor", planted_tensor)
    out = tmp_path / "out"
    code, stdout, err = run_cli("slice", converted, out, *CALIBRATION)
    assert code == 1, err
    assert "verification failed" in _error_lines(err)[0] and len(_error_lines(err)) == 1
    assert not out.exists()


def _tiny_checkpoint(path, model_type, **config):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.gpt2 import GPT2TokenizerFast

    cfg = AutoConfig.for_model(model_type, **config)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    GPT2TokenizerFast.from_pretrained(model_path("kjv-gpt2")).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "case",
    ["fraction-one", "fraction-zero", "fraction-negative", "no-text", "post-ln", "no-layernorm", "not-a-model"],
)
def test_bad_input_is_one_line_and_writes_nothing(case, converted, tmp_path, run_cli):
    src, extra, expect = converted, [], ""
    if case == "fraction-one":
        extra, expect = ["--fraction", "1"], "--fraction"
    elif case == "fraction-zero":
        extra, expect = ["--fraction", "0"], "--fraction"
    elif case == "fraction-negative":
        extra, expect = ["--fraction", "-0.1"], "--fraction"
    elif case == "no-text":
        (tmp_path / "tiny.txt").write_text("In the beginning.\n")
        extra, expect = ["--data", tmp_path / "tiny.txt"], "calibration text"
    elif case == "post-ln":  # OPT-350m's layout: the norm's output is the skip path
        src = _tiny_checkpoint(
            tmp_path / "opt-post",
            "opt",
            do_layer_norm_before=False,
            hidden_size=32,
            word_embed_proj_dim=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            vocab_size=4096,
            max_position_embeddings=64,
        )
        expect = "post-LN"
    elif case == "no-layernorm":  # a family without a plan: nothing normswap can convert (RMSNorm already)
        src = _tiny_checkpoint(
            tmp_path / "llama",
            "llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=4096,
        )
        expect = "RMSNorm"
    else:
        src, expect = tmp_path / "missing-model", "missing-model"
    out = tmp_path / "out"
    code, _, err = run_cli("slice", src, out, *CALIBRATION, *extra)
    assert code == 2, err
    assert len(_error_lines(err)) == 1 and expect in _error_lines(err)[0], err
    assert not out.exists()


def test_stock_export_refuses_a_sliced_checkpoint_and_onnx_runs_it(sliced, tmp_path, run_cli):
    code, _, err = run_cli("export", sliced, tmp_path / "stock", "--format", "stock")
    assert code == 2 and len(_error_lines(err)) == 1 and "sliced" in _error_lines(err)[0]
    assert not (tmp_path / "stock").exists()
    pytest.importorskip("onnxruntime")
    code, out, err = run_cli("export", sliced, tmp_path / "onnx", "--format", "onnx")
    assert code == 0, err
    assert "PASSED" in out  # onnxruntime's log-probs match the sliced model's (export verifies them)
    # and the graph generates: its cache is the attention's width, not the stream's, and greedy tokens
    # through it are the sliced model's (export's own check, 64 new tokens)
    from normswap.export import is_generation_ready

    assert "greedy tokens identical to PyTorch's for 64 new tokens" in out
    assert is_generation_ready(tmp_path / "onnx" / "model.onnx") == (True, "")
