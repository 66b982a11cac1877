"""Names are rendered as text in every figure, and results.json is written before any figure (issue #57, case 5).

A model directory named ``kjv$\\x$`` made ``eval report`` run every measurement and then die in
matplotlib's math-text parser with no results.json written; ``eval render`` of a received results.json
with such a name died the same way, and nested ``^{`` raised RecursionError. Now matplotlib never parses
math in normswap's figures (normswap/report/plots.py, the one module through which it draws), and a
report whose figures fail anyway still publishes results.json and says how to rebuild the rest.
"""

import io
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["kjv$\\x$", "$" + "x^{" * 400 + "}" * 400 + "$", "a$b$c$\\frac{1}{$"]


def _demo_named(name: str) -> dict:
    demo = json.loads((ROOT / "tests" / "data" / "demo-results.json").read_text())
    old = demo["models"][0]["name"]
    return json.loads(json.dumps(demo).replace(json.dumps(old), json.dumps(name)))


@pytest.mark.parametrize("name", NAMES, ids=["backslash", "nested", "unbalanced"])
def test_eval_render_draws_a_math_like_model_name_as_text(tmp_path, run_cli, name):
    (tmp_path / "results.json").write_text(json.dumps(_demo_named(name)))
    code, _, err = run_cli("eval", "render", tmp_path / "results.json")
    assert code == 0, err
    assert list(tmp_path.glob("*.png")), "the figures were drawn"
    assert name in json.loads((tmp_path / "results.json").read_text())["models"][0]["name"]


def test_every_text_artist_shows_its_string_verbatim():
    """What the report module configures: a text artist does not parse math (the control: matplotlib's
    own default does, and fails on the same string)."""
    import matplotlib
    from matplotlib.figure import Figure

    from normswap.report import plots  # noqa: F401  (configures matplotlib on import)

    def draw(**rc):
        with matplotlib.rc_context(rc):
            fig = Figure()
            fig.text(0.1, 0.5, NAMES[0])
            fig.savefig(io.BytesIO(), format="png")

    draw()  # as normswap draws
    with pytest.raises(ValueError):
        draw(**{"text.parse_math": True})  # matplotlib's default parses it as TeX and fails


def test_eval_report_keeps_results_json_when_a_figure_fails(tmp_path, monkeypatch):
    from normswap.errors import NormswapError
    from normswap.report import plots, report_dir

    def broken(results, out):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(plots, "throughput_plot", broken)
    results = _demo_named("kjv")
    out = tmp_path / "out"
    with pytest.raises(NormswapError, match=r"the measurements are saved in .*results.json.*eval render"):
        report_dir.write_report(results, out)
    saved = json.loads((out / "results.json").read_text())
    assert saved["models"] == results["models"]  # every measurement kept
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]  # no half-made page or figure
    # the control: without the failure the whole report is written
    monkeypatch.undo()
    written = report_dir.write_report(results, tmp_path / "whole")
    assert {"results", "markdown", "html"} <= set(written)
