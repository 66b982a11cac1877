"""Write an evaluation's files - results.json, report.md, report.html, the PNG figures - atomically.

Everything is written into a staging directory and published with normswap.publish, so a crash
or Ctrl-C never leaves a half-written report; an existing OUT is replaced only with ``force``
(or when it is empty), and never when it overlaps a model or the data the report reads.

``eval render results.json`` works on a file it received, so it trusts nothing in it: the
results never name a file to copy (lm-eval's log travels only as ``lm_eval.log`` beside
results.json, a regular file opened without following a link; anything else it names is named
in one line and skipped), and without ``--out`` it writes only its own files beside
results.json, each by an atomic rename, leaving results.json and everything else there as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

from normswap import bounded_load
from normswap.errors import NormswapError, first_line
from normswap.publish import check_output_path, output_lock, publish_dir, publish_files, staging_dir
from normswap.report.schema import check_results

RESULTS, MARKDOWN, HTML = "results.json", "report.md", "report.html"


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def all_plots(results, out: Path) -> dict[str, Path]:
    """Every figure the results call for, by key (a plot with nothing to show returns None)."""
    from normswap.report.encoders import fidelity_plot
    from normswap.report.plots import (
        activation_plot,
        finetune_plot,
        perplexity_plot,
        slice_curve_plot,
        throughput_plot,
    )

    made = {}
    for key, fn in (
        ("perplexity", perplexity_plot),
        ("fidelity", fidelity_plot),
        ("throughput", throughput_plot),
        ("finetune_loss", finetune_plot),
        ("activations", activation_plot),
        ("slice_curve", slice_curve_plot),
    ):
        path = fn(results, Path(out))
        if path is not None:
            made[key] = path
    return made


LOG = "lm_eval.log"
MAX_RESULTS_BYTES = 64 << 20  # an evaluation's results.json is kilobytes; per-task logs travel beside it


def render_into(results: dict, folder: Path, *, log=None, with_results: bool = True) -> dict[str, Path]:
    """Write the report files into the fresh directory ``folder``.

    ``log``: lm-eval's output as an open binary file, carried as lm_eval.log (the caller chose that
    file; the results never do). ``with_results``: also write results.json (not when rendering
    beside the results.json being read)."""
    from normswap.report.render import html_report, markdown

    folder = Path(folder)
    results = dict(results)
    if log is not None:  # lm-eval's own output travels with the report
        with open(folder / LOG, "xb") as g:
            shutil.copyfileobj(log, g)
        results["lm_eval_log"] = LOG
    if with_results:  # the measurements first: a figure that fails must not take them with it (_write)
        _write_results(folder, results)
    figures = all_plots(results, folder)
    results["figures"] = {k: Path(p).name for k, p in figures.items()}
    written = {"markdown": folder / MARKDOWN, "html": folder / HTML, **figures}
    if with_results:
        _write_results(folder, results)  # again, naming the figures it now has
        written["results"] = folder / RESULTS
    if log is not None:
        written["lm_eval_log"] = folder / LOG
    (folder / MARKDOWN).write_text(markdown(results, figures))
    (folder / HTML).write_text(html_report(results, figures))
    return written


def _write_results(folder: Path, results: dict) -> None:
    text = json.dumps(results, indent=2, default=_json_default) + "\n"
    tmp = folder / f".{RESULTS}.tmp"
    tmp.write_text(text)
    os.replace(tmp, folder / RESULTS)


def _open_regular(path):
    """``path`` opened for reading when it is a regular file (a final symlink is not followed, a FIFO
    does not block), else None."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def check_out(out, *, force: bool = False, reads=()) -> Path:
    """Refuse an OUT that would be clobbered; called before any work so a refusal is instant.

    ``reads``: what the evaluation read, the models and the data (OUT may not overlap any of them).
    """
    return check_output_path(out, force=force, reads=reads, allow_empty=True, must_have_parent=False)


def _reads(results: dict) -> list:
    return [("the model", m.get("path")) for m in results.get("models", []) if isinstance(m, dict)] + [
        ("the data", (results.get("data") or {}).get("spec") if isinstance(results.get("data"), dict) else None)
    ]


