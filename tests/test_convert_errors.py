"""Bad input, atomic output, and loading the output where normswap is not installed."""

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import paused_cli
import pytest
import torch
from helpers import tiny_model

from normswap import publish


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def gpt2_src(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "gpt2"
    tiny_model("gpt2").save_pretrained(path)
    return path


def _one_line_error(code, err, needle):
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("normswap: error:")]
    assert len(lines) == 1 and needle in lines[0], err


def test_missing_source(tmp_path, run_cli):
    code, _, err = run_cli("convert", tmp_path / "nothere", tmp_path / "out")
    _one_line_error(code, err, "model not found")
    assert not (tmp_path / "out").exists()


def test_source_not_a_model(tmp_path, run_cli):
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli("convert", tmp_path / "empty", tmp_path / "out")
    _one_line_error(code, err, "no config.json")
    (tmp_path / "file.txt").write_text("hello")
    code, _, err = run_cli("convert", tmp_path / "file.txt", tmp_path / "out")
    _one_line_error(code, err, "is a file")


def test_unsupported_architecture_lists_families(tmp_path, run_cli):
    from transformers import BartConfig, BartForCausalLM, CLIPVisionConfig, CLIPVisionModel

    # no family file and a discovered plan that cannot be exact (the raw stream is an output)
    CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
    ).save_pretrained(tmp_path / "clip")
    code, _, err = run_cli("convert", tmp_path / "clip", tmp_path / "out")
    _one_line_error(code, err, "unsupported architecture")
    assert "GPT-2" in err and "Falcon" in err
    # control: a post-LN model without a family file (BART's decoder, whose bare model is a wrapper
    # transformers does not export) converts approximately and loads
    BartForCausalLM(
        BartConfig(
            vocab_size=128,
            d_model=32,
            decoder_layers=1,
            encoder_layers=1,
            decoder_attention_heads=2,
            encoder_attention_heads=2,
            decoder_ffn_dim=64,
            encoder_ffn_dim=64,
        )
    ).save_pretrained(tmp_path / "bart")
    code, _, err = run_cli("convert", tmp_path / "bart", tmp_path / "bart-out")
    assert code == 0, err


def test_rmsnorm_model_has_nothing_to_convert(tmp_path, run_cli):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    ).save_pretrained(tmp_path / "llama")
    code, _, err = run_cli("convert", tmp_path / "llama", tmp_path / "out")
    _one_line_error(code, err, "nothing to convert")


def test_already_converted_is_refused(gpt2_src, tmp_path, run_cli):
    assert run_cli("convert", gpt2_src, tmp_path / "once")[0] == 0
    code, _, err = run_cli("convert", tmp_path / "once", tmp_path / "twice")
    _one_line_error(code, err, "already converted")


@pytest.mark.parametrize("damage", ["truncate", "corrupt_header"])
def test_damaged_weights(gpt2_src, tmp_path, run_cli, damage):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(gpt2_src, src)
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64 + data[64:])
    code, _, err = run_cli("convert", src, tmp_path / "out")
    _one_line_error(code, err, "corrupted safetensors")
    assert not (tmp_path / "out").exists()


def test_out_exists_and_force_and_out_equal_src(gpt2_src, tmp_path, run_cli):
    before = _tree_hash(gpt2_src)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, _, err = run_cli("convert", gpt2_src, out)
    _one_line_error(code, err, "already exists")
    assert (out / "keep.txt").read_text() == "precious"
    assert run_cli("convert", gpt2_src, out, "--force")[0] == 0
    assert (out / "config.json").exists() and not (out / "keep.txt").exists()
    code, _, err = run_cli("convert", gpt2_src, gpt2_src, "--force")
    _one_line_error(code, err, "which this command reads")
    code, _, err = run_cli("convert", gpt2_src, gpt2_src / "inside")
    _one_line_error(code, err, "which this command reads")
    assert _tree_hash(gpt2_src) == before  # the source is never modified
    leftovers = [p.name for p in tmp_path.iterdir() if ".normswap-staging-" in p.name or ".normswap.lock" in p.name]
    assert not leftovers


def test_debug_shows_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "normswap", "--debug", "convert", str(tmp_path / "nope"), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_kill_during_conversion_leaves_no_partial_output(tmp_path):
    """SIGKILL while the checkpoint is being written: OUT is absent, never half-written."""
    src = tmp_path / "src"
    tiny_model("gpt2", n_layer=6, n_embd=256, vocab_size=4096).save_pretrained(src)
    out = tmp_path / "out"
    # the child stops itself once its weights file is in the staging directory (tests/paused_cli.py)
    proc = paused_cli.start(
        f"{paused_cli.escape_dir(tmp_path)}/.out{publish.STAGING_TAG}*/*.safetensors", "convert", src, out
    )
    assert paused_cli.wait_paused(proc), proc.communicate(timeout=120)[1][-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert [p for p in tmp_path.iterdir() if publish.STAGING_TAG in p.name]  # killed while staging...
    assert not out.exists()  # ...and OUT never appeared

    # and a conversion allowed to finish publishes a complete, loadable OUT
    subprocess.run(
        [sys.executable, "-m", "normswap", "convert", str(src), str(out)], check=True, capture_output=True, timeout=600
    )
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True) is not None


def test_output_loads_without_normswap_installed(gpt2_src, tmp_path, run_cli):
    assert run_cli("convert", gpt2_src, tmp_path / "out")[0] == 0
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['normswap'] = None\n")
    script = textwrap.dedent(f"""
        import torch, transformers
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(tmp_path / "out")!r}, trust_remote_code=True).eval()
        norm = m.transformer.h[0].ln_1
        assert type(norm).__module__.startswith("transformers_modules"), type(norm).__module__
        ids = torch.arange(20).unsqueeze(0)
        torch.save(m(input_ids=ids).logits, {str(tmp_path / "logits.pt")!r})
    """)
    env = dict(os.environ, PYTHONPATH=str(blocker))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import normswap

    with torch.no_grad():
        ours = normswap.load_model(tmp_path / "out")(input_ids=torch.arange(20).unsqueeze(0)).logits
    assert torch.allclose(torch.load(tmp_path / "logits.pt"), ours, atol=1e-5)


def test_loading_without_trust_remote_code_fails_loudly(gpt2_src, tmp_path, run_cli):
    from transformers import AutoModelForCausalLM

    assert run_cli("convert", gpt2_src, tmp_path / "out")[0] == 0
    # the stock class would build LayerNorm: the weights are the "normswap" variant, so it finds none
    with pytest.raises(OSError, match="no file named model.safetensors"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True) is not None


def test_checkpoint_missing_a_weight_is_refused(gpt2_src, tmp_path, run_cli):
    """transformers would fill a missing tensor with random numbers and only warn."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(gpt2_src, src)
    tensors = load_file(src / "model.safetensors")
    tensors.pop("transformer.h.1.mlp.c_fc.weight")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run_cli("convert", src, tmp_path / "out")
    _one_line_error(code, err, "lacks 1 tensor")
    assert not (tmp_path / "out").exists()
