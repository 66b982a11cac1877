"""The eval report puts no noise in large type and draws no misleading axis: a ratio that is no
measured difference is words, not a headline number; a quality change whose interval contains no
change is not coloured; warnings come first; time-in-norms bars carry their range beside the null
control's; a zoomed axis says so only when it is zoomed; one multiplication sign and one number
format. Synthetic results shaped as evaluate() writes them (test_speed_verdicts.synthetic), plus the
committed demo results.json rendered as a person would read it — each check with a negative control."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from test_speed_verdicts import BUSY_NULL, CLEAR, QUIET_NULL, synthetic

REPO = Path(__file__).resolve().parents[1]
NOISY = [93.0, 120.0, 106.0, 80.0, 130.0]
ASCII_TIMES = re.compile(r"(?<![\w.])x\d+\.\d")  # "x1.10" (not "x86_64", not "0x1f")


def _cards(results):
    from normswap.report.render import headlines

    return {
        c["name"]: {label: (value, state, note) for label, value, state, note in c["items"]} for c in headlines(results)
    }


def test_noise_is_words_in_the_headline_and_a_measured_ratio_is_the_number():
    from normswap.report.render import html_report

    results = synthetic({"noisy": NOISY, "clear": CLEAR}, null=QUIET_NULL)
    cards = _cards(results)
    assert cards["noisy"]["forward"] == ("no measurable difference", "same", "×1.06 [0.80–1.30]")
    assert cards["clear"]["forward"] == ("×1.20", "good", "[1.18–1.22]")
    html = html_report(results, {})
    assert "<div class='v same words'>no measurable difference</div>" in html
    assert "<div class='v good'>×1.20</div>" in html  # control: a measured difference stays in large type
    assert "<div class='v same'>×1.06</div>" not in html
    # a busy machine: every ratio, even the clear one, becomes the words "too noisy to tell"
    busy = _cards(synthetic({"clear": CLEAR}, null=BUSY_NULL))
    assert busy["clear"]["forward"] == ("too noisy to tell", "same", "×1.20 [1.18–1.22]")


def test_a_quality_change_whose_interval_contains_no_change_is_not_coloured():
    from normswap.report.render import table_rows

    results = synthetic({"m": CLEAR}, null=QUIET_NULL)
    m = results["models"][1]
    m["perplexity"], m["bits_per_byte"] = 95.0, 1.494  # 5 % lower perplexity, bits/byte -0.40 %
    m["ratios"].update(perplexity=0.95, bits_per_byte=1.494 / 1.5)

    def ppl_cell(res):
        header, rows = table_rows(res)
        return rows[1][header.index("perplexity")], rows[1][header.index("bits/byte")]

    ppl, bpb = ppl_cell(results)
    assert ppl == ("95.000", "-5.00%", "good")  # no interval recorded: the number decides, as before
    assert bpb[1] == "-0.40%"  # not "×1.00": the real difference shows
    # evaluate/quality_intervals.py's bootstrap over blocks (results.json models[*].quality_intervals) reaches 1
    m["quality_intervals"] = {"perplexity": {"low": 0.90, "high": 1.01, "level": 0.95}}
    ppl, _ = ppl_cell(results)
    assert ppl[2] == "same" and _cards(results)["m"]["perplexity"][1] == "same"
    assert "no measurable difference" in _cards(results)["m"]["perplexity"][2]
    m["quality_intervals"]["perplexity"] = {"low": 0.93, "high": 0.97}  # control: excludes 1
    assert ppl_cell(results)[0][2] == "good" and _cards(results)["m"]["perplexity"][1] == "good"


def test_warnings_come_first():
    from normswap.report.render import html_report, markdown

    results = synthetic({"m": CLEAR}, null=QUIET_NULL)
    results["versions"] = {"normswap": "test"}
    assert "Warning." not in markdown(results, {})  # control: no warnings, no banner
    results["warnings"] = ["only 208 words scored: too few for a 5 % perplexity difference"]
    md = markdown(results, {})
    assert md.splitlines()[2] == "> **Warning.** only 208 words scored: too few for a 5 % perplexity difference"
    html = html_report(results, {})
    assert html.index("only 208 words") < html.index("<div class='meta'>") < html.index("<h2>")


def test_time_in_norms_bars_carry_their_range_beside_the_null_control():
    from normswap.report.plots import norm_share_rows, norm_share_title

    results = synthetic({"m": CLEAR}, null=QUIET_NULL)
    for row in results["models"] + [results["null_control"]]:
        row["speed_setup"]["samples"]["norm_share"] = [0.02, 0.03, 0.05, 0.03, 0.04]
    rows = {r.name: r for r in norm_share_rows(results)}
    assert set(rows) == {"base", "m", "base (null control)"}
    assert rows["m"].low == pytest.approx(2.0) and rows["m"].high == pytest.approx(5.0) and rows["m"].value == 3.0
    assert "whisker: per-repeat range" in norm_share_title(results)
    # control: results written before the per-repeat shares were kept draw no whisker and say why
    for row in results["models"] + [results["null_control"]]:
        del row["speed_setup"]["samples"]["norm_share"]
    assert all(r.low is None for r in norm_share_rows(results))
    assert "per-repeat range not recorded" in norm_share_title(results)
    # timed by the instrument (the demo's run of 2026-12-03): no whiskers, the title says what the bar is and
    # the null's range
    demo = json.loads((REPO / "tests" / "data" / "demo-results-2026-12-03.json").read_text())
    title = norm_share_title(demo)
    assert all(r.low is None for r in norm_share_rows(demo)) and "medians of the instrument's blocks" in title
    assert "null control ÷ baseline [0.99–1.01]" in title and "too noisy" not in title


def test_a_zoomed_axis_says_so_only_when_it_is_zoomed(tmp_path):
    from normswap.report.plots import perplexity_plot, value_limits

    bottom, top, zoomed = value_limits([121.9, 124.1])
    assert zoomed and 0 < bottom < 121.9 and top > 124.1
    bottom, top, zoomed = value_limits([30.0, 900.0])  # the padding would run below 0
    assert (bottom, zoomed) == (0.0, False) and top > 900
    results = synthetic({"m": CLEAR}, null=QUIET_NULL)
    results["data"] = {"caption": "test text"}
    results["models"][1]["perplexity"] = 900.0
    results["models"][1]["ratios"]["perplexity"] = 9.0
    assert perplexity_plot(results, tmp_path).stat().st_size > 10_000


def test_numbers_have_one_format_and_one_multiplication_sign(tmp_path):
    from normswap.report.render import fmt_num, fmt_ratio
    from normswap.report.report_dir import render_into

    assert (fmt_num(979.45), fmt_num(1072.31), fmt_num(1072.31, 0)) == ("979.45", "1,072.31", "1,072")
    assert (fmt_ratio(0.996), fmt_ratio(0.9996), fmt_ratio(1.04), fmt_ratio(1.0)) == (
        "-0.40%",
        "-0.04%",
        "×1.04",
        "×1.00",
    )
    results = json.loads((REPO / "tests" / "data" / "demo-results.json").read_text())
    render_into(copy.deepcopy(results), tmp_path)
    md, html = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert not ASCII_TIMES.findall(md) and not ASCII_TIMES.findall(html) and "×" in md
    # control: the pattern finds the sign the report used to mix in (results/demo-20261204T2014Z/report.md, before
    # this change)
    assert ASCII_TIMES.findall("exact: 24.61 ms (2639.7% more time, ratio x27.40 [1.04–42.71]; 6.6% of its forward)")
    # tokens/s: whole numbers with separators in every row (no 979.45 beside 1,072)
    table = md.split("## Side by side")[1].split("\n\n")[1]
    cells = [row.split(" | ")[4].split(" (")[0] for row in table.splitlines()[2:]]
    assert all(re.fullmatch(r"\d{1,3}(,\d{3})*", c) for c in cells), cells


def test_render_in_place_replaces_only_the_report_files(tmp_path):
    """`normswap eval render DIR/results.json` rebuilds the report beside it and keeps everything else
    in DIR (the demo keeps its terminal log and an older run there); before, DIR was replaced whole."""
    from normswap.report.report_dir import rerender

    results = synthetic({"m": CLEAR}, null=QUIET_NULL)
    results["versions"] = {"normswap": "test"}
    folder = tmp_path / "demo"
    (folder / "idle-run").mkdir(parents=True)
    (folder / "idle-run" / "results.json").write_text("{}")
    (folder / "demo-terminal.txt").write_text("the run's terminal\n")
    (folder / "report.md").write_text("stale report\n")
    (folder / "results.json").write_text(json.dumps(results))
    written = rerender(folder / "results.json")
    assert (folder / "demo-terminal.txt").read_text() == "the run's terminal\n"
    assert (folder / "idle-run" / "results.json").is_file()
    assert "stale" not in (folder / "report.md").read_text() and written["html"] == folder / "report.html"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no staging directory left behind
    # control: rendering to another DIR still publishes a whole new directory
    other = rerender(folder / "results.json", tmp_path / "copy")
    assert other["markdown"].read_text().startswith("# ") and not (tmp_path / "copy" / "demo-terminal.txt").exists()


def test_the_eval_report_defines_the_words_it_uses():
    from normswap.report.render import eval_terms, markdown

    results = synthetic({"m": CLEAR}, null=QUIET_NULL)
    results["versions"] = {"normswap": "test"}
    terms = markdown(results, {}).split("## Terms")[1]
    for term in ("null control", "too noisy to tell", "no measurable difference", "Amdahl bound"):
        assert f"**{term}**" in terms
    # control: a run that timed nothing defines no speed words
    for m in results["models"]:
        m["tokens_per_second"] = {}
    assert eval_terms(results) == []
