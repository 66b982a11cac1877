"""`normswap study [MODEL|CONFIG] --out DIR`: LayerNorm and RMSNorm arms of the same model trained side
by side (interleaved step by step in one process), several seeds, paired verdicts.

The options are generated from ``normswap.study.config.StudyConfig`` (one declaration for the CLI,
the recipe schema's ``study:`` step and the validation); options shared with other commands keep
their shared declaration from cli/options.py.

Also runs under several processes with the same options (the global batch is split):
    torchrun --nproc_per_node 2 -m normswap study --out DIR ...          (works on CPU, gloo)
"""

from __future__ import annotations

import json
import os

import click
from click.core import ParameterSource

from normswap.cli.options import (
    config_options,
    data_option,
    device_option,
    force_replaces,
    json_option,
    trust_remote_code_option,
)
from normswap.study.config import DEFAULT_MODEL, options

SHARED = {"data": data_option, "device": device_option(), "force": force_replaces("--out DIR")}


@click.command("study")
@click.argument("model", required=False)
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="The study directory DIR.")
@config_options([f for f in options() if f.metadata["cli"]], SHARED)
@trust_remote_code_option
@json_option
@click.pass_context
def study(ctx, model, out, as_json, **opts):
    """Train arms of MODEL (default: normswap:kjv-gpt2's architecture over bytes, randomly initialised)
    side by side — layernorm, rmsnorm (γ = 1), a layernorm null control, a planted handicap (layernorm
    at 0.7 × the rate: the test must call it different) and, from a trained checkpoint, normswap's exact
    and approximate conversions — and report the paired differences with 95 % intervals.

    MODEL is a checkpoint (continued training from its weights), a config.json or a directory holding
    only one (random initialisation per seed), or any model with --from-scratch. DIR receives
    results.json (docs/study-schema.md), report.md, report.html, the plots and units/ (one file per
    finished arm × seed × rate; `--resume` keeps them).
    """
    from normswap.network import require_hub
    from normswap.publish import output_lock
    from normswap.study.config import StudyConfig
    from normswap.study.runner import run_study

    given = {
        n for n in opts if ctx.get_parameter_source(n) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    }
    if model is not None:
        given.add("model")
    spec = model or DEFAULT_MODEL
    if model is None:  # the default study: the shipped model's architecture, randomly initialised
        opts["from_scratch"] = True
    require_hub(models=(spec,), data=opts.get("data"))
    cfg = StudyConfig(model=spec, out=out, **opts)
    import contextlib

    with output_lock(out, create_parent=True) if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext():
        results = run_study(cfg, given=given)
    if not results:
        return  # not process 0
    if as_json:
        click.echo(
            json.dumps(
                {
                    k: results.get(k)
                    for k in (
                        "model",
                        "setup",
                        "comparisons",
                        "null_control",
                        "claims",
                        "instrument_check",
                        "power",
                        "speed_phase",
                        "timing",
                    )
                },
                indent=2,
            )
        )
        return
    from normswap.study.presentation.study_report import summary_lines

    for line in summary_lines(results, out):
        click.echo(line)
