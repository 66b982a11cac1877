"""`normswap families`: the command; what it lists, discovers and surveys is normswap/architectures/'s
(catalog.py, model_family.py, survey.py), the matrix normswap/compat/'s."""

from __future__ import annotations

import json

import click

from normswap import bounded_load
from normswap.cli.options import OutputFile, force_replaces, json_option, option


def markdown_file_option(what: str):
    """``--markdown FILE``: the table written to a file (``--out FILE`` still accepted; --out is a directory
    everywhere else)."""
    return option(
        "--markdown",
        "out",
        aliases=("--out",),
        type=OutputFile(),
        default=None,
        help=f"Write {what} here (default: stdout).",
    )


def save_rows_option(what: str):
    """``--save FILE``: the rows as JSON (``--save-json FILE`` still accepted)."""
    return option(
        "--save",
        "save_json",
        aliases=("--save-json",),
        type=OutputFile(),
        default=None,
        help=f"Also write {what} as JSON here.",
    )


def _check_outputs(force: bool, reads, **outputs) -> None:
    """Every file this command writes, checked before any work (normswap.publish.check_output_file):
    an existing file needs --force, and none may be or lie in what the command reads."""
    from normswap.publish import check_output_file

    for flag, path in outputs.items():
        if path is not None:
            check_output_file(path, force=force, reads=reads, label=f"--{flag.replace('_', '-')}")


@click.group(invoke_without_command=True)
@json_option
@option(
    "--markdown-table",
    "markdown",
    aliases=("--markdown",),
    is_flag=True,
    help="Print the supported-family table of docs/convert.md (markdown).",
)
@click.option(
    "--all",
    "show_all",
    is_flag=True,
    help=(
        "Also list the architectures without a family file that convert through discovery (from the committed survey)."
    ),
)
@click.pass_context
def families(ctx, as_json, markdown, show_all):
    """List the LayerNorm families normswap knows (one data file each); discover new ones."""
    if ctx.invoked_subcommand is not None:
        return
    from normswap.architectures.catalog import discovered_rows, family_rows, markdown_table

    rows = family_rows() + (discovered_rows() if show_all else [])
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif markdown:
        click.echo(markdown_table(rows))
    else:
        width = max(len(r["display"]) for r in rows)
        types = max(len(", ".join(r["model_types"])) for r in rows)
        for r in rows:  # the long placement text goes last so the other columns stay aligned
            click.echo(f"{r['display']:<{width}}  {', '.join(r['model_types']):<{types}}  {r['placement']}")
        if not show_all:
            found = discovered_rows()
            exact = sum(r["exact"] for r in found)
            click.echo(
                f"normswap: {len(found)} more architectures convert through discovery ({exact} exactly), "
                "checked on tiny configs: `normswap families --all` lists them",
                err=True,
            )


@families.command()
@click.argument("model")
@option(
    "--family-file",
    "out",
    aliases=("--out",),
    type=OutputFile(),
    default=None,
    help="Write the family file (YAML; what `convert --family-file` reads) here instead of printing it.",
)
@force_replaces("--family-file")
@json_option
def discover(model, out, force, as_json):
    """Derive a family description from MODEL (a model directory, config.json, hub id or converted
    checkpoint), check it by converting a tiny randomised instance, and print or save it."""
    _check_outputs(force, [("the model", model)], family_file=out)
    from normswap.architectures.model_family import family_description
    from normswap.convert.inplace import convert_tiny

    result = family_description(model, out, convert=convert_tiny)
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
        return
    if out is None:
        click.echo(result["yaml"], nl=False)
    check = result["check"]
    verdict = {True: "exact", False: "NOT exact (refused)", None: "post-LN: approximate mode only"}[check.get("exact")]
    diff = (
        f", max |Δ| {check['max_abs_diff']:.2g} (threshold {check['threshold']:.2g})"
        if check.get("max_abs_diff") is not None
        else ""
    )
    click.echo(
        f"{result['model_type']}: {verdict} on a tiny randomised instance{diff}"
        + (f": {check['reason']}" if check.get("reason") else ""),
        err=True,
    )
    if out:
        click.echo(f"wrote {out}", err=True)


@families.command()
@markdown_file_option("the markdown table")
@click.option("--only", multiple=True, help="Survey only these model_types (repeatable).")
@click.option("--jobs", type=int, default=1, show_default=True, help="Worker processes.")
@save_rows_option("the rows")
@click.option(
    "--shard",
    default=None,
    metavar="K/N",
    help="Survey only the K-th of N equal slices of the model_types (runs that fit a time slot).",
)
@click.option(
    "--from-json",
    "from_json",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Tabulate rows saved by --save (repeatable, e.g. one file per shard) instead of running.",
)
@click.option(
    "--update",
    multiple=True,
    type=click.Choice(["exact", "approx-only", "refused", "untraceable", "not-built", "no-layernorm"]),
    help=(
        "With --from-json: re-run the rows of this status (repeatable) and keep the others; "
        "the table says which rows are from which run."
    ),
)
@force_replaces("the --markdown and --save files")
@json_option
def survey(out, only, jobs, save_json, shard, from_json, update, force, as_json):
    """Try discovery on every config class of the installed transformers that builds a model with
    LayerNorm-like modules, and tabulate exact / approximate-only / refused with the reason."""
    _check_outputs(force, [("the saved rows", f) for f in from_json], markdown=out, save=save_json)
    from normswap.architectures.survey import load_rows, model_types, run_survey, shard_of, survey_markdown, update_rows
    from normswap.convert.inplace import convert_tiny

    names = list(only) or (shard_of(model_types(), shard) if shard else None)
    if from_json and update:
        rows = update_rows(
            load_rows(from_json),
            statuses=update,
            convert=convert_tiny,
            progress=lambda m: click.echo(m, err=True),
            jobs=jobs,
        )
    elif from_json:
        rows = load_rows(from_json)
    else:
        rows = run_survey(convert=convert_tiny, only=names, progress=lambda m: click.echo(m, err=True), jobs=jobs)
    if save_json:
        from normswap.publish import atomic_write_text

        atomic_write_text(save_json, json.dumps(rows, indent=1, default=str) + "\n")
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    text = survey_markdown(rows)
    if out:
        from normswap.publish import atomic_write_text

        atomic_write_text(out, text)
        click.echo(f"wrote {out}", err=True)
    else:
        click.echo(text, nl=False)


