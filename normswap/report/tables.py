"""Tables of results as text: laid out for a terminal or as markdown, and the run summary's table.

Every table normswap prints or writes (``normswap eval``, ``normswap run``, report.md, summary.md)
is a header and rows of strings laid out here; what goes in the cells stays with the caller.
"""

from __future__ import annotations

import html
import textwrap

from normswap.evaluate.speed_intervals import INTERVAL_WORDS
from normswap.stats.verdicts import NO_DIFFERENCE, TOO_NOISY

# A terminal's width: tables printed on one wrap their widest cells to fit it (an 80-column
# terminal still wraps whole lines, but never a 312-character row into unreadable shards).
TERMINAL_WIDTH = 100
GAP = "  "
# A column is never squeezed below this (a cell longer than it breaks inside a word).
MIN_COLUMN = 8


def _fit_widths(natural: list[int], shortest: list[int], width: int) -> list[int]:
    """Column widths that sum (with the gaps) to at most ``width``: the widest column gives up a
    character at a time, first down to its longest word, then to ``MIN_COLUMN``."""
    widths = list(natural)
    room = width - len(GAP) * (len(widths) - 1)
    for floor in (shortest, [min(MIN_COLUMN, n) for n in natural]):
        while sum(widths) > room:
            i = max(range(len(widths)), key=lambda k: (widths[k] - floor[k], widths[k]))
            if widths[i] <= floor[i]:
                break
            widths[i] -= 1
    return widths


def _wrap(cell: str, width: int) -> list[str]:
    if len(cell) <= width:
        return [cell]
    return textwrap.wrap(cell, width, break_on_hyphens=False) or [""]


NUMERIC_START = set("0123456789+-−×[.")


def _numeric(column: list[str]) -> bool:
    """Most of a column's cells are numbers (then it is right-aligned, so the digits line up)."""
    cells = [c for c in column if c.strip()]
    return bool(cells) and sum(c.lstrip()[0] in NUMERIC_START for c in cells) * 2 > len(cells)


def text_table(header, rows, *, width: int | None = None) -> str:
    """Columns padded to their widest cell, the first and any of words left-aligned, those of numbers
    right-aligned, and a rule under the header. A table wider than ``width`` wraps its widest cells at spaces (rows then
    get a blank line between them, so a wrapped row reads as one); ``width=None``: never wrap (a
    table whose rows other programs grep, e.g. `normswap run`'s summary)."""
    table = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    natural = [max(len(r[i]) for r in table) for i in range(len(header))]
    widths = natural
    if width is not None and sum(natural) + len(GAP) * (len(natural) - 1) > width:
        shortest = [max((len(w) for r in table for w in r[i].split()), default=1) for i in range(len(header))]
        widths = _fit_widths(natural, shortest, width)
    wrapped = widths != natural
    right = [i > 0 and _numeric([r[i] for r in table[1:]]) for i in range(len(header))]
    lines = []
    for j, r in enumerate(table):
        cells = [_wrap(c, w) for c, w in zip(r, widths)]
        if wrapped and j > 1:
            lines.append("")
        for k in range(max(len(c) for c in cells)):
            parts = [c[k] if k < len(c) else "" for c in cells]
            line = GAP.join(p.rjust(w) if right[i] else p.ljust(w) for i, (p, w) in enumerate(zip(parts, widths)))
            lines.append(line.rstrip())
        if j == 0:
            lines.append(GAP.join("-" * w for w in widths))
    return "\n".join(lines)


def html_table(header, rows, cls: str = "text2") -> str:
    """A plain table of strings (escaped), scrolling sideways on a narrow screen."""
    esc = html.escape
    return (
        f"<div class='tablewrap'><table class='{cls}'><thead><tr>"
        + "".join(f"<th>{esc(str(h))}</th>" for h in header)
        + "</tr></thead><tbody>"
        + "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in r) + "</tr>" for r in rows)
        + "</tbody></table></div>"
    )


def grouped(rows: list[dict], key: str, by: tuple[str, ...]) -> list[dict]:
    """Rows that share every field in ``by`` merged into one whose ``key`` lists them all, in first-seen
    order (a verdict several arms share is said once, naming the arms, not repeated word for word)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        k = tuple(r.get(f) for f in by)
        if k in out:
            out[k][key] = out[k][key] + [r[key]]
        else:
            out[k] = {**r, key: [r[key]]}
    return list(out.values())


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
                "forward_ratio_pairs": fwd_iv.get("pairs") if fwd_iv else None,  # None: a per-repeat range
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
    bracket = INTERVAL_WORDS if any(r.get("forward_ratio_pairs") for r in rows) else "per-repeat range"
    header += ["forward tok/s"] + ([f"ratio [{bracket}]", "forward speed"] if speed else [])
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