def write_report(results: dict, out, *, force: bool = False) -> dict[str, Path]:
    """Write the report of an evaluation this process ran into ``out``; returns the written paths (as
    they are after the rename). Its lm-eval log (the file this run wrote) is carried as lm_eval.log."""
    named = results.get("lm_eval_log")
    log = _open_regular(named) if isinstance(named, str) and Path(named).is_absolute() else None
    try:
        return _write(results, out, force=force, log=log)
    finally:
        if log is not None:
            log.close()


def _write(results: dict, out, *, force: bool, log, reads=()) -> dict[str, Path]:
    out = check_out(out, force=force, reads=_reads(results) + list(reads))
    out.parent.mkdir(parents=True, exist_ok=True)
    with staging_dir(out) as tmp:
        try:
            written = render_into(results, tmp, log=log)
        except Exception as e:
            if not (tmp / RESULTS).is_file():
                raise
            _keep_measurements(tmp)  # hours of measurements outlive a report page that failed
            publish_dir(tmp, out, force=True)
            raise NormswapError(
                f"the measurements are saved in {out / RESULTS}, but the report around them failed "
                f"({type(e).__name__}: {first_line(e)}); `normswap eval render {out / RESULTS}` builds it again"
            ) from e
        publish_dir(tmp, out, force=True)  # check_out decided: forced, or an empty directory
    return {k: out / Path(p).name for k, p in written.items()}


def _keep_measurements(folder: Path) -> None:
    """Leave only results.json and lm-eval's log in ``folder``: no half-made figure or page."""
    for entry in folder.iterdir():
        if entry.name not in (RESULTS, LOG):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _log_beside(results: dict, directory: Path, say):
    """lm-eval's log of a received results.json: only ``lm_eval.log`` (what a report names) when it is
    a regular file in results.json's own directory; any other file it names is named and skipped."""
    named = results.pop("lm_eval_log", None)
    if not named:
        return None
    log = _open_regular(directory / LOG) if named == LOG else None
    if log is None:
        say(
            f"not carrying lm_eval_log {str(named)[:200]!r}: a report carries only {LOG}, a regular file "
            "beside results.json, never a file results.json names elsewhere"
        )
    return log


def rerender(results_path, out=None, *, force: bool = False, say=None) -> dict[str, Path]:
    """Rebuild the report files from an existing results.json (e.g. after editing names).

    With ``out``: a new report directory, published whole like ``eval report --out`` (it may not
    hold results.json). Without, or with results.json's own directory: report.md, report.html and
    the figures are written beside results.json, each by an atomic rename (a planted link at one
    of those names is replaced, never followed); nothing else there (a terminal log, an older run)
    is changed or removed, results.json included."""
    say = say or (lambda m: print(f"normswap: {m}", file=sys.stderr))
    results_path = Path(results_path)
    # a received file: a regular file (a FIFO or /dev/zero is named, not read), of bounded size
    results = bounded_load.load_json(results_path, what="a results.json", max_bytes=MAX_RESULTS_BYTES, follow=True)
    check_results(results, results_path)  # a received file: a wrong type is one line, not a traceback
    directory = results_path.parent
    log = _log_beside(results, directory, say)
    try:
        if out and Path(out).resolve() != directory.resolve():
            return _write(results, out, force=force, log=log, reads=[("the results", results_path)])
        return _write_beside(results, directory, log=log)
    finally:
        if log is not None:
            log.close()


def _write_beside(results: dict, directory: Path, *, log) -> dict[str, Path]:
    # a name of its own inside DIR for the lock and the staging directory (both beside it, so a
    # killed render's leftovers are cleaned by the next render), never DIR itself: DIR is not replaced
    own = directory / ".normswap-render"
    with output_lock(own, replaced_whole=False), staging_dir(own) as tmp:
        written = render_into(results, tmp, log=log, with_results=False)
        publish_files(tmp, directory)
    return {k: directory / Path(p).name for k, p in written.items()}