@families.command()
@markdown_file_option("the markdown table")
@save_rows_option("every cell (status, reason, relative difference, seconds), saved after each row,")
@click.option("--only", multiple=True, help="Only these rows (a family name or a discovered model_type; repeatable).")
@click.option("--column", "only_columns", multiple=True, help="Only these columns (entry points; repeatable).")
@click.option(
    "--row-seconds",
    type=float,
    default=300,
    show_default=True,
    help="Time cap per row; checks not started before it are reported as not run.",
)
@click.option(
    "--from-json",
    "from_json",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help=(
        "Tabulate rows saved by --save instead of running (repeatable: shards run side by side; "
        "a row in a later file replaces the same row in an earlier one)."
    ),
)
@click.option("--list-rows", is_flag=True, help="Print the row names (one a line) and exit.")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Keep each finished row here and reuse it while its inputs are unchanged (default: normswap's private "
    "cache, compat-matrix/; must be yours alone).",
)
@click.option("--no-cache", is_flag=True, help="Run every row; read and keep nothing.")
@force_replaces("the --markdown and --save files")
@json_option
def matrix(out, save_json, only, only_columns, row_seconds, from_json, list_rows, cache_dir, no_cache, force, as_json):
    """Compatibility matrix: every curated family and every architecture discovery converts exactly
    (tiny randomised models), against every entry point users load a model with (Auto classes,
    pipeline(), Trainer, PEFT LoRA, sentence-transformers, generate with a KV cache, torch.compile,
    a save/load round trip), original side by side with its conversion."""
    import shlex
    import time

    from normswap.compat import matrix as mx
    from normswap.compat.cache import RowCache
    from normswap.compat.rows import all_rows
    from normswap.errors import NormswapError
    from normswap.publish import atomic_write_text

    command = (
        "normswap families matrix"
        + "".join(f" --only {shlex.quote(o)}" for o in only)
        + "".join(f" --column {shlex.quote(c)}" for c in only_columns)
        + f" --row-seconds {row_seconds:g}"
    )
    if list_rows:
        click.echo("\n".join(r.name for r in all_rows()))
        return
    _check_outputs(force, [("the saved rows", f) for f in from_json], markdown=out, save=save_json)
    if from_json:
        records, metas = [], []
        for path in from_json:
            try:
                saved = bounded_load.load_json(path, what="a saved matrix", max_bytes=64 << 20, follow=True)
                # a row in a later file replaces the same row in an earlier one, where it stood (a re-run
                # of a few rows leaves the table in its order); new rows go at the end
                later = {r["name"]: r for r in saved["rows"]}
                records = [later.pop(r["name"], r) for r in records] + list(later.values())
                metas.append(saved["meta"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise NormswapError(
                    f"{path} is not a file written by `normswap families matrix --save` ({e})"
                ) from None
        meta = mx.merge_meta(metas)
        if save_json:
            atomic_write_text(save_json, mx.as_json(records, meta))
    else:
        rows = all_rows()
        if only:
            unknown = sorted(set(only) - {r.name for r in rows})
            if unknown:
                raise NormswapError(
                    f"no matrix row named {unknown[0]!r}: rows are the curated families and the "
                    "architectures discovery converts exactly (`normswap families --all`)"
                )
            by_name = {r.name: r for r in rows}
            rows = [by_name[name] for name in dict.fromkeys(only)]  # in the order asked for
        known = mx.columns()
        if set(only_columns) - set(known):
            raise NormswapError(
                f"no matrix column named {sorted(set(only_columns) - set(known))[0]!r}: columns are {', '.join(known)}"
            )
        mx.preload()
        t0 = time.perf_counter()

        def save(records, meta=None):
            if save_json:
                meta = meta or mx.meta(command, time.perf_counter() - t0, row_seconds)
                atomic_write_text(save_json, mx.as_json(records, meta))

        say = lambda m: click.echo(m, err=True)  # noqa: E731
        cache = None if no_cache else RowCache(cache_dir, say=say)
        records = mx.run_matrix(
            rows,
            row_seconds=row_seconds,
            progress=say,
            on_record=save,
            only_columns=only_columns or None,
            cache=cache,
        )
        meta = mx.meta(command, time.perf_counter() - t0, row_seconds)
        save(records, meta)  # the saved JSON and the markdown state the same duration
    if as_json:
        click.echo(mx.as_json(records, meta), nl=False)
        return
    text = mx.markdown(records, meta)
    if out:
        atomic_write_text(out, text)
        click.echo(f"wrote {out}", err=True)
    else:
        click.echo(text, nl=False)
