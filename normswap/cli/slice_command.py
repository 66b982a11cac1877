"""`normswap slice SRC OUT`."""

from __future__ import annotations

import json

import click

from normswap import declared
from normswap.cli.options import (
    config_options,
    data_option,
    device_option,
    force_option,
    json_option,
    quiet_option,
    seed_option,
    trust_remote_code_option,
)
from normswap.slice.config import SliceOptions


@click.command("slice")
@click.argument("src")
@click.argument("out", type=click.Path())
@config_options(declared.options(SliceOptions), shared={"data": data_option, "seed": seed_option})
@device_option()
@force_option
@trust_remote_code_option
@json_option
@quiet_option
def slice_command(src, out, device, force, as_json, quiet, **values):
    """Rotate the residual stream of SRC (a LayerNorm original, converted exactly first, or a normswap
    conversion) onto its principal directions and delete the least-used --fraction of its width into OUT."""
    from normswap.slice.config import check_out, options_from

    options = options_from(None, values)
    check_out(src, out, force=force, data=options.data)  # before torch loads and the lock file is made beside OUT
    from normswap.devices import resolve_device
    from normswap.progress import Heartbeat, command_lines
    from normswap.publish import output_lock
    from normswap.slice.model import check_fraction
    from normswap.slice.sliced_checkpoint import slice_checkpoint

    check_fraction(options.fraction, allow_zero=False)
    silent = as_json or quiet
    heartbeat = Heartbeat((lambda m: None) if silent else command_lines("slice"), enabled=False if silent else None)
    with output_lock(out), heartbeat:
        result = slice_checkpoint(src, out, options, force=force, device=resolve_device(device), progress=heartbeat.say)
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
        return
    ver = result["verification"]
    click.echo(
        f"sliced {result['source']} -> {result['out']}  [width {result['hidden_size']} -> {result['width']}, "
        f"{result['basis']} basis, {result['calibration_tokens']:,} calibration tokens]"
    )
    click.echo(f"  parameters: {result['parameters_before']:,} -> {result['parameters_after']:,}")
    if result.get("head_copy_parameters"):
        fewer = "still fewer" if result["fewer_parameters_than_original"] else "NOT fewer"
        click.echo(
            f"  of which {result['head_copy_parameters']:,} are the head's own copy of the token table (the table "
            f"holds the embedding norm's output now): {fewer} parameters than the original"
        )
    click.echo(
        f"  stream energy kept: {result['kept_energy_total']:.6f} (dropped {result['dropped_energy_total']:.2e})"
    )
    click.echo(f"  head: {result['head']}")
    click.echo(
        f"  rotation alone vs the conversion: max |Δ log-prob| = {ver['max_abs_diff']:.3g} "
        f"(threshold {ver['threshold']:.2g}): PASSED"
    )
    click.echo(f"  per-norm figures: {result['figures']}")
