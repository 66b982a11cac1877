"""A results.json is received text: report.md escapes raw HTML from it as report.html does."""

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OTHER_UID = 4242
SECRET = "export SECRET=do-not-touch\n"
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="another user's file needs chown (root)"
)
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


def _one_line(code, err, *needles):
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, (code, err)
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


def _bench_script(name: str):
    import importlib

    return importlib.import_module(f"normswap.benchmarks.{name}")


def test_report_md_escapes_raw_html_from_results_json_as_report_html_does(tmp_path, run_cli):
    demo = json.loads((ROOT / "tests" / "data" / "demo-results.json").read_text())
    payload = "<img src=x onerror=alert(1)>"
    old = demo["models"][0]["name"]
    text = json.dumps(demo).replace(json.dumps(old), json.dumps(old + payload))
    (tmp_path / "results.json").write_text(text)
    code, _, err = run_cli("eval", "render", tmp_path / "results.json")
    assert code == 0, err
    md, page = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert "<img" not in md and "&lt;img src=x onerror=alert(1)&gt;" in md
    assert "<img src=x" not in page  # what report.html already did
