"""Convert's options are declared once (normswap/convert/config.py: ConvertOptions): `normswap
convert`'s click options, the recipe schema's convert table and what `convert_checkpoint` takes all
come from that declaration; the Python API keeps its keyword spelling."""

from __future__ import annotations

import dataclasses
import json

import click
import pytest

from normswap import declared
from normswap.checkpoint.shards import SINGLE_NAME
from normswap.convert.config import PLAN_OPTIONS, ConvertOptions
from normswap.errors import NormswapError
from normswap.recipes import validate
from normswap.recipes.schema import CONVERT

COMMAND_ONLY = {
    "device",
    "force",
    "as_json",
    "quiet",
    "trust_remote_code",
}  # where and how the command runs, not how it converts


def _params(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option)}


def test_every_option_is_a_cli_option_and_recipe_keys_come_from_the_same_fields():
    from normswap.cli.convert_command import convert

    cli = _params(convert)
    fields = {f.name: f for f in declared.options(ConvertOptions)}
    assert set(cli) - COMMAND_ONLY == set(fields)
    for name, f in fields.items():
        opt = cli[name]
        assert declared.cli_flag(f) in opt.opts, name
        assert opt.default == declared.default_of(f) and opt.help == f.metadata["help"], name
        if f.metadata["choices"]:
            assert tuple(opt.type.choices) == f.metadata["choices"], name
    # the recipe offers the conversion's own options; where OUT is sharded and which family file
    # is used stay on the command line (a recipe's convert step writes its own directory)
    assert (
        set(CONVERT)
        == {n for n, f in fields.items() if f.metadata["recipe"]}
        == set(fields) - {"max_shard_size", "family_file"}
    )
    for name in CONVERT:
        assert CONVERT[name].default == declared.default_of(fields[name]), name
        assert CONVERT[name].choices == fields[name].metadata["choices"], name
    assert CONVERT["gamma"].nullable and CONVERT["tolerance"].minimum == 0.0
    assert set(ConvertOptions().as_dict()) == set(PLAN_OPTIONS)


def test_a_recipe_convert_section_builds_the_options_the_command_would():
    raw = {
        "name": "t",
        "source": "normswap:kjv-gpt2",
        "variants": {"v": {"convert": {"mode": "approx", "gamma": "keep", "verify": False}}},
    }
    section = validate(raw, "r.yaml")["variants"]["v"]["convert"]
    assert declared.build(ConvertOptions, section) == ConvertOptions(mode="approx", gamma="keep", verify=False)
    with pytest.raises(NormswapError, match=r"variants\.v\.convert\.gamma: expected one of fold, keep, reset"):
        validate({**raw, "variants": {"v": {"convert": {"gamma": "squash"}}}}, "r.yaml")


def test_convert_checkpoint_takes_options_or_keywords(tmp_path):
    from normswap.convert.pipeline import convert_checkpoint

    by_keywords = convert_checkpoint("normswap:kjv-gpt2", tmp_path / "kw", mode="exact", gamma="keep", verify=False)
    by_options = convert_checkpoint(
        "normswap:kjv-gpt2", tmp_path / "opt", ConvertOptions(mode="exact", gamma="keep", verify=False)
    )
    assert by_keywords["gamma"] == by_options["gamma"] == {"keep": by_keywords["norms_replaced"]}
    config = json.loads((tmp_path / "kw" / "config.json").read_text())
    assert config["normswap"]["options"] == {"mode": "exact", "gamma": "keep", "beta": None, "untie": False}
    assert (tmp_path / "kw" / SINGLE_NAME).read_bytes() == (tmp_path / "opt" / SINGLE_NAME).read_bytes()


@pytest.mark.parametrize(
    "call, error, needle",
    [
        (dict(mode="exact", options=ConvertOptions()), TypeError, "either options= or mode, not both"),
        (dict(gama="keep"), TypeError, "unexpected convert option(s): gama"),
        (dict(gamma="squash"), NormswapError, "--gamma must be one of fold, keep, reset, got 'squash'"),
        (dict(tolerance=-1.0), NormswapError, "--tolerance must be >= 0, got -1.0"),
        (
            dict(options=dataclasses.replace(ConvertOptions(), mode="fast")),
            NormswapError,
            "--mode must be one of auto, exact, approx",
        ),
    ],
)
def test_convert_checkpoint_refuses_bad_options_before_reading_anything(tmp_path, call, error, needle):
    from normswap.convert.pipeline import convert_checkpoint

    with pytest.raises(error) as info:
        convert_checkpoint(tmp_path / "missing-source", tmp_path / "out", **call)
    assert needle in str(info.value)
    assert not (tmp_path / "out").exists()
