"""A converted checkpoint works wherever its original works (issue #25).

Real tiny randomised models (normswap/compat/rows.py: a BPE tokenizer trained on the embedded
corpus, the model type's processor, sentence-transformers files), converted with `normswap convert`,
loaded with stock transformers (trust_remote_code=True), each entry point compared with the original.
"""

import json
import shutil

import pytest
import torch
import transformers

from normswap.checkpoint.write import registered_classes
from normswap.compat import checks
from normswap.compat.rows import Row, all_rows, build_original, convert
from normswap.errors import NormswapError

ROWS = {r.name: r for r in all_rows()}


def _pair(tmp_path_factory, name):
    root = tmp_path_factory.mktemp(name)
    build_original(ROWS[name], root / "original")
    convert(root / "original", root / "converted")
    return root / "original", root / "converted"


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    """GPT-NeoX: untied head, so the final norm's γ/β are folded into embed_out."""
    return _pair(tmp_path_factory, "gpt_neox")


def _load(auto, directory, remote=False):
    return (
        getattr(transformers, auto)
        .from_pretrained(str(directory), trust_remote_code=remote, dtype=torch.float32)
        .eval()
    )


def _rel(a, b):
    return float((a - b).abs().max() / a.abs().max())


def test_auto_map_lists_every_auto_class_transformers_registers_for_the_model_type(neox):
    original, converted = neox
    cfg = json.loads((converted / "config.json").read_text())
    config = transformers.AutoConfig.from_pretrained(str(original))
    # the oracle: every Auto class whose own mapping accepts the original's config
    expected = {
        name
        for name in dir(transformers)
        if name.startswith("AutoModel")
        and isinstance(getattr(transformers, name), type)
        and hasattr(getattr(transformers, name), "_model_mapping")
        and type(config) in getattr(transformers, name)._model_mapping
    }
    assert {"AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification"} <= expected
    assert set(cfg["auto_map"]) - {"AutoConfig"} == expected
    for auto in expected:
        source_cls = getattr(transformers, auto)._model_mapping[type(config)]
        assert cfg["auto_map"][auto] == f"modeling_normswap.Normswap{source_cls.__name__}"
    bare = _load("AutoModel", converted, remote=True)
    assert isinstance(bare, transformers.GPTNeoXModel) and not hasattr(bare, "embed_out")


