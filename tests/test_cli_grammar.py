"""One CLI grammar across every command (issue #58, CONVENTIONS.md "CLI grammar", normswap/cli/options.py):
the whole command tree is walked through click's own objects and every option checked. Each rule has a
negative control: a command planted with the old inconsistency is caught."""

from __future__ import annotations

import click
import pytest

from normswap.cli.main import cli
from normswap.cli.options import AliasedOption, DtypeChoice

CANONICAL_DTYPES = {"float32", "bfloat16", "float16", "float64"}
DTYPE_WORDS = {"fp32", "bf16", "fp16", "fp64", "float32", "bfloat16", "float16", "float64", "half", "float"}
# names whose old meanings were several (issue #58): never a canonical option name any more
RETIRED = {"--budget", "--warmup", "--schedule", "--speed-budget", "--generate-budget", "--decode-budget"}
# commands that print progress lines (normswap/progress.py Heartbeat) and so offer --quiet
PROGRESS = {"convert", "slice", "export", "finetune", "eval report", "eval ppl", "eval speed", "run", "demo"}


def walk(command: click.Command, path: tuple = ()):
    """(command path, command) for ``command`` and everything under it."""
    yield path, command
    if isinstance(command, click.Group):
        ctx = click.Context(command)
        for name in command.list_commands(ctx):
            yield from walk(command.get_command(ctx, name), path + (name,))


def canonical(p: click.Option) -> list[str]:
    return [o for o in p.opts if o not in getattr(p, "hidden_aliases", ())]


def meaning(p: click.Option) -> tuple:
    """What an option is, as far as its name promises: a flag, a file, a directory, or a value."""
    if p.is_flag:
        return ("flag",)
    if isinstance(p.type, click.Path):
        return ("directory",) if not p.type.file_okay else ("file",) if not p.type.dir_okay else ("path",)
    return ("value",)


def grammar_problems(root: click.Command) -> list[str]:
    problems = []
    seen: dict[str, tuple] = {}  # canonical name -> (meaning, where first seen)
    for path, command in walk(root):
        where = " ".join(("normswap",) + path)
        options = [p for p in command.params if isinstance(p, click.Option)]
        names = {o for p in options for o in canonical(p)}
        if " ".join(path) in PROGRESS and "--quiet" not in names:
            problems.append(f"{where}: prints progress lines but has no --quiet")
        for p in options:
            shown = canonical(p)
            label = f"{where} {'/'.join(shown)}"
            if not (p.help or "").strip() and shown != ["--version"]:
                problems.append(f"{label}: no help text")
            for name in shown:
                if name in RETIRED:
                    problems.append(f"{label}: {name} is retired (it meant several things); name what it bounds")
                first = seen.setdefault(name, (meaning(p), label))
                if first[0] != meaning(p):
                    problems.append(f"{label} is a {meaning(p)[0]} but {first[1]} is a {first[0][0]}")
            if "--json" in shown and not p.is_flag:
                problems.append(f"{label}: --json must be a flag (a file is --save FILE)")
            if "--save" in shown and meaning(p) != ("file",):
                problems.append(f"{label}: --save takes a FILE")
            if "--out" in shown and meaning(p) != ("directory",):
                problems.append(f"{label}: --out must be a directory (click.Path(file_okay=False))")
            if "--device" in shown and p.default != "auto":
                problems.append(f"{label}: --device defaults to {p.default!r}, not auto")
            if isinstance(p.type, click.Choice):
                words = {str(c).lower() for c in p.type.choices}
                if words & DTYPE_WORDS and not (
                    isinstance(p.type, DtypeChoice) and words - {"auto"} <= CANONICAL_DTYPES
                ):
                    problems.append(f"{label}: dtype choices {sorted(words)} not spelled float32|bfloat16|float16")
            for alias in getattr(p, "hidden_aliases", ()):
                if alias in names:
                    problems.append(f"{label}: hidden alias {alias} is also an option of its own here")
    return problems


def test_every_command_follows_the_grammar():
    assert grammar_problems(cli) == []


