"""`convert --exact-outputs pooled`: a pre-LN tower whose raw residual stream is an output (CLIP vision)
converts when the outputs a user keeps (pooler_output) pass through a norm; verification compares those,
the config and model card record what is exact, and loading warns once naming the preserved outputs."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from normswap.architectures.probes import probe_inputs
from normswap.architectures.randomize import randomize_
from normswap.errors import NormswapError


def _clip_vision(tmp_path):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8
    )
    torch.manual_seed(0)
    src = randomize_(CLIPVisionModel(config).eval(), seed=3)
    src.save_pretrained(tmp_path / "clipv")
    return src, tmp_path / "clipv"


def test_pooled_conversion_keeps_pooler_output_and_records_it(tmp_path, run_cli):
    import normswap

    src, path = _clip_vision(tmp_path)
    code, _, err = run_cli("convert", path, tmp_path / "refused")
    assert code != 0 and "raw residual stream" in err and "--exact-outputs pooled" in err  # default: refused
    assert not (tmp_path / "refused").exists()

    code, out, err = run_cli("convert", path, tmp_path / "out", "--exact-outputs", "pooled", "--json")
    assert code == 0, err
    ver = json.loads(out)["verification"]
    assert ver["passed"] is True and ver["compared_outputs"] == ["pooler_output"] and ver["max_abs_diff"] <= 1e-4
    block = json.loads((tmp_path / "out" / "config.json").read_text())["normswap"]
    assert block["exact_outputs"] == ["pooler_output"] and block["shifted_outputs"] == ["last_hidden_state"]
    card = (tmp_path / "out" / "README.md").read_text()
    assert "--exact-outputs pooled" in card and "Not exact: last_hidden_state" in card

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = normswap.load_model(str(tmp_path / "out"))
        normswap.load_model(str(tmp_path / "out"))
    said = [str(w.message) for w in caught if "--exact-outputs pooled" in str(w.message)]
    assert len(said) == 1 and "the exact outputs are pooler_output" in said[0]  # once, naming what is kept

    inputs = probe_inputs(src, seed=5, dtype=torch.float32)
    with torch.no_grad():
        a, b = src(**inputs), model(**inputs)
    assert float((a.pooler_output - b.pooler_output).abs().max()) <= 1e-5
    delta = (b.last_hidden_state - a.last_hidden_state).double()
    assert float(delta.abs().max()) > 1e-2  # negative control: the raw stream did move ...
    assert float((delta - delta.mean(-1, keepdim=True)).abs().max()) < 1e-4  # ... by its per-token mean only


def test_verification_compares_the_declared_outputs(tmp_path, run_cli, monkeypatch):
    """Negative control for verification: declaring the raw stream exact makes convert fail and write nothing."""
    from normswap.architectures import family_check
    from normswap.convert import pipeline

    _, path = _clip_vision(tmp_path)
    real = family_check.resolve_pooled_family

    def wrong(config, cls=None, *, convert):
        family, declared = real(config, cls, convert=convert)
        return family, {"exact_outputs": ["last_hidden_state"], "shifted_outputs": []}

    monkeypatch.setattr(pipeline, "resolve_pooled_family", wrong)
    code, _, err = run_cli("convert", path, tmp_path / "out", "--exact-outputs", "pooled")
    # outputs compared, not log-probs (the message names the pass rule's reason, then the figure)
    assert code != 0 and "verification failed: " in err and "max |Δ output|" in err
    assert not (tmp_path / "out").exists()


def test_pooled_refused_where_no_output_stays_exact():
    """VitDet returns only its raw stream: nothing pooled to keep, so --exact-outputs pooled refuses."""
    from transformers import AutoConfig

    from normswap.architectures.family_check import resolve_pooled_family
    from normswap.architectures.tiny import model_class, shrink_config
    from normswap.convert.inplace import convert_tiny

    config = AutoConfig.for_model("vitdet")
    with pytest.raises(NormswapError, match="--exact-outputs pooled: model_type='vitdet' keeps no output exact"):
        resolve_pooled_family(config, model_class(shrink_config(config)), convert=convert_tiny)