def test_bare_model_and_new_heads_read_the_original_hidden_states_when_the_final_norm_is_folded(neox, tmp_path):
    original, converted = neox
    cfg = json.loads((converted / "config.json").read_text())
    final = cfg["normswap"]["norms"]["gpt_neox.final_layer_norm"]
    assert final["gamma"] == "fold" and final["beta"] == "fold" and final["restore"] == ["weight", "bias"]
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = _load("AutoModel", original)(input_ids=ids).last_hidden_state
        got = _load("AutoModel", converted, remote=True)(input_ids=ids).last_hidden_state
        assert _rel(ref, got) <= 1e-5
        lm = _load("AutoModelForCausalLM", converted, remote=True)
        assert _rel(_load("AutoModelForCausalLM", original)(input_ids=ids).logits, lm(input_ids=ids).logits) <= 1e-5
    # the LM class carries γ/β for the others (a save keeps them) without training or applying them
    norm = lm.gpt_neox.final_layer_norm
    assert "folded_weight" in dict(norm.named_buffers()) and "folded_weight" not in dict(norm.named_parameters())
    lm.save_pretrained(tmp_path / "resaved")
    with torch.no_grad():
        again = _load("AutoModel", tmp_path / "resaved", remote=True)(input_ids=ids).last_hidden_state
    assert _rel(ref, again) <= 1e-5
    # control: without the record telling the bare model to apply them, its hidden states are wrong
    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)
    cfg["normswap"]["norms"]["gpt_neox.final_layer_norm"].pop("restore")
    (broken / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():
        wrong = _load("AutoModel", broken, remote=True)(input_ids=ids).last_hidden_state
    assert _rel(ref, wrong) > 1e-2


def test_every_auto_class_matches_the_original_with_the_same_newly_initialised_heads(neox):
    original, converted = neox
    cell = checks.check_auto_classes(original, converted, ROWS["gpt_neox"])
    assert cell.status == "ok", cell.detail
    assert set(cell.parts) == set(registered_classes("gpt_neox")) and max(cell.parts.values()) <= 1e-5


@pytest.mark.parametrize(
    "name, auto, bare",
    [
        ("whisper", "AutoModelForSpeechSeq2Seq", "WhisperModel"),
        ("vit", "AutoModelForImageClassification", "ViTModel"),
        ("gpt2", "AutoModelForSequenceClassification", "GPT2Model"),
    ],
)
def test_reported_failures_load_and_match(name, auto, bare, tmp_path_factory):
    """The issue's three: each class loads from the converted checkpoint and matches; AutoModel is the bare model."""
    original, converted = _pair(tmp_path_factory, name)
    assert type(_load("AutoModel", converted, remote=True)).__mro__[1] is getattr(transformers, bare)
    if name != "gpt2":  # the image / audio processor travels with the weights (pipeline() needs it)
        assert (converted / "preprocessor_config.json").read_text() == (
            original / "preprocessor_config.json"
        ).read_text()
    cell = checks.check_auto_classes(original, converted, ROWS[name])
    assert cell.status == "ok", cell.detail
    assert cell.parts[auto] <= 1e-5 and cell.parts["AutoModel"] <= 1e-5


def test_a_check_fails_on_a_damaged_conversion(neox, tmp_path):
    """Control for every check built on side_by_side: one changed weight is a ✗ with the number."""
    from safetensors.torch import load_file, save_file

    original, converted = neox
    damaged = tmp_path / "damaged"
    shutil.copytree(converted, damaged)
    weights = next(damaged.glob("*.safetensors"))
    tensors = load_file(weights)
    key = next(k for k in tensors if k.endswith("attention.dense.weight"))
    tensors[key] = tensors[key] * 1.01
    save_file(tensors, weights, metadata={"format": "pt"})
    cell = checks.check_auto_classes(original, damaged, ROWS["gpt_neox"])
    assert cell.status == "fail" and "relative difference" in cell.detail
    assert checks.check_round_trip(original, damaged, ROWS["gpt_neox"]).status == "fail"


@pytest.mark.parametrize("check", ["pipeline", "generate + KV cache", "save/load round trip", "Trainer", "PEFT LoRA"])
def test_entry_points_match_the_original(neox, check):
    original, converted = neox
    cell = checks.CHECKS[check](original, converted, ROWS["gpt_neox"])
    assert cell.status == "ok", cell.detail
    assert cell.max_rel_diff is not None and cell.max_rel_diff <= 1e-5


def test_sentence_transformers_files_are_carried_and_give_the_original_embeddings(tmp_path):
    """A pre-LN BERT-like encoder (XLM-RoBERTa-XL, exact) with CLS pooling and a Normalize module:
    the default a bare directory would get (mean pooling, no normalisation) gives other embeddings."""
    from sentence_transformers import SentenceTransformer

    row = ROWS["xlm-roberta-xl"]
    row = Row(row.name, row.model_type, "XLMRobertaXLModel", False, True)
    original = tmp_path / "original"
    build_original(row, original)
    modules = json.loads((original / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (original / "modules.json").write_text(json.dumps(modules))
    (original / "2_Normalize").mkdir()
    pooling = json.loads((original / "1_Pooling" / "config.json").read_text())
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (original / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    # a module file linked from outside the model directory is refused, by name, like a tokenizer file
    outside = tmp_path / "secret.txt"
    outside.write_text("not part of the model")
    (original / "1_Pooling" / "link.txt").symlink_to(outside)
    with pytest.raises(NormswapError, match="link.txt"):
        convert(original, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()
    (original / "1_Pooling" / "link.txt").unlink()
    convert(original, tmp_path / "converted")
    converted = tmp_path / "converted"
    for name in (
        "modules.json",
        "sentence_bert_config.json",
        "config_sentence_transformers.json",
        "1_Pooling/config.json",
    ):
        assert (converted / name).is_file(), name
    assert (converted / "2_Normalize").is_dir()
    ref = SentenceTransformer(str(original), device="cpu").encode(checks.TEXTS, convert_to_tensor=True)
    got = SentenceTransformer(str(converted), device="cpu", trust_remote_code=True).encode(
        checks.TEXTS, convert_to_tensor=True
    )
    assert _rel(ref, got) <= 1e-5
    # control: without the carried files SentenceTransformer falls back to mean pooling
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        (converted / name).unlink()
    shutil.rmtree(converted / "1_Pooling")
    bare = SentenceTransformer(str(converted), device="cpu", trust_remote_code=True).encode(
        checks.TEXTS, convert_to_tensor=True
    )
    assert bare.shape == ref.shape and _rel(ref, bare) > 1e-2


def test_matrix_command_writes_markdown_and_json(tmp_path, run_cli):
    # in a fresh process, as users run it: the matrix forks a child per row, and a child forked from a
    # process that has already run torch (this test session) may inherit a stuck thread pool
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "normswap",
            "families",
            "matrix",
            "--only",
            "gpt_neox",
            "--column",
            "auto classes",
            "--column",
            "save/load round trip",
            "--out",
            str(tmp_path / "m.md"),
            "--save-json",
            str(tmp_path / "m.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = json.loads((tmp_path / "m.json").read_text())
    assert saved["summary"]["cells_original_works"] == 2 and saved["summary"]["cells_converted_matches"] == 2
    cells = saved["rows"][0]["cells"]
    assert set(cells) == {"auto classes", "save/load round trip"} and all(c["status"] == "ok" for c in cells.values())
    md = (tmp_path / "m.md").read_text()
    assert "| gpt_neox | `GPTNeoXForCausalLM` | ✓ | ✓ |" in md and "**2 of 2 cells" in md
    code, out, _ = run_cli("families", "matrix", "--from-json", tmp_path / "m.json")
    assert code == 0 and out == md
    code, _, err = run_cli("families", "matrix", "--only", "no_such_model")
    assert code == 2 and "no matrix row named 'no_such_model'" in err and "Traceback" not in err
