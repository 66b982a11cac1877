"""BLOOM and XGLM slice (#59 item 7).

BLOOM: its embedding norm (word_embeddings_layernorm, γ and β on the stream's start) depends on the
token id alone, so the normalised table is precomputed in float64 and rotated in place of the raw one;
the head, tied to the raw table, keeps its own rotated copy (counted; the summary says whether the slice
still has fewer parameters). The control: rotating the raw table instead (the norm dropped, not
precomputed) fails the F = 0 check.

XGLM: its sinusoidal position table, computed at run time and centred by the conversion, is
stored in the sliced checkpoint, rotated like an embedding (slice/stream.py COMPUTED_TABLES).

The F = 0 check (slice/rotation_check.check_rotation: the rotation computed in float64 against the
conversion in float64, and the float32 drift) passes; a real 25 % slice writes a checkpoint that loads
with AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True) and reads its stored table. The
control: the stored table rotated from positions shifted by one row (a wrong table of the right shape)
fails the same check.
"""

from __future__ import annotations

import copy
import json

import torch
from helpers import tiny_model

from normswap.convert import convert_model
from normswap.slice import rotate as rotation
from normswap.slice import rotation_check, slice_model
from normswap.slice.model import rotate_model
from normswap.slice.stream import stream_map


def _batches(vocab, n=2, rows=4, seq=16):
    return [torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _converted_xglm():
    model = tiny_model("xglm", 0).eval()
    convert_model(model)
    return model


def test_xglm_rotation_is_exact_at_f0():
    model = _converted_xglm()
    stream = stream_map(model)
    assert stream.computed_tables == ["model.embed_positions.weights"]
    result = slice_model(model, _batches(model.config.vocab_size), 0.0)
    check = rotation_check.check_rotation(model, stream, result.basis_matrix, basis="pca", tolerance=1e-5)
    assert check["passed"] is True and check["exact_float64"] < 1e-6, check


def test_control_a_shifted_position_table_fails_the_check():
    model = _converted_xglm()
    stream = stream_map(model)
    result = slice_model(model, _batches(model.config.vocab_size), 0.0)
    wrong = copy.deepcopy(model)
    positions = wrong.model.embed_positions
    positions.weights = torch.roll(positions.weights, 1, dims=0)  # each position reads its neighbour's row
    d = stream.hidden_size
    q = result.basis_matrix
    candidate = rotate_model(wrong, stream, q, d - 1, fraction=0.0, basis="pca")
    candidate64 = rotate_model(copy.deepcopy(wrong).double(), stream, q.double(), d - 1, fraction=0.0, basis="pca")
    check = rotation_check.compare(model, candidate, tolerance=1e-5, candidate_float64=candidate64)
    assert check["passed"] is False and check["reason"].startswith("not exact"), check


def test_xglm_25_percent_slice_loads_with_auto_classes(tmp_path, run_cli):
    from transformers import AutoModelForCausalLM

    tiny_model("xglm", 0).save_pretrained(tmp_path / "src")
    code, out, err = run_cli(
        "slice", tmp_path / "src", tmp_path / "out", "--fraction", "0.25", "--calibration-tokens", "1024", "--json"
    )
    assert code == 0, err
    summary = json.loads(out)
    assert summary["width"] == 48 and summary["parameters_after"] < summary["parameters_before"]
    sliced = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    assert tuple(sliced.model.embed_positions.weights.shape) == (sliced.config.max_position_embeddings + 2, 48)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "model.embed_positions" not in config["normswap"]["centered_outputs"]
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = sliced(input_ids=ids).logits.log_softmax(-1)
        b = original(input_ids=ids).logits.log_softmax(-1)
    # a 25 % slice is lossy (the deleted directions carried a little energy), but it is the same model
    assert torch.isfinite(a).all() and float((a - b).abs().mean()) < 1.0


def _converted_bloom():
    model = tiny_model("bloom", 0).eval()
    convert_model(model)
    return model


def test_bloom_rotation_is_exact_at_f0_with_the_normalised_table():
    model = _converted_bloom()
    stream = stream_map(model)
    assert stream.embedding_norm == "transformer.word_embeddings_layernorm" and stream.head_copy == "lm_head.weight"
    result = slice_model(model, _batches(model.config.vocab_size), 0.0)
    check = rotation_check.check_rotation(model, stream, result.basis_matrix, basis="pca", tolerance=1e-5)
    assert check["passed"] is True and check["exact_float64"] < 1e-6, check


def test_control_the_raw_bloom_table_rotated_fails_the_check(monkeypatch):
    """The un-normalised table rotated instead of the normalised one (the norm dropped): refused."""
    model = _converted_bloom()
    stream = stream_map(model)
    result = slice_model(model, _batches(model.config.vocab_size), 0.0)

    def raw(model, stream):
        table = model.get_submodule("transformer.word_embeddings").weight.detach().double()
        return table - table.mean(dim=-1, keepdim=True)

    monkeypatch.setattr(rotation, "normalised_table", raw)
    d, q = stream.hidden_size, result.basis_matrix
    candidate = rotate_model(model, stream, q, d - 1, fraction=0.0, basis="pca")
    candidate64 = rotate_model(copy.deepcopy(model).double(), stream, q.double(), d - 1, fraction=0.0, basis="pca")
    check = rotation_check.compare(model, candidate, tolerance=1e-5, candidate_float64=candidate64)
    assert check["passed"] is False and check["reason"].startswith("not exact"), check


def test_bloom_25_percent_slice_loads_with_auto_classes(tmp_path, run_cli):
    from helpers import tiny_wordpiece
    from transformers import AutoModelForCausalLM

    tiny_model("bloom", 0).save_pretrained(tmp_path / "src")
    tiny_wordpiece().save_pretrained(tmp_path / "src")
    code, out, err = run_cli(
        "slice", tmp_path / "src", tmp_path / "out", "--fraction", "0.25", "--calibration-tokens", "1024", "--json"
    )
    assert code == 0, err
    summary = json.loads(out)
    k = summary["width"]
    assert k == 48 and summary["head_copy_parameters"] == 256 * k
    assert summary["fewer_parameters_than_original"] is (summary["parameters_after"] < summary["parameters_before"])
    assert json.loads((tmp_path / "out" / "slice.json").read_text())["head_copy_parameters"] == 256 * k
    sliced = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    assert type(sliced.transformer.word_embeddings_layernorm).__name__ == "Identity"
    assert sliced.lm_head.weight is not sliced.transformer.word_embeddings.weight
    assert tuple(sliced.lm_head.weight.shape) == (256, k) == tuple(sliced.transformer.word_embeddings.weight.shape)
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = sliced(input_ids=ids).logits.log_softmax(-1)
        b = original(input_ids=ids).logits.log_softmax(-1)
    assert torch.isfinite(a).all() and float((a - b).abs().mean()) < 1.0
