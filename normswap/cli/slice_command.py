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
from normswap.slice.config import AUTO, SliceOptions

LOW_ENERGY = 0.95  # a kept share of the stream's energy below this is flagged in one line


class FractionType(click.ParamType):
    """--fraction: a number, or the word auto (the search, slice/auto.py); bounds are SliceOptions'."""

    name = "FRACTION|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, float) or value == AUTO:
            return value
        try:
            return float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither a number nor auto", param, ctx)


def _fraction_option():
    field = next(f for f in declared.options(SliceOptions) if f.name == "fraction")
    return click.option(
        "--fraction", "fraction", type=FractionType(), default=field.default, show_default=True,
        help=field.metadata["help"],
    )  # fmt: skip


@click.command("slice")
@click.argument("src")
@click.argument("out", type=click.Path())
@config_options(
    declared.options(SliceOptions),
    shared={"data": data_option, "seed": seed_option, "fraction": _fraction_option()},
)
@device_option()
@force_option
@trust_remote_code_option
@json_option
@quiet_option
def slice_command(src, out, device, force, as_json, quiet, **values):
    """Rotate the residual stream of SRC (a LayerNorm original, converted exactly first, or a normswap
    conversion) onto its principal directions and delete the least-used --fraction of its width into OUT."""
    from normswap.slice.config import check_out, is_auto, options_from

    options = options_from(None, values)
    check_out(src, out, force=force, data=options.data)  # before torch loads and the lock file is made beside OUT
    from normswap.devices import resolve_device
    from normswap.progress import Heartbeat, command_lines
    from normswap.publish import output_lock
    from normswap.slice.model import check_fraction
    from normswap.slice.sliced_checkpoint import slice_checkpoint

    if not is_auto(options):
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
    if result.get("auto"):
        _echo_auto(result["auto"], result["hidden_size"])
    click.echo(
        f"  rotation alone vs the conversion: max |Δ log-prob| = {ver['max_abs_diff']:.3g} "
        f"(threshold {ver['threshold']:.2g}): PASSED"
    )
    if result["kept_energy_total"] < LOW_ENERGY:
        click.echo(
            f"  warning: the kept width holds {result['kept_energy_total']:.1%} of the stream's energy (below "
            f"{LOW_ENERGY:.0%}): expect a large loss before healing; a smaller --fraction keeps more"
        )
    ppl = result.get("perplexity") or {}
    if ppl.get("source") is not None:
        click.echo(
            f"  held-out perplexity ({ppl['tokens']:,} tokens, {ppl['split']} split): {ppl['source']:.3f} -> "
            f"{ppl['sliced']:.3f} (x{ppl['ratio']:.4f})"
        )
    if result.get("data") == "embedded":
        click.echo("  calibration text: the embedded KJV corpus (its training split; the test books never read)")
    peak = result.get("peak_rss_bytes")
    click.echo(f"  took {result['seconds']:.1f} s" + (f", peak memory {peak / 2**30:.2f} GiB" if peak else ""))
    click.echo(f"  per-norm figures: {result['figures']}")


def _echo_auto(record: dict, d: int) -> None:
    """The widths --fraction auto tried, in the order tried, and the one chosen."""
    click.echo(
        f"  --fraction auto (held-out perplexity within +{record['max_ppl_increase']:g} % of "
        f"{record['source_perplexity']:.4f}; tried {len(record['tried'])} widths by bisection):"
    )
    for t in record["tried"]:
        verdict = "passes" if t["passed"] else "fails"
        click.echo(
            f"    width {t['width']:>5} of {d} (fraction {t['fraction']:.4f}): perplexity {t['perplexity']:.4f} "
            f"({t['increase_pct']:+.3f} %) {verdict}"
        )
    chosen = record["chosen"]
    click.echo(f"    chosen: width {chosen['width']} (fraction {chosen['fraction']:.4f})")
