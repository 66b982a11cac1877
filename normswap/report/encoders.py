"""The report's encoder section: fidelity to the reference (table rows and one figure).

Encoders have no perplexity; each model row of results.json carries ``fidelity`` (see
normswap/evaluate/fidelity.py). This module renders it for report.md, report.html, the terminal
and fidelity.png; render.py and plots.py call it where the section belongs.
"""

from __future__ import annotations

import html
from pathlib import Path

HEADER = [
    "model",
    "kind",
    "hidden cosine",
    "embedding cosine (mean)",
    "embedding cosine (worst)",
    "masked ppl",
    "top-1 agreement",
]
CAPTION = (
    "Fidelity to the reference on the held-out text: cosine of the last hidden states per token, of mean-pooled "
    "sentence embeddings (mean and worst sentence), and at 15 % masked positions the masked-token perplexity and "
    "how often the top guess agrees with the reference's (1.0 = identical)."
)


def _f(x, digits=4):
    return "–" if x is None else f"{x:.{digits}f}"


def _g(x):
    return "–" if x is None else f"{x:.2e}"


def has_fidelity(results) -> bool:
    return any(m.get("fidelity") for m in results["models"])


PROBE_HEADER = ["model", "kind", "main output cosine", "worst output cosine", "max |Δ|", "max |Δ| / max |ref|"]
PROBE_CAPTION = (
    "Fidelity to the reference on the same seeded probe inputs (images / audio features of the model's shape): "
    "cosine of the main output (last hidden state, else logits) per position, of the worst output, and the "
    "largest absolute and relative difference over every output (1.0 and 0 = identical)."
)


def _probed(results) -> bool:
    return (results.get("fidelity_setup") or {}).get("method") == "probe inputs"


def caption(results) -> str:
    return PROBE_CAPTION if _probed(results) else CAPTION


def fidelity_rows(results) -> tuple[list[str], list[list[str]]]:
    if _probed(results):  # models without text input (evaluate/fidelity.py: probe_fidelity)
        return PROBE_HEADER, [
            [
                m["name"],
                m.get("kind", ""),
                _f((m.get("fidelity") or {}).get("hidden_cosine"), 6),
                _f((m.get("fidelity") or {}).get("output_cosine"), 6),
                _g((m.get("fidelity") or {}).get("max_abs_diff")),
                _g((m.get("fidelity") or {}).get("max_rel_diff")),
            ]
            for m in results["models"]
        ]
    rows = []
    for m in results["models"]:
        f = m.get("fidelity") or {}
        agree = f.get("top1_agreement")
        rows.append(
            [
                m["name"],
                m.get("kind", ""),
                _f(f.get("hidden_cosine")),
                _f(f.get("embedding_cosine")),
                _f(f.get("embedding_cosine_min")),
                _f(f.get("masked_perplexity"), 3),
                "–" if agree is None else f"{agree * 100:.1f}%",
            ]
        )
    return HEADER, rows


def _reference(results) -> str:
    return (results.get("fidelity_setup") or {}).get("reference") or results.get("baseline") or ""


def markdown_section(results) -> list[str]:
    if not has_fidelity(results):
        return []
    header, rows = fidelity_rows(results)
    from normswap.report.tables import markdown_table

    return [f"## Fidelity to {_reference(results)}", "", caption(results), ""] + markdown_table(header, rows) + [""]


def html_section(results) -> str:
    if not has_fidelity(results):
        return ""
    e = html.escape
    header, rows = fidelity_rows(results)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return (
        f"<h2>Fidelity to {e(_reference(results))}</h2><p class='sub'>{e(caption(results))}</p>"
        "<div class='tablewrap'><table class='text2'>"
        "<thead><tr>"
        + "".join(f"<th>{e(h)}</th>" for h in header)
        + f"</tr></thead><tbody>{body}</tbody></table></div>"
    )


def fidelity_plot(results, out: Path) -> Path | None:
    """Bars of 1 − cosine on a log scale: 0.999 and 0.99 differ by a factor of ten, which a linear
    0..1 axis would hide."""
    if _probed(results):  # the figure's bars are the text measures; the table holds the probe-input ones
        return None
    models = [m for m in results["models"] if m.get("fidelity") and m["name"] != _reference(results)]
    if not models:
        return None
    from normswap.report.plots import colors, plt, save_figure, style_axes

    c = colors(results)
    keys = (
        ("hidden_cosine", "hidden states"),
        ("embedding_cosine", "sentence embedding (mean)"),
        ("embedding_cosine_min", "sentence embedding (worst)"),
    )
    fig, ax = plt.subplots(figsize=(9, 3.4))
    width = 0.8 / len(models)
    for i, m in enumerate(models):
        vals = [max(1.0 - (m["fidelity"].get(k) or 0.0), 1e-7) for k, _ in keys]
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(keys))]
        bars = ax.bar(xs, vals, width * 0.9, color=c[m["name"]], label=m["name"])
        for bar, k in zip(bars, keys):
            v = m["fidelity"].get(k[0])
            ax.annotate(
                _f(v),
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
    ax.set_yscale("log")
    import math

    heights = [max(1.0 - (m["fidelity"].get(k) or 0.0), 1e-7) for m in models for k, _ in keys]
    ax.set_ylim(10 ** math.floor(math.log10(min(heights))), 10 ** (math.ceil(math.log10(max(heights))) + 0.3))
    ax.set_xticks(range(len(keys)), [label for _, label in keys], fontsize=9)
    ax.set_ylabel("1 − cosine (lower is closer)")
    ax.set_title(f"distance to {_reference(results)} (labels: cosine)", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    style_axes(ax)
    return save_figure(fig, Path(out) / "fidelity.png")
