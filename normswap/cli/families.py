"""`normswap families`: the supported families, straight from the data files."""

from __future__ import annotations

import json

import click

from normswap.cli.options import json_option


def family_rows() -> list[dict]:
    from normswap.architectures import all_families

    rows = []
    for fam in all_families():
        if isinstance(fam.placement, str):
            placement = fam.placement
        else:
            vals = fam.placement["values"]
            post = [v for v, p in vals.items() if p == "post"]
            placement = f"pre (post if {fam.placement['attribute']}={'/'.join(post)})"
        rows.append({
            "name": fam.name,
            "display": fam.display,
            "model_types": list(fam.model_types),
            "placement": placement,
            "exact": "pre" in placement,
            "norms_per_layer": len({n.norm for n in fam.norms}),
            "left_alone": [la.reason for la in fam.leave_alone],
            "examples": list(fam.examples),
            "notes": fam.notes,
            "data_file": fam.source,
        })
    return rows


def markdown_table(rows) -> str:
    lines = ["| family | model_type | LayerNorm placement | exact mode | left alone | example hub ids |", "|---|---|---|---|---|---|"]
    for r in rows:
        exact = "yes" if r["exact"] and "post" not in r["placement"] else ("pre-LN layouts" if r["exact"] else "no: approx + heal")
        left = "per-head q/k norms" if r["left_alone"] else ""
        lines.append(f"| {r['display']} | `{', '.join(r['model_types'])}` | {r['placement']} | {exact} | {left} | {', '.join(f'`{e}`' for e in r['examples'])} |")
    return "\n".join(lines)


@click.command()
@json_option
@click.option("--markdown", is_flag=True, help="The README's supported-family table.")
def families(as_json, markdown):
    """List the LayerNorm families normswap knows (one data file each)."""
    rows = family_rows()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif markdown:
        click.echo(markdown_table(rows))
    else:
        width = max(len(r["display"]) for r in rows)
        types = max(len(", ".join(r["model_types"])) for r in rows)
        for r in rows:  # the long placement text goes last so the other columns stay aligned
            click.echo(f"{r['display']:<{width}}  {', '.join(r['model_types']):<{types}}  {r['placement']}")
