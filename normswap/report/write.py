"""Write an evaluation's files - results.json, report.md, report.html, the PNG figures - atomically.

Everything is written into a temporary directory next to OUT, then renamed into place, so a
crash or Ctrl-C never leaves a half-written report; an existing OUT is replaced only with
``force`` (or when it is empty).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from normswap.errors import NormswapError

FILES = ("results.json", "report.md", "report.html")


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def render_into(results: dict, folder: Path) -> dict[str, Path]:
    from normswap.report.plots import all_plots
    from normswap.report.render import html_report, markdown

    folder = Path(folder)
    figures = all_plots(results, folder)
    results = dict(results)
    results["figures"] = {k: Path(p).name for k, p in figures.items()}
    (folder / "results.json").write_text(json.dumps(results, indent=2, default=_json_default) + "\n")
    (folder / "report.md").write_text(markdown(results, figures))
    (folder / "report.html").write_text(html_report(results, figures))
    return {"results": folder / "results.json", "markdown": folder / "report.md", "html": folder / "report.html", **figures}


def check_out(out, *, force: bool = False) -> Path:
    """Refuse an OUT that would be clobbered; called before any work so a refusal is instant."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise NormswapError(f"--out {out} is a file; give a directory for the report")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise NormswapError(f"--out {out} exists and is not empty; pass --force to replace it")
    return out


def write_report(results: dict, out, *, force: bool = False) -> dict[str, Path]:
    """Write the report into ``out``; returns the written paths (as they are after the rename)."""
    out = check_out(out, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        written = render_into(results, tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {k: out / Path(p).name for k, p in written.items()}


def rerender(results_path, out=None, *, force: bool = False) -> dict[str, Path]:
    """Rebuild the report files from an existing results.json (e.g. after editing names)."""
    results_path = Path(results_path)
    try:
        results = json.loads(results_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise NormswapError(f"cannot read {results_path}: {e}") from None
    target = Path(out) if out else results_path.parent
    return write_report(results, target, force=force or target == results_path.parent)
