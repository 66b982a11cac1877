"""Sizes in config.json are checked before anything is built from them (issue #22, case 7; n_embd: 0 of case 9).

`n_layer: 1000000` beside weights for 2 layers used to build layers until memory ran out; a
converted checkpoint whose normswap block declared a norm of 3e9 elements made `eval ppl` ask
for 12 GB; `n_embd: 0` ended in a ZeroDivisionError. Now each is refused by name, in one line,
and no model is built at all (counted, not timed). Controls: the same checkpoints with honest
sizes load and convert.
"""

import json
from pathlib import Path

import pytest
import transformers
from helpers import tiny_model

from normswap.checkpoint.load import load_model


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "gpt2"
    tiny_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory, two_layers):
    from normswap.convert.pipeline import convert_checkpoint

    out = tmp_path_factory.mktemp("conv") / "out"
    convert_checkpoint(str(two_layers), out, verify=False)
    return out


@pytest.fixture
def models_built(monkeypatch):
    """How many transformers models were constructed (on any device, meta included)."""
    built = []
    original = transformers.PreTrainedModel.__init__

    def counting(self, config, *args, **kwargs):
        built.append(type(self).__name__)
        original(self, config, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", counting)
    return built


def _copy_with_config(src: Path, dest: Path, change) -> Path:
    dest.mkdir()
    for p in src.iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    cfg = json.loads((dest / "config.json").read_text())
    change(cfg)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def _one_line(code, err, *needles):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and all(n in lines[0] for n in needles), err


def test_a_million_layers_beside_two_are_refused_before_any_model_is_built(tmp_path, two_layers, run_cli, models_built):
    bad = _copy_with_config(two_layers, tmp_path / "bad", lambda c: c.update(n_layer=1_000_000))

    code, _, err = run_cli("convert", bad, tmp_path / "out", "--no-verify")
    _one_line(code, err, "n_layer is 1,000,000", "at most 2 layers")
    assert models_built == []
    assert not (tmp_path / "out").exists()

    code, _, err = run_cli("eval", "ppl", bad, "--quiet")  # loading for evaluation: the same refusal
    _one_line(code, err, "n_layer is 1,000,000")
    assert models_built == []

    # the control: the honest config converts (and so builds its models)
    code, _, err = run_cli("convert", two_layers, tmp_path / "out", "--no-verify")
    assert code == 0, err
    assert models_built


def test_a_norm_size_of_3e9_in_the_normswap_block_is_refused_by_eval_ppl(tmp_path, converted, run_cli, models_built):
    def huge_norm(cfg):
        name = next(iter(cfg["normswap"]["norms"]))
        cfg["normswap"]["norms"][name]["hidden_size"] = 3e9

    bad = _copy_with_config(converted, tmp_path / "bad", huge_norm)
    code, _, err = run_cli("eval", "ppl", bad, "--quiet")
    _one_line(code, err, "hidden_size 3,000,000,000", "normswap block")
    assert models_built == []
    # the control: the checkpoint as written loads
    model = load_model(str(converted))
    assert sum(p.numel() for p in model.parameters()) < 100_000


@pytest.mark.parametrize("key,value", [("n_embd", 0), ("n_head", -2), ("vocab_size", 64.5), ("n_layer", "2")])
def test_zero_negative_or_fractional_sizes_are_refused_by_name(tmp_path, two_layers, run_cli, models_built, key, value):
    bad = _copy_with_config(two_layers, tmp_path / "bad", lambda c: c.update({key: value}))
    code, _, err = run_cli("convert", bad, tmp_path / "out", "--no-verify")
    _one_line(code, err, f"{key} is {value!r}", "whole number above zero")
    assert models_built == []


def test_a_width_no_tensor_backs_is_refused(tmp_path, two_layers, run_cli, models_built):
    bad = _copy_with_config(two_layers, tmp_path / "bad", lambda c: c.update(n_inner=10**9))
    code, _, err = run_cli("eval", "ppl", bad, "--quiet")
    _one_line(code, err, "n_inner is 1,000,000,000", "no tensor")
    assert models_built == []
