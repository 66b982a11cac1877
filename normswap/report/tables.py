"""Tables of results as text: laid out for a terminal or as markdown, and the run summary's table.

Every table normswap prints or writes (``normswap eval``, ``normswap run``, report.md, summary.md)
is a header and rows of strings laid out here; what goes in the cells stays with the caller.
"""

from __future__ import annotations

from normswap.evaluate.stats import NO_DIFFERENCE, TOO_NOISY


def text_table(header, rows) -> str:
    """Columns padded to their widest cell, the first left-aligned, the others right-aligned, and a
    rule under the header."""
    table = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = []
    for j, r in enumerate(table):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(header, rows, *, numbers: bool = False) -> list[str]:
    """The lines of a markdown table; ``numbers``: right-align every column after the first. A
    ``|`` inside a cell would end it early, so it is written as ``/``."""
    rule = ["---"] + [("---:" if numbers else "---")] * (len(header) - 1)
    return ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"] + [
        "| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows
    ]


# ------------------------------------------------------------------------------ run summary
def summary_rows(results: dict) -> list[dict]:
    """The numbers `normswap run` prints at the end (run.json's ``summary``): one row per model,
    against the baseline."""
    base = next((m for m in results["models"] if m["name"] == results.get("baseline")), None)
    rows = []
    for m in results["models"]:
        ppl = m.get("perplexity")
        bppl = base.get("perplexity") if base else None
        fwd = ((m.get("ratios") or {}).get("tokens_per_second") or {}).get("forward")
        fwd_iv = (((m.get("ratio_intervals") or {}).get("tokens_per_second")) or {}).get("forward")
        fid = m.get("fidelity") or {}
        rows.append(
            {
                "model": m["name"],
                "kind": m.get("kind"),
                "baseline": base is not None and m["name"] == base["name"],
                "perplexity": ppl,
                "delta_vs_original": (ppl / bppl - 1.0) if (ppl is not None and bppl) else None,
                "forward_tokens_per_second": (m.get("tokens_per_second") or {}).get("forward"),
                "forward_ratio": fwd,
                "forward_ratio_range": [fwd_iv["low"], fwd_iv["high"]] if fwd_iv else None,
                "forward_verdict": fwd_iv["verdict"] if fwd_iv else None,
                "hidden_cosine": fid.get("hidden_cosine"),
                "embedding_cosine": fid.get("embedding_cosine"),
                "masked_perplexity": fid.get("masked_perplexity"),
                "top1_agreement": fid.get("top1_agreement"),
            }
        )
    return rows


def signed_percent(percent: float, digits: int = 2) -> str:
    """``+1.80%`` / ``-0.27%``; a value that rounds to zero is ``0.00%``, never ``-0.00%``."""
    if round(percent, digits) == 0:
        return f"{0:.{digits}f}%"
    return f"{percent:+.{digits}f}%"


def _pct(x):
    return "–" if x is None else signed_percent(x * 100)


def _num(x, spec):
    return "–" if x is None else format(x, spec)


def summary_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the run summary (columns only for what was measured)."""
    fidelity = any(r.get("hidden_cosine") is not None for r in rows)
    perplexity = any(r.get("perplexity") is not None for r in rows)
    speed = any(r.get("forward_ratio") is not None for r in rows)
    header = ["model"]
    if perplexity:
        header += ["perplexity", "Δ vs original"]
    if fidelity:
        header += ["hidden cosine", "embedding cosine", "masked ppl", "top-1 agree"]
    header += ["forward tok/s"] + (["ratio [per-repeat range]", "forward speed"] if speed else [])
    cells = []
    for r in rows:
        line = [r["model"]]
        if perplexity:
            line += [
                _num(r.get("perplexity"), ".4f"),
                "baseline" if r.get("baseline") else _pct(r.get("delta_vs_original")),
            ]
        if fidelity:
            a = r.get("top1_agreement")
            line += [
                _num(r.get("hidden_cosine"), ".4f"),
                _num(r.get("embedding_cosine"), ".4f"),
                _num(r.get("masked_perplexity"), ".3f"),
                "–" if a is None else f"{a * 100:.1f}%",
            ]
        line.append(_num(r.get("forward_tokens_per_second"), ",.0f"))
        if speed:
            q, rng = r.get("forward_ratio"), r.get("forward_ratio_range")
            if r.get("baseline"):
                line += ["baseline", ""]
            else:
                line += [
                    "–" if q is None else f"×{q:.2f}" + (f" [{rng[0]:.2f}–{rng[1]:.2f}]" if rng else ""),
                    {"higher": "faster", "lower": "slower", TOO_NOISY: TOO_NOISY}.get(
                        r.get("forward_verdict"), NO_DIFFERENCE
                    ),
                ]
        cells.append(line)
    return header, cells
