"""A results.json is received text: report.md escapes raw HTML from it as report.html does."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
