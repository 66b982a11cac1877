"""Fail fast: whatever the options, the models' configs and tokenizers and the data already show is
refused before any model's weights load (evaluate/preflight.py), so a long run never dies late for
it. Ordering, not wall clock: the model loader records whether it was called."""

from __future__ import annotations

import pytest
from test_evaluate_fixtures import save_tiny


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from helpers import tiny_model, tiny_wordpiece

    root = tmp_path_factory.mktemp("failfast")
    enc = root / "enc"
    tiny_model("bert", task="masked-lm", randomize=False, seed=1).save_pretrained(enc)
    tiny_wordpiece().save_pretrained(enc)
    short = root / "short.txt"
    short.write_text("In the beginning God created the heaven and the earth.\n")  # ~12 tokens
    return {"gpt2": save_tiny(root / "gpt2", seed=3), "enc": str(enc), "short": str(short), "root": root}


@pytest.fixture
def loads(monkeypatch):
    """Every weight load the command makes (checkpoint.load.load_model, which every loader calls)."""
    from normswap.checkpoint import load

    calls = []
    real = load.load_model

    def recording(spec, *a, **kw):
        calls.append(str(spec))
        return real(spec, *a, **kw)

    monkeypatch.setattr(load, "load_model", recording)
    return calls


def _fails_before_loading(run_cli, loads, *args, match):
    code, _, err = run_cli(*args)
    assert code == 2 and match in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert loads == [], f"weights were loaded before the refusal: {loads}"


def test_missing_data_file_is_refused_before_any_model_loads(dirs, run_cli, loads):
    _fails_before_loading(
        run_cli,
        loads,
        "eval",
        "report",
        dirs["gpt2"],
        "--data",
        str(dirs["root"] / "nope.txt"),
        "--out",
        dirs["root"] / "r1",
        "--quiet",
        match="no such file or directory",
    )
    _fails_before_loading(
        run_cli,
        loads,
        "eval",
        "ppl",
        dirs["gpt2"],
        "--data",
        str(dirs["root"] / "nope.txt"),
        "--quiet",
        match="no such file or directory",
    )


def test_text_too_short_for_the_encoder_fidelity_is_refused_before_speed(dirs, run_cli, loads):
    # the case: an encoder report whose split held fewer tokens than one 510-token row ran
    # speed and memory for minutes first
    _fails_before_loading(
        run_cli,
        loads,
        "eval",
        "report",
        dirs["enc"],
        "--data",
        dirs["short"],
        "--out",
        dirs["root"] / "r2",
        "--quiet",
        match="fidelity: ",
    )
    code, _, err = run_cli(
        "eval", "report", dirs["enc"], "--data", dirs["short"], "--out", dirs["root"] / "r2", "--quiet"
    )
    assert "fewer than the 510 of one row (--seq-len 512): lower --seq-len to" in err


def test_measurement_the_model_kind_does_not_define_is_refused_before_loading(dirs, run_cli, loads):
    _fails_before_loading(
        run_cli,
        loads,
        "eval",
        "report",
        dirs["enc"],
        "--tasks",
        "normswap_kjv",
        "--out",
        dirs["root"] / "r3",
        "--quiet",
        match="lm-eval tasks score causal LMs",
    )
    _fails_before_loading(
        run_cli, loads, "eval", "ppl", dirs["enc"], "--quiet", match="perplexity is not defined for encoders"
    )
    _fails_before_loading(
        run_cli,
        loads,
        "eval",
        "report",
        dirs["gpt2"],
        dirs["enc"],
        "--out",
        dirs["root"] / "r4",
        "--quiet",
        match="cannot compare causal LMs",
    )
    _fails_before_loading(
        run_cli,
        loads,
        "eval",
        "ppl",
        dirs["gpt2"],
        "--seq-len",
        "4096",
        "--quiet",
        match="longer than the shortest model context",
    )


def test_control_good_inputs_do_load_and_run(dirs, run_cli, loads):
    # negative control for the recorder: with inputs that pass the checks the models load and the run finishes
    code, out, err = run_cli("eval", "ppl", dirs["gpt2"], "--data", dirs["short"], "--seq-len", "8", "--quiet")
    assert code == 0, err
    assert loads == [dirs["gpt2"]]


def test_recipe_evaluation_is_checked_before_the_first_step(dirs, tmp_path, loads):
    """`normswap run`: the evaluation at the end is checked before convert and fine-tune run."""
    from normswap.errors import NormswapError
    from normswap.recipes import load_recipe
    from normswap.recipes.steps import run_recipe

    loaded = load_recipe("quickstart", ("data=" + str(tmp_path / "missing.txt"),))
    with pytest.raises(NormswapError, match="no such file or directory"):
        run_recipe(loaded, tmp_path / "run", progress=lambda m: None)
    assert loads == [] and not (tmp_path / "run" / "models").exists()
