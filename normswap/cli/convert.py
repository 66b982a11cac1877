"""`normswap convert SRC OUT`."""

from __future__ import annotations

import json

import click

from normswap.cli.options import device_option, force_option, json_option, trust_remote_code_option
from normswap.convert.choices import BETA_CHOICES, DEFAULT_TOLERANCE, GAMMA_CHOICES, MODES, OUTPUT_DTYPES


@click.command()
@click.argument("src")
@click.argument("out", type=click.Path())
@click.option("--mode", type=click.Choice(MODES), default="auto", show_default=True,
              help="exact: centre residual writers so RMSNorm == LayerNorm (pre-LN only). approx: swap without centring, then heal with `normswap finetune`. auto: exact for pre-LN, approx for post-LN.")
@click.option("--gamma", type=click.Choice(GAMMA_CHOICES), default=None,
              help="What to do with each LayerNorm's weight: fold into the reading linears (default where possible), keep on the RMSNorm (default elsewhere), or reset to 1 (lossy).")
@click.option("--beta", type=click.Choice(BETA_CHOICES), default=None,
              help="What to do with each LayerNorm's bias: fold into the reading linears (default where possible), keep as an RMSNorm bias (default elsewhere), or drop (lossy).")
@click.option("--untie", is_flag=True, help="Untie a tied output head so the final norm folds into it (costs vocab x hidden parameters).")
@click.option("--dtype", type=click.Choice(OUTPUT_DTYPES), default="auto", show_default=True,
              help="Output dtype (auto: the source's).")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Shard the safetensors above this size.")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Run a probe batch through SRC and the staged OUT (one module at a time, bounded memory) before publishing OUT.")
@click.option("--tolerance", type=float, default=DEFAULT_TOLERANCE, show_default=True,
              help="Exact mode fails above this max |Δ log-prob| (or 4x the measured float32 / rounding floor, if larger).")
@click.option("--family-file", type=click.Path(dir_okay=False), default=None,
              help="Use this family file (YAML, e.g. saved by `normswap families discover --out`) instead of the curated or discovered plan; it must pass the same exactness check on a tiny instance.")
@device_option(default="cpu")
@force_option
@trust_remote_code_option
@json_option
def convert(src, out, mode, gamma, beta, untie, dtype, max_shard_size, verify, tolerance, family_file, device, force, as_json):
    """Convert the LayerNorm checkpoint SRC (directory, hub id or normswap:NAME) into OUT with RMSNorm."""
    from normswap.convert.pipeline import check_out, convert_checkpoint
    from normswap.devices import resolve_device
    from normswap.publish import output_lock

    check_out(src, out, force=force, family_file=family_file)  # before the lock file is made beside OUT
    say = (lambda m: None) if as_json else (lambda m: click.echo(f"normswap: {m}", err=True))
    with output_lock(out):
        result = convert_checkpoint(src, out, mode=mode, gamma=gamma, beta=beta, untie=untie, dtype=dtype, force=force,
                                    verify=verify, tolerance=tolerance, max_shard_size=max_shard_size,
                                    device=resolve_device(device), progress=say, family_file=family_file)
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
        return
    ver = result["verification"]
    click.echo(f"converted {result['source']} -> {result['out']}  [{result['family']}, {result['mode']} mode, from {result['source_format']}]")
    click.echo(f"  norms replaced: {result['norms_replaced']}   γ: {_counts(result['gamma'])}   β: {_counts(result['beta'])}")
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
            click.echo(f"  probe perplexity: source {ver['probe_perplexity_source']:.4f}  converted {ver['probe_perplexity_converted']:.4f}")
        if ver.get("passed"):
            click.echo(f"  exact: PASSED (threshold {ver['threshold']:.2g})")


def _counts(d):
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items()))
