"""Error messages that used to hide their reason: each shows it, in one line."""

import json
import shutil

import pytest

from normswap.assets.models import model_path


def _error_line(code, err):
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.startswith("normswap: error:")]
    assert len(lines) == 1, err
    return lines[0]


def _with_config(tmp_path, **changes):
    src = tmp_path / "model"
    shutil.copytree(model_path("kjv-gpt2"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path, run_cli):
    """transformers says 'look at the above report', which it logged where nobody sees it."""
    src = _with_config(tmp_path, n_inner=4 * 128 * 2)  # the weights have n_inner 512
    for args in (("convert", src, tmp_path / "out"), ("eval", "ppl", src, "--quiet")):
        line = _error_line(*run_cli(*args)[::2])
        assert "above report" not in line
        # convert's own input check and the loader used by eval word it differently; both must name
        # the tensor, the shape in the files and the shape the config implies
        assert "mlp.c_" in line and ("[512, 128]" in line or "[128, 512]" in line), line
        assert "[1024, 128]" in line or "[128, 1024]" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value,reason", [(0, "expected float, got int"), ("abc", "expected float, got str")])
def test_invalid_epsilon_shows_the_reason(tmp_path, run_cli, value, reason):
    src = _with_config(tmp_path, layer_norm_epsilon=value)
    line = _error_line(*run_cli("convert", src, tmp_path / "out")[::2])
    assert "layer_norm_epsilon" in line and reason in line, line


def test_duplicate_eval_names_are_refused(tmp_path, run_cli):
    other = _with_config(tmp_path)  # a second, distinct model directory
    code, _, err = run_cli("eval", "ppl", "a=normswap:kjv-gpt2", f"a={other}", "--baseline", "a", "--quiet")
    line = _error_line(code, err)
    assert "two models are named 'a'" in line and "normswap:kjv-gpt2" in line and str(other) in line
    # two directories with the same name are the same collision, and labels resolve it
    twin = tmp_path / "twin" / "model"
    shutil.copytree(other, twin)
    assert "two models are named 'model'" in _error_line(*run_cli("eval", "ppl", other, twin, "--quiet")[::2])
    code, out, err = run_cli(
        "eval", "ppl", f"a={other}", f"b={twin}", "--max-tokens", "128", "--seq-len", "64", "--quiet"
    )
    assert code == 0, err
    assert out.count("\na ") + out.count("\nb ") == 2


def test_export_calls_its_output_dest_and_force_says_what_each_command_replaces(tmp_path, run_cli):
    """`export MODEL DEST`: a user must not read `--force` as "replace my converted model"."""
    code, out, _ = run_cli("export", "--help")
    assert code == 0 and "DEST" in out and "Replace DEST" in out
    assert "OUT" not in out  # negative control: the old help said "Replace OUT if it exists" of DEST
    dest = tmp_path / "kjv-stock"
    dest.mkdir()
    code, _, err = run_cli("export", model_path("kjv-gpt2"), dest, "--format", "stock")
    line = _error_line(code, err)
    assert f"DEST {dest} already exists" in line and "OUT" not in line
    for command in (("study",), ("demo",), ("run",), ("eval", "report"), ("eval", "render")):
        code, out, _ = run_cli(*command, "--help")
        assert code == 0 and "Replace --out DIR if it exists." in " ".join(out.split()), command
    code, out, _ = run_cli("convert", "--help")
    assert "Replace OUT if it exists." in " ".join(out.split())  # convert's output is the positional OUT


def test_eval_report_help_says_name_spec_the_baseline_default_and_the_split_rule(run_cli):
    code, out, _ = run_cli("eval", "report", "--help")
    text = " ".join(out.split())
    assert code == 0 and "NAME=SPEC" in text and "Default: none" in text
    assert "fine-tuned on it by normswap" in text and "test split" in text and "NOT held-out" in text


def test_an_unreachable_hub_hint_names_what_fits_what_was_asked(monkeypatch):
    from normswap import network
    from normswap.errors import NormswapError

    monkeypatch.setattr(network, "hub_problem", lambda timeout: "the network is unreachable")
    with pytest.raises(NormswapError) as e:
        network.require_hub(models=["some-org/some-model"])
    assert "shipped model" in str(e.value) and "normswap models" in str(e.value)
    assert "tasks" not in str(e.value)  # negative control: the old hint offered "the shipped tasks" for a model
    with pytest.raises(NormswapError, match=r"the shipped tasks \(normswap_kjv\)"):
        network.require_hub(hub_tasks=["hellaswag"])
    with pytest.raises(NormswapError, match="a local file or --data embedded"):
        network.require_hub(data="some-org/some-dataset")