def _planted(*options: click.Option) -> click.Group:
    """The real tree with one more command holding ``options``."""
    group = click.Group("normswap", commands={"planted": click.Command("planted", params=list(options))})
    real = click.Context(cli)
    for name in cli.list_commands(real):
        group.add_command(cli.get_command(real, name), name)
    return group


@pytest.mark.parametrize(
    "option, says",
    [
        (click.Option(["--json"], type=click.Path(dir_okay=False), help="Write the results here."), "must be a flag"),
        (click.Option(["--out"], type=click.Path(dir_okay=False), help="The table."), "must be a directory"),
        (click.Option(["--device"], default="cpu", help="Where."), "not auto"),
        (click.Option(["--dtype"], type=click.Choice(["fp32", "bf16"]), help="Dtype."), "not spelled"),
        (click.Option(["--threads"], type=int), "no help text"),
        (click.Option(["--budget"], type=float, help="Seconds."), "retired"),
        (click.Option(["--save"], is_flag=True, help="Save."), "is a flag but"),
        (click.Option(["--force"], type=int, help="A number."), "is a value but"),
    ],
)
def test_a_planted_command_that_breaks_a_rule_is_caught(option, says):
    """Negative controls: each rule, broken once in one planted command of the real tree."""
    problems = grammar_problems(_planted(option))
    assert any(p.startswith("normswap planted") and says in p for p in problems), problems
    assert all(p.startswith("normswap planted") for p in problems), problems  # the real tree still passes


def test_a_progress_command_without_quiet_is_caught():
    convert = cli.get_command(click.Context(cli), "convert")
    bare = click.Command("convert", params=[p for p in convert.params if p.name != "quiet"])
    group = click.Group("normswap", commands={"convert": bare})
    assert grammar_problems(group) == ["normswap convert: prints progress lines but has no --quiet"]


def test_old_spellings_are_accepted_but_not_shown(run_cli):
    """Renamed options keep their old spelling (scripts keep working) and --help shows only the new one."""
    code, out, _ = run_cli("bench", "kernels", "--help")
    assert code == 0 and "--row-seconds" in out and "--budget" not in out and "--save" in out
    code, out, _ = run_cli("finetune", "--help")
    assert code == 0 and "--lr-schedule" in out and "--schedule " not in out
    aliased = {
        alias: p for _, c in walk(cli) for p in c.params if isinstance(p, AliasedOption) for alias in p.hidden_aliases
    }
    assert {"--budget", "--warmup", "--schedule", "--speed-budget", "--save-json", "--out"} <= set(aliased)
    # an old spelling parses into the same parameter as the new one
    study = cli.get_command(click.Context(cli), "study")
    for new, old in (("--training-seconds", "--budget"), ("--warmup-steps", "--warmup")):
        ctx_new = study.make_context("study", ["--out", "x", new, "5"], resilient_parsing=True)
        ctx_old = study.make_context("study", ["--out", "x", old, "5"], resilient_parsing=True)
        assert ctx_new.params == ctx_old.params
        assert any(v == 5 for k, v in ctx_new.params.items() if k != "out")


def test_dtypes_accept_the_short_spellings_and_keep_the_configs_own():
    """fp32/bf16/fp16 are accepted where float32/bfloat16/float16 are the names; a configuration that
    records its own spelling (the study's precision) gets that spelling back."""
    study = cli.get_command(click.Context(cli), "study")
    for given in ("bfloat16", "bf16", "BF16"):
        ctx = study.make_context("study", ["--out", "x", "--precision", given], resilient_parsing=True)
        assert ctx.params["precision"] == "bf16"
    finetune = cli.get_command(click.Context(cli), "finetune")
    ctx = finetune.make_context("finetune", ["m", "o", "--dtype", "fp32"], resilient_parsing=True)
    assert ctx.params["dtype"] == "float32"
    with pytest.raises(click.BadParameter):  # negative control: a dtype the command lacks is still refused
        finetune.make_context("finetune", ["m", "o", "--dtype", "fp16"])
