"""`normswap models`: list the reference models shipped inside the package."""

from __future__ import annotations

import json

import click

from normswap.cli.options import json_option


def _human(n) -> str:
    if n is None:
        return "?"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


@click.command("models")
@json_option
def models(as_json):
    """List shipped models (use them as normswap:NAME)."""
    from normswap.assets.models import list_models

    rows = list_models()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no shipped models are installed")
        return
    header = ("MODEL", "FAMILY", "PARAMS", "CONTEXT", "VAL PPL", "SIZE")
    table = [header] + [
        (
            r["spec"],
            str(r["family"]),
            _human(r["parameters"]),
            str(r["context_length"]),
            f"{r['perplexity']:.1f}" if r["perplexity"] is not None else "?",
            f"{r['size_bytes'] / 1e6:.1f} MB",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    click.echo("")
    for r in rows:
        click.echo(f"{r['spec']}: {r['description']}")
