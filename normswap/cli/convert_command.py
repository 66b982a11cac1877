"""`normswap convert SRC OUT`."""

from __future__ import annotations

import json

import click

from normswap import declared
from normswap.cli.options import (
    config_options,
    device_option,
    force_option,
    json_option,
    quiet_option,
    trust_remote_code_option,
)
from normswap.convert.config import ConvertOptions


@click.command()
@click.argument("src")
@click.argument("out", type=click.Path())
@config_options(declared.options(ConvertOptions))
@device_option()
@force_option
@trust_remote_code_option
@json_option
@quiet_option
def convert(src, out, device, force, as_json, quiet, **values):
    """Convert the LayerNorm checkpoint SRC (directory, hub id or normswap:NAME) into OUT with RMSNorm."""
    from normswap.convert.config import check_out

    options = declared.build(ConvertOptions, values)
    # before torch loads (an answer in a fraction of a second) and before the lock file is made beside OUT
    check_out(src, out, force=force, family_file=options.family_file)
    from normswap.convert.pipeline import convert_checkpoint
    from normswap.devices import resolve_device
    from normswap.progress import Heartbeat, command_lines
    from normswap.publish import output_lock

    # each stage as it starts; where the output is not a terminal, the current one again every 10 s
    silent = as_json or quiet
    heartbeat = Heartbeat((lambda m: None) if silent else command_lines("convert"), enabled=False if silent else None)
    with output_lock(out), heartbeat:
        result = convert_checkpoint(
            src, out, options, force=force, device=resolve_device(device), progress=heartbeat.say
        )
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
        return
    ver = result["verification"]
    click.echo(
        f"converted {result['source']} -> {result['out']}  [{result['family']}, {result['mode']} mode, "
        f"from {result['source_format']}]"
    )
    click.echo(
        f"  norms replaced: {result['norms_replaced']}   γ: {_counts(result['gamma'])}   β: {_counts(result['beta'])}"
    )
    if result["added_biases"]:
        click.echo(f"  biases created in reading linears: {result['added_biases']}")
    if result["centered_at_runtime"]:
        click.echo(f"  outputs centred at run time: {', '.join(result['centered_at_runtime'])}")
    if result["untied"]:
        click.echo(f"  head untied: parameters {result['parameters_before']:,} -> {result['parameters_after']:,}")
    for item in result["left_alone"]:
        click.echo(f"  left alone: {item['module']} ({item['reason']})")
    for note in result["notes"][:8]:
        click.echo(f"  note: {note}")
    if len(result["notes"]) > 8:
        click.echo(f"  ... {len(result['notes']) - 8} more notes in normswap_manifest.json")
    if ver.get("skipped"):
        click.echo("  verification skipped (--no-verify)")
    else:
        metric = "max |Δ log-prob|" if ver.get("metric") == "max_abs_logprob_diff" else "max |Δ output|"
        floor = f" (source fp32-vs-fp64 floor {ver['noise_floor']:.2g})" if ver.get("noise_floor") is not None else ""
        click.echo(f"  verification: {metric} = {ver['max_abs_diff']:.3g}{floor}")
        if "probe_perplexity_source" in ver:
            click.echo(
                f"  probe perplexity: source {ver['probe_perplexity_source']:.4f}  "
                f"converted {ver['probe_perplexity_converted']:.4f}"
            )
        if ver.get("exact_float64") is not None:
            click.echo(
                f"  exact in float64: {metric} = {ver['exact_float64']:.2g} (threshold {ver['exact_threshold']:.2g}); "
                f"float32 drift from the float64 source {ver['drift_float32']:.2g} (threshold {ver['threshold']:.2g})"
            )
        if ver.get("passed"):
            click.echo(f"  exact: PASSED (threshold {ver['threshold']:.2g}{_float64_part(ver)})")


def _float64_part(ver) -> str:
    """The float64 half of the pass rule, where it was checked (normswap/convert/pass_rule.py)."""
    return f"; float64 threshold {ver['exact_threshold']:.2g}" if ver.get("exact_float64") is not None else ""


def _counts(d):
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items()))
