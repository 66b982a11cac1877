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


def _damaged(converted, tmp_path, weight="attention.dense.weight"):
    """A copy of the converted checkpoint with one attention weight 1 % off."""
    from safetensors.torch import load_file, save_file

    damaged = tmp_path / "damaged"
    shutil.copytree(converted, damaged)
    weights = next(damaged.glob("*.safetensors"))
    tensors = load_file(weights)
    key = next(k for k in tensors if k.endswith(weight))
    tensors[key] = tensors[key] * 1.01
    save_file(tensors, weights, metadata={"format": "pt"})
    return damaged


def test_a_check_fails_on_a_damaged_conversion(neox, tmp_path):
    """Control for every check built on side_by_side: one changed weight is a ✗ with the number."""
    original, converted = neox
    damaged = _damaged(converted, tmp_path)
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
    env["NORMSWAP_CACHE_DIR"] = str(tmp_path / "cache")  # the row cache: this test's own
    # ... without the compiled CPU kernel, which a fresh cache would build again (a minute of CPU) for
    # cells that compare outputs with any RMSNorm implementation
    env["NORMSWAP_CPU_KERNEL"] = "0"

    def matrix(name):
        args = ["families", "matrix", "--only", "gpt_neox", "--column", "auto classes"]
        args += [
            "--column",
            "save/load round trip",
            "--out",
            tmp_path / f"{name}.md",
            "--save-json",
            tmp_path / f"{name}.json",
        ]
        proc = subprocess.run(
            [sys.executable, "-m", "normswap", *map(str, args)], env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stderr

    assert "from the cache" not in matrix("m")
    saved = json.loads((tmp_path / "m.json").read_text())
    # a rerun with nothing changed reads the row back instead of running it: the same cells
    assert "gpt_neox: from the cache" in matrix("again")
    again = json.loads((tmp_path / "again.json").read_text())["rows"][0]
    assert again.pop("cached") is True and again == saved["rows"][0]
    assert saved["summary"]["cells_original_works"] == 2 and saved["summary"]["cells_converted_matches"] == 2
    cells = saved["rows"][0]["cells"]
    assert set(cells) == {"auto classes", "save/load round trip"} and all(c["status"] == "ok" for c in cells.values())
    md = (tmp_path / "m.md").read_text()
    assert "| gpt_neox | `GPTNeoXForCausalLM` | ✓ | ✓ |" in md and "**2 of 2 cells" in md
    code, out, _ = run_cli("families", "matrix", "--from-json", tmp_path / "m.json")
    assert code == 0 and out == md
    code, _, err = run_cli("families", "matrix", "--only", "no_such_model")
    assert code == 2 and "no matrix row named 'no_such_model'" in err and "Traceback" not in err


# -------------------------------------------------------------------------------- the row cache
def _record(row):
    from normswap.compat.matrix import columns

    cells = {c: {"status": "ok", "detail": "x", "max_rel_diff": 0.0, "parts": {}, "seconds": 1.0} for c in columns()}
    return {**row.as_dict(), "cells": cells, "convert": {"mode": "exact", "verification": 0.0}, "seconds": 3.0}


def test_row_cache_reuses_only_its_own_untampered_records(tmp_path):
    """#37/#39: a cached row is read back only from a private directory, through no link, from a file nobody
    else can write, as schema-valid JSON under the row's current key; anything else is ignored with a line
    saying which file and why (and the row runs again). Control: the untouched entry is reused."""
    import os

    from normswap.compat.cache import RowCache, row_key
    from normswap.compat.matrix import columns

    row, lines = ROWS["gpt_neox"], []
    cache = RowCache(tmp_path / "cache", say=lines.append)
    key, cols = row_key(row, columns()), columns()
    cache.put(row, key, _record(row))
    entry = cache.directory / "gpt_neox.json"
    assert cache.get(row, key, cols) == _record(row) and not lines  # control: reused, silently
    assert row_key(row, columns()[:2]) != key and row_key(ROWS["opt"], cols) != key  # columns and row are in the key
    assert cache.get(row, row_key(row, cols[:2]), cols[:2]) is None and "computed for other inputs" in lines.pop()

    good = entry.read_text()
    # a planted link (to an identical, valid entry elsewhere) is not followed
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(good)
    entry.unlink()
    entry.symlink_to(elsewhere)
    assert cache.get(row, key, cols) is None and "symbolic link" in lines[-1] and str(entry) in lines[-1]
    # an entry another user can write
    entry.unlink()
    entry.write_text(good)
    os.chmod(entry, 0o646)
    assert cache.get(row, key, cols) is None and "writable by other users" in lines[-1]
    os.chmod(entry, 0o600)
    # the cache directory itself writable by others: nothing in it is read
    os.chmod(cache.directory, 0o777)
    assert cache.get(row, key, cols) is None and "writable by other users" in lines[-1]
    os.chmod(cache.directory, 0o700)
    # not the schema: a wrong status, a record of another row, not JSON at all
    for bad, why in (
        (good.replace('"status": "ok"', '"status": "passed"', 1), "malformed"),
        (good.replace('"name": "gpt_neox"', '"name": "opt"', 1), "not this row's"),
        ("\x80\x04pickle", "not JSON"),
    ):
        entry.write_text(bad)
        assert cache.get(row, key, cols) is None and why in lines[-1], (why, lines[-1])
    entry.write_text(good)
    assert cache.get(row, key, cols) == _record(row)  # control again: the restored entry is reused
    assert all("ignoring" in line and "cache" in line for line in lines) and len(lines) == 6


def test_a_cached_row_is_not_run_again(tmp_path, monkeypatch):
    from normswap.compat import matrix as mx
    from normswap.compat.cache import RowCache, row_key

    row = ROWS["gpt_neox"]
    cache = RowCache(tmp_path / "cache")
    cache.put(row, row_key(row, mx.columns()), _record(row))
    monkeypatch.setattr(mx, "_child", lambda *a: (_ for _ in ()).throw(AssertionError("the row ran")))
    (record,) = mx.run_matrix([row], cache=cache)
    assert record["cached"] is True and record["cells"] == _record(row)["cells"] and cache.reused == 1


# ------------------------------------------------------------------- pooled rows, CLIP, ONNX column
def test_matrix_rows_cover_the_pooled_exact_architectures():
    pooled = [r for r in ROWS.values() if r.pooled]
    assert len(ROWS) >= 80 and {r.name for r in pooled} >= {"clip", "clip_vision_model", "owlvit"}
    assert all(r.exact and r.moved_outputs for r in pooled)


def test_a_pooled_row_is_compared_on_the_outputs_it_keeps(tmp_path):
    """clip_vision_model, converted with --exact-outputs pooled: pooler_output matches, last_hidden_state
    (the raw stream) moves by design and is left out; control: compared on everything, the cell fails."""
    import dataclasses

    row = ROWS["clip_vision_model"]
    build_original(row, tmp_path / "original")
    convert(tmp_path / "original", tmp_path / "converted", pooled=True)
    cell = checks.check_auto_classes(tmp_path / "original", tmp_path / "converted", row)
    assert cell.status == "ok" and "AutoModel" in cell.detail, cell.detail
    everything = dataclasses.replace(row, moved_outputs=())
    cell = checks.check_auto_classes(tmp_path / "original", tmp_path / "converted", everything)
    assert cell.status == "fail" and "relative difference" in cell.detail


def test_automodel_of_a_converted_clip_vision_model_with_projection_is_the_bare_tower(tmp_path):
    """#37: AutoModel.from_pretrained on a CLIPVisionModelWithProjection checkpoint gives the bare tower
    (CLIPVisionModel, with pooler_output); on its conversion it must give the same, not the projection
    class. Both ways: normswap's own loader still gives the converted class (image_embeds)."""
    import normswap
    from normswap.checkpoint.write import _unwrap

    cfg = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
        patch_size=8, projection_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.CLIPVisionModelWithProjection(cfg).save_pretrained(tmp_path / "original")
    convert(tmp_path / "original", tmp_path / "converted", pooled=True)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    original = _load("AutoModel", tmp_path / "original")
    conv = _load("AutoModel", tmp_path / "converted", remote=True)
    assert type(original) is transformers.CLIPVisionModel  # what the original gives: the bare tower
    assert _unwrap(type(conv)) is transformers.CLIPVisionModel
    with torch.no_grad():
        assert _rel(original(pixel_values=pixels).pooler_output, conv(pixel_values=pixels).pooler_output) <= 1e-5
    auto_map = json.loads((tmp_path / "converted" / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModel"].endswith(".NormswapCLIPVisionModel")
    # the other way: the class that was converted, as normswap loads it, with its projection
    proj = normswap.load_model(str(tmp_path / "converted")).eval()
    ref = _load("CLIPVisionModelWithProjection", tmp_path / "original")
    assert _unwrap(type(proj)) is transformers.CLIPVisionModelWithProjection
    with torch.no_grad():
        assert _rel(ref(pixel_values=pixels).image_embeds, proj(pixel_values=pixels).image_embeds) <= 1e-5


def test_the_onnx_column_exports_both_and_compares_onnxruntime_outputs(tmp_path_factory, tmp_path):
    """The ONNX column: both exported, run in onnxruntime, outputs compared; control: a damaged conversion
    fails it (the export's own onnxruntime-vs-PyTorch check passes: the damage is in the model)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    original, converted = _pair(tmp_path_factory, "opt")
    cell = checks.check_export_onnx(original, converted, ROWS["opt"])
    assert cell.status == "ok" and cell.max_rel_diff <= 1e-5, cell.detail
    damaged = _damaged(converted, tmp_path, weight="self_attn.out_proj.weight")
    cell = checks.check_export_onnx(original, damaged, ROWS["opt"])
    assert cell.status == "fail" and "relative difference" in cell.detail


def test_merged_header_names_each_row_once_and_the_span_of_dates():
    """A table whose few rows were re-run later (--from-json ALL --from-json RERUN): the rows re-run are
    named once, the times add up and the header says when the first and the last run were."""
    from normswap.compat.matrix import merge_meta

    base = {"normswap_version": "0", "row_seconds": 600}
    first = base | {"command": "normswap families matrix --only a --only b --row-seconds 600", "seconds": 10,
                    "date": "2026-12-03 09:39 UTC"}  # fmt: skip
    rerun = base | {"command": "normswap families matrix --only b --row-seconds 600", "seconds": 2,
                    "date": "2026-12-03 15:40 UTC"}  # fmt: skip
    m = merge_meta([first, rerun])
    assert m["command"] == "normswap families matrix --only a --only b --row-seconds 600"
    assert m["seconds"] == 12 and m["date"] == "2026-12-03 09:39 UTC to 2026-12-03 15:40 UTC"
    assert merge_meta([first, first | {"seconds": 1}])["date"] == "2026-12-03 09:39 UTC"  # one date: as it was
