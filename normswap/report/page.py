"""The report kit's page: one stylesheet and the building blocks of the self-contained report.html
(figures embedded as base64) and of report.md, shared by `normswap eval report` (render.py) and
`normswap study` (study/presentation/study_report.py) so both pages look and read alike."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from normswap.report.claim_words import VERDICT_CLASS

CSS = """
:root{--fg:#1f2328;--muted:#656d76;--line:#d8dee4;--bg:#f6f8fa;--accent:#4c6ef5;--good:#1a7f37;--bad:#cf222e}
*{box-sizing:border-box}
body{margin:0;font:15px/1.5 -apple-system,BlinkMacSystemFont,"Segoe UI",Helvetica,Arial,sans-serif;\
color:var(--fg);background:#fff}
main{max-width:1120px;margin:0 auto;padding:32px 28px 64px}
h1{font-size:28px;margin:0 0 4px}
h2{font-size:20px;margin:36px 0 12px;padding-bottom:6px;border-bottom:1px solid var(--line)}
.sub{color:var(--muted);margin:0 0 20px}
.meta{background:var(--bg);border:1px solid var(--line);border-radius:8px;padding:12px 16px;\
font-size:13px;color:var(--muted)}
.meta div{margin:2px 0}
.noisy{margin:16px 0 0;padding:12px 16px;border:2px solid #bf8700;border-radius:8px;background:#fff8c5;font-size:14px}
.cards{display:flex;flex-wrap:wrap;gap:14px}
.card{flex:1 1 300px;border:1px solid var(--line);border-radius:10px;padding:14px 16px;\
box-shadow:0 1px 2px rgba(0,0,0,.04)}
.card h3{margin:0 0 2px;font-size:16px}
.card .kind{color:var(--muted);font-size:12px;margin-bottom:10px}
.card .items{display:grid;grid-template-columns:repeat(auto-fill,minmax(110px,1fr));gap:10px}
.card .v{font-size:22px;font-weight:600;font-variant-numeric:tabular-nums}
.card .l{font-size:12px;color:var(--muted)}
.card .v.words{font-size:14px;font-weight:500;color:var(--muted);font-style:italic}
.good{color:var(--good)}.bad{color:var(--bad)}
.tablewrap{overflow-x:auto}
table{border-collapse:collapse;width:100%;font-size:13.5px;font-variant-numeric:tabular-nums}
th,td{padding:7px 10px;border-bottom:1px solid var(--line);text-align:right;vertical-align:top}
th{background:var(--bg);font-weight:600;white-space:nowrap}
th:first-child,td:first-child,table.text2 th:nth-child(2),table.text2 td:nth-child(2){text-align:left}
tr:hover td{background:#fafbfc}
td{white-space:nowrap}
td .r{display:block;font-size:11.5px;color:var(--muted)}
td .nd{display:block;font-size:11px;color:var(--muted);font-style:italic}
td .r.same{color:var(--muted)}
.card .n{font-size:11px;color:var(--muted)}
.notes{font-size:13px;color:var(--muted);margin:8px 0 0;padding-left:18px}
.verdict{display:table;margin-top:6px;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;\
background:var(--bg);border:1px solid var(--line)}
.v-yes{color:var(--good);border-color:var(--good)}.v-no{color:var(--bad);border-color:var(--bad)}
.claims td,.claims th{text-align:left;white-space:normal}
.claims td:first-child{font-weight:600;width:28%}
.claims ul{margin:0;padding-left:18px}
.claims .why{color:var(--muted);font-size:12.5px;margin-top:4px}
figure{margin:18px 0;border:1px solid var(--line);border-radius:8px;padding:10px;background:#fff}
figure img{max-width:100%;display:block;margin:0 auto}
figcaption{color:var(--muted);font-size:13px;margin-top:6px;text-align:center}
details{margin:8px 0}
summary{cursor:pointer;color:var(--accent)}
footer{margin-top:40px;color:var(--muted);font-size:12px}
dt{font-weight:600;margin-top:10px}dd{margin:2px 0 0 18px;color:var(--muted);font-size:14px}
"""


def escape(x) -> str:
    return html.escape(str(x))


def image_data_uri(path: Path) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f"data:image/png;base64,{data}"


def html_start(title: str) -> list[str]:
    """The page's head up to its <main>: the title and the stylesheet, nothing fetched."""
    return [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width,initial-scale=1'>",
        f"<title>{escape(title)}</title>",
        f"<style>{CSS}</style></head><body><main>",
    ]


def html_end(footer: str) -> str:
    """``footer`` is HTML (escaped by the caller)."""
    return f"<footer>{footer}</footer></main></body></html>"


def html_alert(label: str, text: str) -> str:
    """A boxed line said before any number (a warning, a too-noisy machine)."""
    return f"<div class='noisy' role='alert'><strong>{escape(label)}.</strong> {escape(text)}</div>"


def md_alert(label: str, text: str) -> list[str]:
    return [f"> **{label}.** {text}", ""]


def html_warnings(warnings) -> list[str]:
    return [html_alert("Warning", w) for w in warnings or []]


def md_warnings(warnings) -> list[str]:
    return [line for w in warnings or [] for line in md_alert("Warning", w)]


def html_notes(items) -> str:
    return "<ul class='notes'>" + "".join(f"<li>{escape(n)}</li>" for n in items) + "</ul>"


def html_meta(lines) -> str:
    """The setup lines, in a grey box."""
    return "<div class='meta'>" + "".join(f"<div>{escape(line)}</div>" for line in lines) + "</div>"


def verdict_badge(verdict: str) -> str:
    return f"<div class='verdict {VERDICT_CLASS.get(verdict, 'v-na')}'>{escape(verdict)}</div>"


CLAIMS_TABLE = "<div class='tablewrap'><table class='claims'>"
CLAIMS_TABLE_END = "</tbody></table></div>"


def claims_table_header(first: str, second: str) -> str:
    return f"<thead><tr><th>{escape(first)}</th><th>{escape(second)}</th></tr></thead><tbody>"


def claims_table_row(claim: str, verdict: str, body: str) -> str:
    """A claim (or question) with its verdict badge, beside ``body`` (HTML, escaped by the caller)."""
    return f"<tr><td>{escape(claim)}{verdict_badge(verdict)}</td><td>{body}</td></tr>"


def html_figure(title: str, path: Path, caption: str) -> str:
    return (
        f"<h2>{escape(title)}</h2><figure><img alt='{escape(title)}' src='{image_data_uri(path)}'>"
        f"<figcaption>{escape(caption)}</figcaption></figure>"
    )


def md_figure(title: str, path: Path, caption: str | None = None) -> list[str]:
    return [f"### {title}", "", f"![{title}]({Path(path).name})", ""] + ([caption, ""] if caption is not None else [])


def html_terms(terms) -> str:
    return "<h2>Terms</h2><dl>" + "".join(f"<dt>{escape(t)}</dt><dd>{escape(d)}</dd>" for t, d in terms) + "</dl>"


def md_terms(terms) -> list[str]:
    return ["## Terms", ""] + [f"- **{t}**: {d}" for t, d in terms] + [""]
