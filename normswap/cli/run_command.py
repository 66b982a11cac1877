"""`normswap run RECIPE --out DIR [--set key=value ...]`: run a recipe pipeline end to end."""

from __future__ import annotations

import json
import textwrap
import time

import click

from normswap.cli.options import force_replaces, json_option, quiet_option, trust_remote_code_option

set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a recipe value (dotted key, YAML-typed value), e.g. --set eval.max_tokens=4096 "
    "--set variants.approx.convert.beta=drop; finetune.X / convert.X / slice.X apply to every variant that has that "
    "section; "
    "KEY= (empty) removes the key so its default applies. Repeatable.",
)


def recipe_progress(command: str, quiet: bool):
    """Where a recipe's progress lines go: stderr as ``normswap <command>: ...``, or nowhere (--quiet)."""
    from normswap.progress import command_lines

    return (lambda m: None) if quiet else command_lines(command)


def print_outcome(state: dict, out, *, seconds: float) -> None:
    from pathlib import Path

    from normswap.recipes.steps import MODELS, REPORT, RUN_FILE, SUMMARY
    from normswap.report.report_dir import HTML, MARKDOWN, RESULTS
    from normswap.report.tables import summary_table, text_table

    click.echo("")
    click.echo(text_table(*summary_table(state["summary"])))
    click.echo("")
    if state.get("speed_noise_banner"):
        click.echo(f"*** TOO NOISY TO TELL: {state['speed_noise_banner']}")
        click.echo("")
    click.echo(f"report:  {Path(out) / REPORT / HTML}  (also {MARKDOWN}, {RESULTS})")
    click.echo(f"run:     {out}  ({MODELS}/, recipe.yaml, {RUN_FILE}, {SUMMARY})  in {seconds:.0f} s")


@click.command("run")
@click.argument("recipe", required=False)
@click.option("--out", type=click.Path(file_okay=False), help="Run directory: models/, report/, recipe.yaml, run.json.")
@set_option
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the run in --out: steps whose output is complete and whose options did not change are skipped.",
)
@click.option("--check", is_flag=True, help="Validate the recipe (after --set) and print it resolved; run nothing.")
@click.option("--list", "list_", is_flag=True, help="List the shipped recipes.")
@click.option("--schema", is_flag=True, help="Print every recipe key with its type and default.")
@force_replaces("--out DIR")
@trust_remote_code_option
@json_option
@quiet_option
def run(recipe, out, overrides, resume, check, list_, schema, force, as_json, quiet):
    """Run RECIPE (a YAML file, or the name of a shipped recipe such as `quickstart`) into --out DIR.

    Steps run in order: convert each variant, fine-tune the ones that ask for it, then evaluate
    every model side by side with the source and write DIR/report. DIR also gets the recipe as
    given (recipe.original.yaml) and as run (recipe.yaml, after --set).
    """
    from normswap.errors import NormswapError
    from normswap.recipes import describe_fields, dump_recipe, load_recipe, shipped_recipes

    if schema:
        click.echo(describe_fields())
        return
    if list_:
        import yaml

        recipes = shipped_recipes()
        width = max((len(name) for name in recipes), default=0) + 2
        for name, path in recipes.items():
            data = yaml.safe_load(path.read_text()) or {}
            net = "  [needs network]" if data.get("needs_network") else ""
            click.echo(f"{name:<{width}}{data.get('source', '?')}{net}")
            desc = " ".join(str(data.get("description", "")).split())
            if desc:  # wrapped at word boundaries (never inside a word), indented under the name
                click.echo(
                    textwrap.fill(
                        desc,
                        width=100,
                        initial_indent=" " * width,
                        subsequent_indent=" " * width,
                        break_on_hyphens=False,
                        break_long_words=False,
                    )
                )
        return
    if recipe is None:
        raise NormswapError("give a recipe (a YAML file or a shipped name; `normswap run --list` shows them)")
    loaded = load_recipe(recipe, overrides)
    if check:
        if as_json:
            click.echo(json.dumps(loaded.recipe, indent=2))
        else:
            click.echo(f"# {loaded.path}: valid")
            click.echo(dump_recipe(loaded.recipe), nl=False)
        return
    if not out:
        raise NormswapError("--out DIR is required to run a recipe (or use --check to only validate it)")
    from normswap.publish import output_lock
    from normswap.recipes.steps import check_overlap, run_recipe

    check_overlap(loaded, out)  # before the lock file is made beside DIR (the runner checks again under it)
    t0 = time.perf_counter()
    with output_lock(out, create_parent=True, replaced_whole=False):  # the runner writes into DIR, never renames it
        state = run_recipe(loaded, out, resume=resume, force=force, progress=recipe_progress("run", quiet))
    if as_json:
        click.echo(json.dumps(state, indent=2, default=str))
        return
    print_outcome(state, out, seconds=time.perf_counter() - t0)
