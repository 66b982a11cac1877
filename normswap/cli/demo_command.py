"""`normswap demo --out DIR`: the whole product in one command, on a CPU, offline, in minutes.

Runs the shipped `quickstart` recipe on the shipped reference model: the original, its exact
RMSNorm conversion (same perplexity), an approximate conversion with β dropped (perplexity jumps)
and that conversion healed by a short warmup fine-tune (perplexity recovers), the exact conversion
sliced to 75 % of its width (normswap slice) and healed the same way, with throughput
(beside a null control), peak memory and the shipped lm-eval task; then prints the table and
where the report is.
"""

from __future__ import annotations

import time

import click

from normswap.cli.options import force_replaces, quiet_option
from normswap.cli.run_command import print_outcome, recipe_progress, set_option

# --quick (CI): the same pipeline with a shorter fine-tune and smaller evaluation. The fine-tune
# still has to move the approx model's perplexity back down, so it is shortened, not skipped.
QUICK = (
    "finetune.steps=20",
    "finetune.warmup_steps=2",
    "finetune.eval_tokens=2048",
    "eval.max_tokens=4096",
    "eval.repeats=2",
    "eval.min_time=0.05",
    "eval.new_tokens=8",
    "eval.diagnostics=false",
    "eval.lm_eval_limit=2",
)


@click.command("demo")
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default="normswap-demo",
    show_default=True,
    help="Run directory (models/, report/).",
)
@set_option
@click.option("--quick", is_flag=True, help="Shorter fine-tune and evaluation (CI smoke run, ~1 minute).")
@click.option("--resume", is_flag=True, help="Keep the finished steps of a previous demo in --out.")
@force_replaces("--out DIR")
@quiet_option
def demo(out, overrides, quick, resume, force, quiet):
    """Run the quickstart recipe end to end: convert exact + approx, slice the exact conversion to 75 % of
    its width, heal the approximate and the sliced models, evaluate all side by side, report."""
    from normswap.recipes import load_recipe
    from normswap.recipes.steps import run_recipe

    t0 = time.perf_counter()
    loaded = load_recipe("quickstart", (QUICK if quick else ()) + tuple(overrides))
    say = recipe_progress("demo", quiet)
    say(f"recipe quickstart{' (--quick)' if quick else ''} on {loaded.recipe['source']} -> {out}")
    state = run_recipe(loaded, out, resume=resume, force=force, progress=say)
    print_outcome(state, out, seconds=time.perf_counter() - t0)
