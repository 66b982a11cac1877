"""Write an evaluation's files - results.json, report.md, report.html, the PNG figures - atomically.

Everything is written into a staging directory and published with normswap.publish, so a crash
or Ctrl-C never leaves a half-written report; an existing OUT is replaced only with ``force``
(or when it is empty), and never when it overlaps a model or the data the report reads.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from normswap.errors import NormswapError
from normswap.publish import check_output_path, publish_dir, staging_dir

RESULTS, MARKDOWN, HTML = "results.json", "report.md", "report.html"


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def all_plots(results, out: Path) -> dict[str, Path]:
    """Every figure the results call for, by key (a plot with nothing to show returns None)."""
    from normswap.report.encoders import fidelity_plot
    from normswap.report.plots import activation_plot, finetune_plot, perplexity_plot, throughput_plot

    made = {}
    for key, fn in (
        ("perplexity", perplexity_plot),
        ("fidelity", fidelity_plot),
        ("throughput", throughput_plot),
        ("finetune_loss", finetune_plot),
        ("activations", activation_plot),
    ):
        path = fn(results, Path(out))
        if path is not None:
            made[key] = path
    return made


def render_into(results: dict, folder: Path) -> dict[str, Path]:
    from normswap.report.render import html_report, markdown

    folder = Path(folder)
    figures = all_plots(results, folder)
    results = dict(results)
    log = results.get("lm_eval_log")
    if log and Path(log).is_absolute() and Path(log).is_file():  # lm-eval's own output travels with the report
        shutil.copyfile(log, folder / "lm_eval.log")
        results["lm_eval_log"] = "lm_eval.log"
    results["figures"] = {k: Path(p).name for k, p in figures.items()}
    (folder / RESULTS).write_text(json.dumps(results, indent=2, default=_json_default) + "\n")
    (folder / MARKDOWN).write_text(markdown(results, figures))
    (folder / HTML).write_text(html_report(results, figures))
    return {"results": folder / RESULTS, "markdown": folder / MARKDOWN, "html": folder / HTML, **figures}


def check_out(out, *, force: bool = False, reads=()) -> Path:
    """Refuse an OUT that would be clobbered; called before any work so a refusal is instant.

    ``reads``: what the evaluation read, the models and the data (OUT may not overlap any of them).
    """
    return check_output_path(out, force=force, reads=reads, allow_empty=True, must_have_parent=False)


def write_report(results: dict, out, *, force: bool = False) -> dict[str, Path]:
    """Write the report into ``out``; returns the written paths (as they are after the rename)."""
    out = check_out(
        out,
        force=force,
        reads=[("the model", m.get("path")) for m in results.get("models", [])]
        + [("the data", (results.get("data") or {}).get("spec"))],
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with staging_dir(out) as tmp:
        written = render_into(results, tmp)
        publish_dir(tmp, out, force=True)  # check_out decided: forced, or an empty directory
    return {k: out / Path(p).name for k, p in written.items()}


def rerender(results_path, out=None, *, force: bool = False) -> dict[str, Path]:
    """Rebuild the report files from an existing results.json (e.g. after editing names)."""
    results_path = Path(results_path)
    try:
        results = json.loads(results_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise NormswapError(f"cannot read {results_path}: {e}") from None
    target = Path(out) if out else results_path.parent
    if target.resolve() == results_path.parent.resolve():
        return render_in_place(results, target)
    return write_report(results, target, force=force)


def render_in_place(results: dict, folder: Path) -> dict[str, Path]:
    """Rebuild the report beside its results.json, replacing only the report's own files (each by an
    atomic rename), never the folder: whatever else the user keeps there (a terminal log, an older
    run) stays. The files are built in a staging directory first, so a failure changes nothing."""
    folder = Path(folder)
    with staging_dir(folder) as tmp:
        written = render_into(results, tmp)
        for path in written.values():
            os.replace(path, folder / Path(path).name)  # replaces a planted link itself, never its target
    return {k: folder / Path(p).name for k, p in written.items()}
