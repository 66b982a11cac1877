"""Run every check on every row; tabulate.

Each row runs in a child process forked from this one (so one architecture that hangs or crashes
costs its row, not the table), with a time cap per row; cells not reached before the cap say so.
"""

from __future__ import annotations

import json
import multiprocessing
import re
import tempfile
import time
import traceback
from pathlib import Path

from normswap.compat import cache as row_cache

SYMBOL = {"ok": "✓", "fail": "✗", "n/a": "n/a", "skipped": "✗"}


def columns(only=None) -> list[str]:
    from normswap.compat.checks import CHECKS

    return [c for c in CHECKS if not only or c in only]


def run_row(row, *, deadline: float | None = None, report=None, only_columns=None) -> dict:
    """Build, convert and check one row in this process; returns its record."""
    from normswap.compat import rows as rowmod
    from normswap.compat.checks import CHECKS, Cell, describe, quiet

    record = {**row.as_dict(), "cells": {}, "convert": None}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="normswap-matrix-") as tmp:
        # transformers copies remote code into a module cache folder named after the directory, and may
        # reuse one a run before left there: a name of its own per row and per run
        slug = re.sub(r"\W", "_", f"{row.name}_{Path(tmp).name.rsplit('-', 1)[-1]}")
        original, converted = Path(tmp) / f"original_{slug}", Path(tmp) / f"converted_{slug}"
        try:
            with quiet():
                rowmod.build_original(row, original)
                summary = rowmod.convert(original, converted, verify=row.exact, pooled=row.pooled)
            record["convert"] = {
                "mode": summary["mode"],
                "verification": summary.get("verification", {}).get("max_abs_diff"),
            }
        except Exception as e:
            why = f"convert failed: {describe(e)}"
            record["convert"] = {"error": why}
            record["cells"] = {name: Cell("fail", why).as_dict() for name in columns(only_columns)}
            return record
        for name in columns(only_columns):
            check = CHECKS[name]
            if deadline is not None and time.time() > deadline:
                record["cells"][name] = Cell("skipped", "row time cap reached before this check").as_dict()
                continue
            c0 = time.perf_counter()
            try:
                cell = check(original, converted, row)
            except Exception as e:  # a bug in a check is a failure of the cell, reported, not a crash
                cell = Cell("fail", f"check error: {describe(e)}")
            record["cells"][name] = {**cell.as_dict(), "seconds": round(time.perf_counter() - c0, 2)}
            if report:
                report(f"  {row.name}: {name}: {SYMBOL[cell.status]} {cell.detail[:100]}")
    record["seconds"] = round(time.perf_counter() - t0, 1)
    return record


def _child(row, deadline, only_columns, conn):
    from normswap.processes import child_started

    child_started()  # ends with the matrix, whatever ends it (and no longer runs the command's handlers)
    try:
        conn.send(run_row(row, deadline=deadline, only_columns=only_columns))
    except BaseException as e:  # noqa: BLE001 — whatever happens goes back as the row's record
        conn.send({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})
    finally:
        conn.close()


def run_matrix(
    rows, *, row_seconds: float = 300, progress=None, on_record=None, only_columns=None, cache=None
) -> list[dict]:
    """Every row in a forked child with ``row_seconds`` each; rows in the order given.
    ``on_record(records so far)`` after each row (the command saves partial results with it).
    ``cache`` (compat/cache.py RowCache): a row whose inputs have not changed is read back from it
    instead of run; every row that ran to its end is stored in it."""
    say = progress or (lambda msg: None)
    ctx = multiprocessing.get_context("fork")
    records = []
    for i, row in enumerate(rows, 1):
        t0 = time.time()
        key = _cache_key(cache, row, only_columns)
        cached = cache.get(row, key, columns(only_columns)) if key else None
        if cached is not None:
            records.append({**cached, "cached": True})
            if on_record:
                on_record(records)
            say(f"[{i}/{len(rows)}] {row.name}: from the cache ({cache.directory})")
            continue
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(row, t0 + row_seconds, only_columns, child), daemon=True)
        proc.start()
        child.close()
        record = None
        if parent.poll(row_seconds + 60):  # the last check may overrun the cap; a hung one may not
            try:
                record = parent.recv()
            except EOFError:
                record = None
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if record is not None and key and row_cache.cacheable(record):
            cache.put(row, key, record)
        if record is None or "error" in record:
            why = (
                record["error"]
                if record
                else f"row did not finish in {row_seconds:.0f} s (or its process died, exit {proc.exitcode})"
            )
            record = {
                **row.as_dict(),
                "convert": {"error": why},
                "cells": {c: {"status": "fail", "detail": why} for c in columns(only_columns)},
            }
        records.append(record)
        if on_record:
            on_record(records)
        cells = record["cells"]
        say(
            f"[{i}/{len(rows)}] {row.name}: "
            + " ".join(SYMBOL[c["status"]] for c in cells.values())
            + f"  ({time.time() - t0:.0f} s)"
        )
    return records


