"""`normswap export MODEL DEST --format stock|onnx`."""

from __future__ import annotations

import json

import click

from normswap.cli.options import force_replaces, json_option, onnx_norm_op_option, quiet_option
from normswap.export import EXPORT_TOLERANCE, FORMATS


@click.command()
@click.argument("src", metavar="MODEL")
@click.argument("dest", type=click.Path())
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    required=True,
    help="stock: the converted checkpoint in its source's stock architecture (LayerNorm with γ=1, β=0; no remote "
    "code). onnx: an ONNX graph, its norms written as --onnx-norm-op says (default: onnxruntime's fused "
    "SimplifiedLayerNormalization; needs `pip install normswap[onnx]`).",
)
@click.option(
    "--untie",
    is_flag=True,
    help="stock: give a tied head its own copy of the embedding table so the table's run-time centring moves "
    "into the weights (the export's stream is then zero-mean: RMSNorm-ready; costs vocab x hidden parameters).",
)
@click.option(
    "--tolerance",
    type=float,
    default=EXPORT_TOLERANCE,
    show_default=True,
    help="Publish only if the export and MODEL differ by at most this max |Δ log-prob| "
    "(first output for other models).",
)
@onnx_norm_op_option(multiple=False)
@click.option(
    "--with-past/--no-past",
    "with_past",
    default=None,
    help="onnx: the graph with a key/value cache (past_key_values.N.key/value in, present.N.key/value out; "
    "what a generate loop runs) or the forward alone. Default: with the cache for a causal LM, checked by "
    "greedy generation against PyTorch.",
)
@click.option(
    "--max-shard-size", default="5GB", show_default=True, help="stock: shard the safetensors above this size."
)
@click.option(
    "--quantize",
    "quantize",
    default=None,
    metavar="SCHEME",
    help="onnx: int8 (weights int8 per output channel, activations quantized at run time) by onnxruntime's "
    "quantize_dynamic, after the float32 graph is verified. A converted or sliced model's stream is turned by the "
    "incoherence rotation first (exact; see --no-rotate); a LayerNorm original is quantized without it.",
)
@click.option(
    "--rotate/--no-rotate",
    default=True,
    show_default=True,
    help="--quantize: turn the stream by a seeded random orthogonal matrix before int8 (spreads an outlier "
    "coordinate's energy over all of them).",
)
@click.option("--rotation-seed", type=int, default=0, show_default=True, help="--quantize: the rotation's seed.")
@force_replaces("DEST (never MODEL)")
@json_option
@quiet_option
def export(
    src,
    dest,
    fmt,
    untie,
    tolerance,
    norm_op,
    with_past,
    max_shard_size,
    quantize,
    rotate,
    rotation_seed,
    force,
    as_json,
    quiet,
):
    """Export MODEL (a checkpoint `normswap convert` or `normswap finetune` wrote; onnx: any model) to the new
    directory DEST in another format, verified against MODEL before DEST is published."""
    from normswap.publish import check_output_path

    # before torch loads (export checks again once MODEL is resolved to its files)
    check_output_path(dest, force=force, reads=[("the checkpoint", src)], label="DEST")
    from normswap.export import run_export
    from normswap.progress import command_lines

    say = (lambda m: None) if as_json or quiet else command_lines("export")
    record = run_export(
        src,
        dest,
        fmt,
        force=force,
        untie=untie,
        tolerance=tolerance,
        max_shard_size=max_shard_size,
        norm_op=norm_op,
        with_past=with_past,
        progress=say,
        quantize=quantize,
        rotate=rotate,
        rotation_seed=rotation_seed,
    )
    if as_json:
        click.echo(json.dumps(record, indent=2, default=str))
        return
    ver = record["verification"]
    click.echo(f"exported {src} -> {record['out']}  [{fmt}: {record.get('architecture', '')}]")
    if fmt == "stock":
        _echo_stock(record)
    for key in ("opset", "norm_op"):
        if key in record:
            click.echo(f"  {key.replace('_', ' ')}: {record[key]}")
    if record.get("norm_nodes"):
        click.echo("  norm nodes: " + ", ".join(f"{n} {op}" for op, n in record["norm_nodes"].items()))
    if fmt == "onnx":
        gen = record.get("generation")
        click.echo(
            f"  key/value cache: {len(record['inputs']) - 3} past inputs, generation-ready; greedy tokens identical "
            f"to PyTorch's for {gen['new_tokens']} new tokens x {gen['prompt_rows']} rows"
            if gen and gen["identical"]
            else f"  key/value cache: yes; greedy tokens match PyTorch's up to a tie ({gen['first_difference']})"
            if gen
            else "  key/value cache: none (the forward alone; not generation-ready)"
        )
    click.echo(
        f"  verification ({ver['dtype']}): {ver['metric'].replace('_', ' ')} = {ver['max_abs_diff']:.3g} "
        f"(threshold {ver['threshold']:.2g}): PASSED"
    )
    q = record.get("quantization")
    if q:
        rot = record["incoherence_rotation"]
        click.echo(
            f"  int8: {q['matmuls_quantized']} matmuls quantized ({q['float_matmuls_left']} left float), "
            f"{q['bytes'] / 1e6:.1f} MB (float32 {q['float32_bytes'] / 1e6:.1f} MB); incoherence rotation: "
            + (f"yes (seed {rot['seed']})" if rot["applied"] else f"no ({rot['why']})")
        )
        p = q["probe_vs_model"]
        click.echo(
            f"  int8 against the model on the probe batch: max |Δ log-prob| {p['max_abs_logprob_diff']:.3g}, "
            f"top-1 agreement {p['top1_agreement']:.1%} (recorded, not gated)"
        )


def _echo_stock(record) -> None:
    """What a stock export changed, in lines."""
    click.echo(
        f"  {record['norms_as_layernorm']} RMSNorms as LayerNorm ({record['gamma_beta_set']} γ/β set to 1/0)"
        + ("; head untied" if record["untied"] else "")
    )
    moved = record.get("folded_affine_moved", {})
    if moved:
        back = [n for n, how in moved.items() if how == "gamma_beta"]
        solved = [n for n, how in moved.items() if how == "bias"]
        click.echo(
            "  folded γ/β moved back into the LayerNorm: "
            + "; ".join(
                part
                for part in (
                    f"γ and β restored on {', '.join(back)}" if back else "",
                    f"β/γ as the bias of {len(solved)} norm(s) whose readers have no stock bias" if solved else "",
                )
                if part
            )
        )
    if record["centred_in_weights"]:
        click.echo(f"  run-time centring moved into the weights: {', '.join(record['centred_in_weights'])}")
    for item in record["not_centred"]:
        click.echo(f"  not centred in the weights: {item['module']} ({item['reason']})")
    click.echo(
        "  RMSNorm-ready (its stream is zero-mean): "
        + ("yes" if record["rmsnorm_ready"] else "no; as LayerNorm it is exact")
    )
