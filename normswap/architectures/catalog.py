"""What `normswap families` lists: the curated families (one data file each) and the architectures the
committed survey converted through discovery, as rows and as the markdown table of docs/convert.md."""

from __future__ import annotations

from normswap.architectures.registry import all_families
from normswap.architectures.survey import shipped_rows


def family_rows() -> list[dict]:
    rows = []
    for fam in all_families():
        if isinstance(fam.placement, str):
            placement = fam.placement
        else:
            vals = fam.placement["values"]
            post = [v for v, p in vals.items() if p == "post"]
            placement = f"pre (post if {fam.placement['attribute']}={'/'.join(post)})"
        rows.append(
            {
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
            }
        )
    return rows


def discovered_rows() -> list[dict]:
    """Architectures without a family file that the committed survey converted (exact or approximate):
    what `normswap families --all` adds. They are re-discovered and re-checked at every convert."""
    rows = []
    for r in shipped_rows():
        if r.get("curated") or r["status"] not in ("exact", "approx-only"):
            continue
        exact = r["status"] == "exact"
        rows.append(
            {
                "name": r["model_type"],
                "display": f"{r.get('class', r['model_type'])} (discovered)",
                "model_types": [r["model_type"]],
                "placement": "pre" if exact else "post",
                "exact": exact,
                "norms_per_layer": None,
                "left_alone": [],
                "examples": [],
                "notes": r.get("reason", ""),
                "data_file": None,
                "discovered": True,
            }
        )
    return rows


def markdown_table(rows) -> str:
    lines = [
        "| family | model_type | LayerNorm placement | exact mode | left alone | example hub ids |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        exact = (
            "yes"
            if r["exact"] and "post" not in r["placement"]
            else ("pre-LN layouts" if r["exact"] else "no: approx + heal")
        )
        left = "per-head q/k norms" if r["left_alone"] else ""
        lines.append(
            f"| {r['display']} | `{', '.join(r['model_types'])}` | {r['placement']} | {exact} | "
            f"{left} | {', '.join(f'`{e}`' for e in r['examples'])} |"
        )
    return "\n".join(lines)