def _cache_key(cache, row, only_columns) -> str | None:
    """The row's cache key, or None without a cache (or when its config cannot be built here: it runs)."""
    if cache is None:
        return None
    try:
        return row_cache.row_key(row, columns(only_columns))
    except Exception as e:  # the row itself will say what is wrong with it
        cache.say(f"matrix cache: {row.name}: no key ({type(e).__name__}); running the row")
        return None


def summary(records) -> dict:
    """Counts over exact rows (where matching is the goal) and the exceptions."""
    out = {
        "rows": len(records),
        "exact_rows": 0,
        "cells_original_works": 0,
        "cells_converted_matches": 0,
        "cells_not_applicable": 0,
        "exceptions": [],
        "approximate_rows": [],
    }
    for r in records:
        if not r["exact"]:
            out["approximate_rows"].append(r["name"])
            continue
        out["exact_rows"] += 1
        for name, cell in r["cells"].items():
            if cell["status"] == "n/a":
                out["cells_not_applicable"] += 1
                continue
            out["cells_original_works"] += 1
            if cell["status"] == "ok":
                out["cells_converted_matches"] += 1
            else:
                out["exceptions"].append({"row": r["name"], "column": name, "why": cell["detail"]})
    return out


def markdown(records, meta: dict) -> str:
    cols = [c for c in columns() if any(c in r["cells"] for r in records)]
    s = summary(records)
    lines = [
        "# Compatibility matrix: does a converted checkpoint work wherever its original works?",
        "",
        f"Generated by `{meta['command']}` (normswap {meta['normswap_version']}, "
        f"transformers {meta['transformers_version']}, "
        f"torch {meta['torch_version']}, sentence-transformers {meta.get('sentence_transformers_version')}, "
        f"peft {meta.get('peft_version')}, onnxruntime {meta.get('onnxruntime_version')}) on {meta['date']}; "
        f"{meta['seconds']:.0f} s, {_cache_note(records)}. Do not edit: re-run the command (rows whose inputs "
        "did not change are read back from the row cache, normswap/compat/cache.py).",
        "",
        "Each row is a tiny randomised original (curated family: its first test config; discovered: the "
        "shrunk default config), saved with a BPE tokenizer trained on the embedded corpus (text models), its "
        "processor (image/audio models) and sentence-transformers files, then converted with `normswap convert`. "
        "Each column runs one entry point on the original and on the converted checkpoint "
        "(`trust_remote_code=True`): ✓ it works and the outputs match (max |Δ| / max |original| ≤ 1e-5, fp32), "
        "✗ with the reason, n/a where the original cannot do it either (its reason in the JSON). "
        "New task heads are initialised on both sides and the converted side gets the original's values; "
        "the newly initialised weights must be the same on both sides. Rows marked *pooled outputs* are converted "
        "with `--exact-outputs pooled`: the raw residual stream they return moves by its per-token mean by design, "
        "so those outputs (`moved_outputs` in the JSON) are left out of every comparison.",
        "",
        f"**{s['cells_converted_matches']} of {s['cells_original_works']} cells where the original works also work on "
        f"the converted model with matching outputs**, over {s['exact_rows']} exactly converted rows "
        f"({s['cells_not_applicable']} cells n/a). "
        + (
            f"Approximate (post-LN) rows, where outputs are not expected to match: {', '.join(s['approximate_rows'])}; "
            "their cells are marked ≈ when the entry point works."
            if s["approximate_rows"]
            else ""
        ),
        "",
        "| architecture | class | " + " | ".join(cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for r in records:
        cells = []
        for c in cols:
            cell = r["cells"].get(c, {"status": "fail", "detail": "not run"})
            if cell["status"] == "ok":
                cells.append("✓" if r["exact"] else "≈")
            elif cell["status"] == "n/a":
                cells.append("n/a")
            else:
                cells.append(f"✗ {_short(cell.get('detail', ''))}")
        kind = "" if r["curated"] else " (discovered, pooled outputs)" if r.get("moved_outputs") else " (discovered)"
        lines.append(f"| {r['name']}{kind} | `{r['class']}` | " + " | ".join(cells) + " |")
    lines += ["", "## Exceptions", ""]
    if s["exceptions"]:
        lines += [f"- {e['row']} / {e['column']}: {e['why']}" for e in s["exceptions"]]
    else:
        lines.append(
            "None: every cell where the original works also works on the converted model with matching outputs."
        )
    lines += ["", "## Columns", ""]
    from normswap.compat.checks import CHECKS

    for name, check in CHECKS.items():
        if name in cols:
            lines.append(f"- **{name}**: " + " ".join((check.__doc__ or "").split()))
    return "\n".join(lines) + "\n"


def _cache_note(records) -> str:
    ran = sum(r.get("seconds") or 0 for r in records)
    cached = sum(1 for r in records if r.get("cached"))
    return f"{ran:.0f} s of row time over {len(records)} rows ({cached} read back from the row cache)"


def _short(text: str, n: int = 60) -> str:
    text = str(text).replace("|", "/").replace("\n", " ")
    return text if len(text) <= n else text[: n - 1] + "…"


def preload() -> None:
    """Import what every row needs once, before forking, so that each child starts warm (no torch
    op runs here: forked children must not inherit a started thread pool)."""
    import importlib

    for name in (
        "transformers",
        "peft",
        "sentence_transformers",
        "torch._dynamo",
        "torch._inductor.compile_fx",
        "PIL.Image",
        "normswap.convert.pipeline",
        "normswap.architectures.tiny",
    ):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    from transformers import Trainer, TrainingArguments, pipeline  # noqa: F401  (lazy modules: load them now)


def meta(command: str, seconds: float, row_seconds: float) -> dict:
    import importlib.metadata as md

    import torch
    import transformers

    from normswap.version import __version__

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {
        "command": command,
        "normswap_version": __version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "sentence_transformers_version": version("sentence-transformers"),
        "peft_version": version("peft"),
        "onnxruntime_version": version("onnxruntime"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": seconds,
        "row_seconds": row_seconds,
    }


def merge_meta(metas: list[dict]) -> dict:
    """One header for runs of a few rows each (docs/compat-matrix.sh runs one row a process; a table
    whose few rows were re-run later): the first's, one command naming every row once when the runs
    differ only in their rows (else the commands joined), their times summed, the span of their dates."""
    if len(metas) == 1:
        return metas[0]
    only = re.compile(r" --only \S+")
    rest = {only.sub("", m["command"]) for m in metas}
    if len(rest) == 1:
        head, _, tail = rest.pop().partition(" --")
        rows = "".join(dict.fromkeys(part for m in metas for part in only.findall(m["command"])))
        command = f"{head}{rows}" + (f" --{tail}" if tail else "")
    else:
        command = " & ".join(m["command"] for m in metas)
    dates = sorted({m["date"] for m in metas})
    date = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return {**metas[0], "command": command, "seconds": sum(m["seconds"] for m in metas), "date": date}


def as_json(records, meta: dict) -> str:
    """The --save-json file: the header, the counts, every row's cells."""
    return json.dumps({"meta": meta, "summary": summary(records), "rows": records}, indent=1, default=str) + "\n"
