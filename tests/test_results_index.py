"""Committed run outputs live in one place, results/<topic>-<YYYYMMDDTHHMMZ>/, listed by an index that
scripts/results_index.py regenerates: every link from README.md, bench/README.md and docs/*.md into
results/ lands on an indexed run folder that exists, and the committed index is what regenerating
writes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "results_index.py"


def _index():
    spec = importlib.util.spec_from_file_location("results_index", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_are_indexed_and_every_link_lands_on_a_run():
    index = _index()
    assert index.problems(ROOT) == []
    runs = {r["run"]: r for r in json.loads((ROOT / "results" / "index.json").read_text())["runs"]}
    linked = index.results_links(ROOT)
    assert len(linked) >= 50  # the pages' links into results/ were found
    assert {run for _, run in linked} <= set(runs)
    # the index says where each run is quoted: the README's demo and a docs page's study
    assert "README.md" in runs["demo-20261207T0457Z"]["quoted_in"]
    assert "docs/study.md" in runs["study-20261201T1642Z"]["quoted_in"]
    assert not (ROOT / "bench" / "results").exists() and not (ROOT / "docs" / "demo").exists()


def test_check_flags_a_dangling_link_a_stale_index_and_a_bad_name(tmp_path):
    # negative control: a tree whose index was current, then a planted dangling link, a run folder
    # named without its stamp, and a new run the index does not list yet are each reported
    index = _index()
    run = tmp_path / "results" / "decode-20261201T1200Z"
    run.mkdir(parents=True)
    (run / "command.txt").write_text("normswap bench decode --json result.json (commit abc1234)\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "speed.md").write_text("[run](../results/decode-20261201T1200Z/)\n")
    (tmp_path / "README.md").write_text("# x\n")
    rows = index.build(tmp_path)
    assert rows[0]["command"].startswith("normswap bench decode") and rows[0]["commit"] == "abc1234"
    assert rows[0]["quoted_in"] == ["docs/speed.md"] and rows[0]["date"] == "2026-12-01T12:00Z"
    (tmp_path / "results" / "INDEX.md").write_text(index.render_markdown(rows))
    (tmp_path / "results" / "index.json").write_text(index.render_json(rows))
    assert index.problems(tmp_path) == []

    (tmp_path / "README.md").write_text("# x\n[gone](results/decode-20261130T0000Z/result.json)\n")
    (tmp_path / "results" / "loose").mkdir()
    found = index.problems(tmp_path)
    assert "README.md: links results/decode-20261130T0000Z, which is not a run folder under results/" in found
    assert "results/loose: not named <topic>-<YYYYMMDDTHHMMZ>" in found
    assert "results/INDEX.md is stale: run python3 scripts/results_index.py" in found


def test_the_script_checks_from_the_command_line():
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
