"""The evaluation's options are declared once (normswap/evaluate/config.py): the `normswap eval`
commands' options and the recipe schema's eval table come from that declaration, and both refuse a
wrong value in one line naming it. Also: which measurements each kind of model gets."""

from __future__ import annotations

import dataclasses

import click
import pytest

from normswap import declared
from normswap.errors import NormswapError
from normswap.evaluate.config import EvalConfig, SpeedConfig
from normswap.recipes import validate
from normswap.recipes.schema import EVAL


def _params(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option)}


def _minimal(**extra):
    raw = {"name": "t", "source": "normswap:kjv-gpt2", "variants": {"exact": {"convert": {"mode": "exact"}}}}
    raw.update(extra)
    return raw


def test_every_option_is_a_cli_option_and_a_recipe_key_with_one_default():
    from normswap.cli.eval_command import report

    cli = _params(report)
    fields = declared.options(EvalConfig)
    assert {"repeats", "min_time", "compile", "tasks", "memory"} <= {
        f.name for f in fields
    }  # the nested SpeedConfig too
    for f in fields:
        opt = cli[f.name]
        assert declared.cli_flag(f) in opt.opts + opt.secondary_opts or f"--no-{f.name}" in opt.secondary_opts
        assert f.name in EVAL, f.name
        default = declared.default_of(f)
        assert opt.default == (",".join(default) or None if isinstance(default, list) else default), f.name
        if f.metadata["recipe_default"] is declared._UNSET:
            assert EVAL[f.name].default == default, f.name
        if f.metadata["choices"]:
            assert tuple(opt.type.choices) == f.metadata["choices"] == EVAL[f.name].choices
    # the one recipe default that differs is declared at the field, with its reason
    assert EVAL["split"].default == "test" and cli["split"].default is None
    # speed defaults: written once, read by the command, the recipe and the measurement itself
    assert cli["repeats"].default == EVAL["repeats"].default == SpeedConfig().repeats == 400  # the most pairs
    assert cli["min_time"].default == EVAL["min_time"].default == SpeedConfig().min_time
    for name in ("speed_budget", "target_halfwidth"):  # the timing instrument's stop rule
        assert cli[name].default == EVAL[name].default == getattr(SpeedConfig(), name)


def test_ppl_and_speed_offer_subsets_of_the_same_declaration():
    from normswap.cli.eval_command import ppl, report, speed

    full = _params(report)
    for command in (ppl, speed):
        for name, opt in _params(command).items():
            if name in full:
                assert (opt.opts, opt.default, opt.help) == (full[name].opts, full[name].default, full[name].help), name
    assert "max_tokens" in _params(ppl) and "repeats" not in _params(ppl)
    assert "repeats" in _params(speed) and "max_tokens" not in _params(speed)


def test_a_new_field_reaches_both_surfaces_without_other_edits():
    """The generators read the declaration, not a list: a field added to the dataclass becomes a
    click option and a recipe key (negative control: an undeclared plain field becomes neither)."""
    from normswap.cli.options import config_options

    @dataclasses.dataclass
    class Extended(EvalConfig):
        window_budget: int = declared.option(3, "A new option.", minimum=1)
        internal: int = 7  # set by the program: not an option

    cmd = config_options(declared.options(Extended))(click.Command("x", callback=lambda **kw: kw))
    assert "window_budget" in _params(cmd) and _params(cmd)["window_budget"].default == 3
    table = declared.recipe_fields(Extended)
    assert table["window_budget"]["default"] == 3 and table["window_budget"]["minimum"] == 1
    assert "internal" not in _params(cmd) and "internal" not in table


def test_recipe_values_build_the_same_config_the_cli_would():
    r = validate(_minimal(eval={"repeats": 3, "min_time": 0.05, "tasks": "normswap_kjv", "compile": True}), "r.yaml")
    cfg = declared.build(EvalConfig, r["eval"])
    assert isinstance(cfg.speed_setup, SpeedConfig)
    assert (cfg.speed_setup.repeats, cfg.speed_setup.min_time, cfg.speed_setup.compile) == (3, 0.05, True)
    assert cfg.tasks == ["normswap_kjv"] and cfg.split == "test"
    assert declared.flat(cfg)["repeats"] == 3
    # the command line spells the list as a,b
    assert declared.build(EvalConfig, {"tasks": "a, b,"}).tasks == ["a", "b"]


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("repeats", "five", "eval.repeats: expected an integer, got 'five'"),
        ("repeats", 0, "eval.repeats: must be >= 1, got 0"),
        ("compile", "yes", "eval.compile: expected true or false"),
        ("split", "dev", "eval.split: expected one of test, validation, train, all"),
        ("stride", 600, "eval.stride: must be <= seq_len (512), got 600"),
    ],
)
def test_a_wrong_recipe_value_is_refused_in_one_line_naming_the_key(key, value, needle):
    ev = {"seq_len": 512, key: value} if key == "stride" else {key: value}
    with pytest.raises(NormswapError) as e:
        validate(_minimal(eval=ev), "r.yaml")
    assert str(e.value).startswith("r.yaml: ") and needle in str(e.value) and "\n" not in str(e.value)
    # negative control: a right value of the same key passes
    good = {"repeats": 2, "compile": True, "split": "validation", "stride": 256}[key]
    assert validate(_minimal(eval={"seq_len": 512, key: good}), "r.yaml")["eval"][key] == good


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--seq-len", "64", "--stride", "65"], "--stride must be <= seq_len (64), got 65"),
        (["--limit", "0"], "--limit must be >= 1, got 0"),
    ],
)
def test_a_wrong_cli_value_is_refused_in_one_line_before_any_model_loads(run_cli, tmp_path, monkeypatch, args, needle):
    def boom(*a, **k):
        raise AssertionError("models loaded although the options were wrong")

    monkeypatch.setattr("normswap.evaluate.side_by_side.load_planned", boom)
    code, _, err = run_cli("eval", "report", "normswap:kjv-gpt2", "--out", tmp_path / "rep", *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "rep").exists()


def test_measurements_are_chosen_by_kind():
    from normswap.evaluate.kinds import measurements_for

    asked = {"perplexity": None, "diagnostics": True, "tasks": False, "speed": True, "memory": True, "fidelity": None}
    assert measurements_for("causal-lm", asked, ["gpt2"]) == ["perplexity", "diagnostics", "speed", "memory"]
    # an encoder's headline is fidelity; diagnostics (on by default) is not defined for it and is skipped
    assert measurements_for("encoder", asked, ["bert"]) == ["speed", "memory", "fidelity"]
    with pytest.raises(NormswapError, match=r"perplexity is not defined for encoders \(bert\)"):
        measurements_for("encoder", dict(asked, perplexity=True), ["bert"])
    with pytest.raises(NormswapError, match="lm-eval tasks score causal LMs"):
        measurements_for("encoder", dict(asked, tasks=True), ["bert"])
    assert "fidelity" in measurements_for(
        "causal-lm", dict(asked, fidelity=True), ["gpt2"]
    )  # asked for: runs on LMs too
