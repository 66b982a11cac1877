"""results/INDEX.md and results/index.json: one row per committed run folder under results/.

    python3 scripts/results_index.py            # rewrite both files
    python3 scripts/results_index.py --check    # exit 1 (and say why) when they are stale or a link dangles

Each row: the run id (the folder's name, ``<topic>-<YYYYMMDDTHHMMZ>``), the command that made it, the
commit it ran at, its date, its files, and the pages that quote it (README.md, bench/README.md,
docs/*.md). Everything is read from the folder's own files, so regenerating gives the same bytes on
any checkout; a field its files do not state says "not recorded" rather than a guess.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = re.compile(r"(?P<topic>[a-z0-9][a-z0-9.-]*?)-(?P<stamp>\d{8}T\d{4}Z)")
# where a run folder states the command that made it, most explicit first
COMMAND_FILES = ("command.txt", "commands.txt", "run.txt", "README.md")
# a command line, not a line of output: `normswap <subcommand>` (output lines read "normswap demo: ..."),
# python, bash, or either behind VAR=value settings and a flock
COMMAND_LINE = re.compile(
    r"^(?:[$>]\s*)?(?:[A-Z_]+=\S+\s+)*(?:flock (?:-x )?\S+\s+)?"
    r"(?:normswap [a-z][a-z-]*(?:\s|$)|python3? \S|bash \S|\S+\.sh\b)"
)
COMMIT = re.compile(r"\bcommit:?\s+(?:of\s+)?([0-9a-f]{7,40})\b|\bat ([0-9a-f]{7,40})\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
RESULTS_MENTION = re.compile(r"(?<![\w./-])results/([\w.-]+)")


def pages(root: Path) -> list[Path]:
    """The pages whose links and mentions are indexed (the ones tests/test_docs_links.py checks)."""
    found = [root / "README.md", root / "bench" / "README.md", *sorted((root / "docs").glob("*.md"))]
    return [p for p in found if p.exists()]


def run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in (root / "results").iterdir() if p.is_dir())


def _texts(run: Path) -> list[tuple[str, str]]:
    """(name, text) of the folder's text files, its own before its sub-folders' (a folder of several
    runs records each run's command in the run's sub-folder), the command files first in each."""
    order = {name: i for i, name in enumerate(COMMAND_FILES)}
    files = [p for p in (*run.glob("*"), *run.glob("*/*")) if p.is_file() and p.suffix in (".txt", ".md")]
    files.sort(key=lambda p: (len(p.relative_to(run).parts), order.get(p.name, len(order)), str(p)))
    return [(str(p.relative_to(run)), p.read_text(encoding="utf-8", errors="replace")) for p in files]


def command_of(run: Path) -> str:
    for _, text in _texts(run):
        for line in text.splitlines():
            line = line.strip().removeprefix("# ")
            if line.lower().startswith("command:"):
                line = line.split(":", 1)[1].strip()
            # a command quoted in prose stands in backticks
            for candidate in [line, *re.findall(r"`([^`]+)`", line)]:
                if COMMAND_LINE.match(candidate):
                    return re.sub(r"\s+", " ", candidate)[:240]
    return "not recorded"


def commit_of(run: Path) -> str:
    for _, text in _texts(run):
        m = COMMIT.search(text)
        if m:
            return m.group(1) or m.group(2)
    return "not recorded"


def files_of(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())


def quoted_in(root: Path) -> dict[str, list[str]]:
    """Run id -> the pages that link to or name it."""
    out: dict[str, set[str]] = {}
    for page in pages(root):
        rel = str(page.relative_to(root))
        text = page.read_text(encoding="utf-8")
        for target in LINK.findall(text):
            run = _run_of_link(root, page, target)
            if run:
                out.setdefault(run, set()).add(rel)
        for name in RESULTS_MENTION.findall(text):
            out.setdefault(name, set()).add(rel)
    return {k: sorted(v) for k, v in out.items()}


def _run_of_link(root: Path, page: Path, target: str) -> str | None:
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
        return None
    path = os.path.normpath(os.path.join(page.parent, target.partition("#")[0]))
    rel = os.path.relpath(path, root)
    parts = Path(rel).parts
    if len(parts) < 2 or parts[0] != "results" or parts[1:] in (("INDEX.md",), ("index.json",)):
        return None  # not into results/, or the index itself
    return parts[1]


def results_links(root: Path) -> list[tuple[str, str]]:
    """(page, run id) for every link into results/ from the indexed pages."""
    out = []
    for page in pages(root):
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            run = _run_of_link(root, page, target)
            if run:
                out.append((str(page.relative_to(root)), run))
    return out


def build(root: Path = ROOT) -> list[dict]:
    quoted = quoted_in(root)
    rows = []
    for run in run_dirs(root):
        m = RUN_ID.fullmatch(run.name)
        stamp = m.group("stamp") if m else None
        date = f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]}T{stamp[9:11]}:{stamp[11:13]}Z" if stamp else "not recorded"
        rows.append(
            {
                "run": run.name,
                "topic": m.group("topic") if m else run.name,
                "date": date,
                "command": command_of(run),
                "commit": commit_of(run),
                "files": files_of(run),
                "quoted_in": quoted.get(run.name, []),
            }
        )
    return rows


def render_markdown(rows: list[dict]) -> str:
    out = [
        "# Committed runs",
        "",
        "Generated by `python3 scripts/results_index.py` from the folders below (do not edit by hand;",
        "`tests/test_results_index.py` checks it is current). One folder per run, named",
        "`<topic>-<YYYYMMDDTHHMMZ>` (UTC); each holds the command, the outputs and, where memory is quoted,",
        "`/usr/bin/time -v`. Command lines recorded inside a folder keep the paths the run was made with",
        "(runs before 2026-12-07 wrote under `bench/results/` and `docs/`). Machine-readable: `index.json`.",
        "",
        "| run | date | command | commit | files | quoted in |",
        "| --- | --- | --- | --- | ---: | --- |",
    ]
    for r in rows:
        command = r["command"].replace("|", "\\|")
        quoted = ", ".join(f"[{q}](../{q})" for q in r["quoted_in"]) or "—"
        out.append(
            f"| [{r['run']}]({r['run']}/) | {r['date']} | `{command}` | {r['commit']} | {len(r['files'])} | {quoted} |"
        )
    return "\n".join(out) + "\n"


def render_json(rows: list[dict]) -> str:
    return json.dumps({"runs": rows}, indent=1, ensure_ascii=False) + "\n"


def problems(root: Path = ROOT) -> list[str]:
    """What is wrong with results/ as committed: a badly named folder, a link to a run that is not
    there, an index that regenerating would change."""
    found = []
    runs = {p.name for p in run_dirs(root)}
    for name in sorted(runs):
        if not RUN_ID.fullmatch(name):
            found.append(f"results/{name}: not named <topic>-<YYYYMMDDTHHMMZ>")
    for page, run in results_links(root):
        if run not in runs:
            found.append(f"{page}: links results/{run}, which is not a run folder under results/")
    for page in pages(root):
        for name in RESULTS_MENTION.findall(page.read_text(encoding="utf-8")):
            # a dated name is a run's (a pattern such as decode-* is not)
            if re.search(r"\d{8}", name) and name.rstrip(".") not in runs:
                found.append(f"{page.relative_to(root)}: names results/{name}, which does not exist")
    rows = build(root)
    for name, text in (("INDEX.md", render_markdown(rows)), ("index.json", render_json(rows))):
        path = root / "results" / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            found.append(f"results/{name} is stale: run python3 scripts/results_index.py")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when the index is stale or a link dangles"
    )
    args = ap.parse_args(argv)
    if args.check:
        found = problems(ROOT)
        for line in found:
            print(line, file=sys.stderr)
        return 1 if found else 0
    rows = build(ROOT)
    (ROOT / "results" / "INDEX.md").write_text(render_markdown(rows), encoding="utf-8")
    (ROOT / "results" / "index.json").write_text(render_json(rows), encoding="utf-8")
    print(f"results/INDEX.md, results/index.json: {len(rows)} runs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
