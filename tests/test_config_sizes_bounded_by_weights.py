"""Every size normswap's loader builds from its own config block is bounded by the weights (issue #57, case 2).

A converted model's ``added_biases`` and a sliced model's width and head adapter are read from the
``normswap`` block of config.json and allocated when the model is built: ``added_biases`` of 5e8 on one
of Falcon's attention linears grew a load by 2 GB before a raw RuntimeError, and a sliced config whose
width was 200,000 beside weights 32 wide asked for a 160 GB head adapter. Now every such size is checked
against the safetensors headers (nothing loaded) before any model is built: one line naming the field,
under a 4 GB address-space cap. Where the shipped modeling_normswap.py runs alone (stock transformers,
no normswap installed), each size is bounded by the module it belongs to as the source class built it.
Controls: the checkpoints as written load, through normswap and through stock transformers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import ADDRESS_SPACE_CAP, normswap_capped, tiny_model, tiny_wordpiece
from safetensors.torch import load_file, save_file

from normswap.checkpoint.load import load_model
from normswap.errors import NormswapError

EVAL = ("eval", "ppl", "--quiet", "--max-tokens", "64", "--seq-len", "16")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{name: converted checkpoint}: Falcon (its attention and MLP linears gain biases) and GPT-2
    given a slice block of its own width with a head adapter (a sliced checkpoint's structure,
    built without calibration)."""
    from normswap.convert.pipeline import convert_checkpoint

    root = tmp_path_factory.mktemp("bounded")
    out = {}
    for family, kw in (("falcon", {}), ("gpt2", dict(n_layer=2, n_embd=32, n_head=2))):
        src = root / f"{family}-src"
        tiny_model(family, vocab_size=256, **kw).save_pretrained(src)
        tiny_wordpiece().save_pretrained(src)
        convert_checkpoint(str(src), root / family, verify=False)
        out[family] = root / family
    gpt2 = out["gpt2"]
    cfg = json.loads((gpt2 / "config.json").read_text())
    # as slice writes it: the final norm's γ and β live in the head adapter and bias, not in the norm
    cfg["normswap"]["logits_bias"] = {}
    cfg["normswap"]["norms"]["transformer.ln_f"].update(gamma="fold", weight=False)
    for key in ("logits_bias", "restore"):
        cfg["normswap"]["norms"]["transformer.ln_f"].pop(key)
    cfg["normswap"]["slice"] = {
        "width": 32,
        "hidden_size": 32,
        "stream_dims": {"transformer.wte.weight": [1]},
        "head_adapter": {"head": "lm_head", "norm": "transformer.ln_f"},
    }
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    weights = gpt2 / "model.normswap.safetensors"
    tensors = {k: v for k, v in load_file(weights).items() if not k.startswith("transformer.ln_f.")}
    tensors.update(
        {
            "lm_head.adapter": torch.eye(32),
            "lm_head.adapter_u": torch.zeros(32),
            "lm_head.row_means": torch.zeros(256),
        }
    )
    save_file(tensors, weights, metadata={"format": "pt"})
    out["sliced"] = gpt2
    return out


def _edited(src: Path, dest: Path, change) -> Path:
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    change(cfg["normswap"])
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def _huge_bias(block):
    name = next(n for n in sorted(block["added_biases"]) if "query_key_value" in n)
    block["added_biases"][name] = 1_000_000_000  # 4 GB of float32 for a 96-wide linear's bias


def _huge_slice(block):
    block["norms"] = {}  # no norm's record pins the width
    block["slice"].update(width=200_000, hidden_size=200_000, stream_dims={})  # a 160 GB head adapter


def _refused(code, err, *needles):
    lines = [line for line in err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert all(n in lines[0] for n in needles), lines[0]


def test_an_added_bias_larger_than_its_stored_tensor_is_refused_before_any_build(tmp_path, converted):
    bad = _edited(converted["falcon"], tmp_path / "bad", _huge_bias)
    code, err = normswap_capped(*EVAL, bad, timeout=180)
    _refused(code, err, "added_biases[", "query_key_value", "[1000000000]", "store it as [96]")
    # the control: the checkpoint as written loads, its added biases as stored
    model = load_model(str(converted["falcon"]))
    assert model.transformer.h[0].self_attention.query_key_value.bias.shape == (96,)


def test_a_sliced_width_no_weight_backs_is_refused_before_the_head_adapter_is_built(tmp_path, converted):
    bad = _edited(converted["sliced"], tmp_path / "bad", _huge_slice)
    code, err = normswap_capped(*EVAL, bad, timeout=180)
    _refused(code, err, "normswap.slice.width is 200,000", "largest: 256")
    # within the largest dimension, but not the stored adapter's: refused by the adapter's own shape
    bad = _edited(converted["sliced"], tmp_path / "bad2", lambda b: (_huge_slice(b), b["slice"].update(width=24)))
    with pytest.raises(NormswapError, match=r"slice.head_adapter builds lm_head.adapter of shape \[24, 24\], but the "):
        load_model(str(bad))
    # the control: the sliced structure as written loads, with its head adapter
    model = load_model(str(converted["sliced"]))
    assert type(model.lm_head).__name__ == "_SlicedTiedHead" and model.lm_head.adapter.shape == (32, 32)


def _stock_load(directory: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True) in a child with no
    normswap importable, under the 4 GB address-space cap: the shipped modeling_normswap.py alone."""
    import resource

    blocker = tmp_path / "block"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['normswap'] = None\n")
    script = textwrap.dedent(f"""
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(directory)!r}, trust_remote_code=True)
        except ValueError as e:
            print("refused:", e)
        else:
            print("loaded")
    """)

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_CAP, ADDRESS_SPACE_CAP))

    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(blocker), "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180, preexec_fn=cap
    )


@pytest.mark.parametrize("case", ["falcon", "sliced"])
def test_the_shipped_modeling_file_bounds_each_size_by_its_module(tmp_path, converted, case):
    change = _huge_bias if case == "falcon" else _huge_slice
    bad = _edited(converted[case], tmp_path / "bad", change)
    r = _stock_load(bad, tmp_path)
    field = "normswap.added_biases[" if case == "falcon" else "normswap.slice.width"
    assert "refused:" in r.stdout and field in r.stdout and "larger than the module" in r.stdout, (
        r.stdout + r.stderr[-2000:]
    )
    # the control: the checkpoint as written loads through the same file alone
    r = _stock_load(converted[case], tmp_path)
    assert r.stdout.strip().endswith("loaded"), r.stdout + r.stderr[-2000:]
