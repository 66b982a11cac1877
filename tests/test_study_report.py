"""The study's report answers the question first and fits a terminal: a bottom line (quality, speed,
memory, stability) with evidence and what would change it, measured differences as verdicts, arms
that share a verdict said once, terms defined, honest axes, and every terminal line ≤ 100 columns —
each with a negative control. Rendered from the first edition's default study (results/study-20261201T1642Z/results.json
as committed before the second edition regenerated it, kept as tests/data/study-first-edition-results.json:
an older results.json must keep rendering) and from variants of it carrying the newer keys."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "tests" / "data" / "study-first-edition-results.json"


@pytest.fixture
def results():
    return json.loads(COMMITTED.read_text())


def too_wide(lines, width=100) -> list[str]:
    return [line for line in lines if len(line) > width]


def test_terminal_summary_fits_100_columns(results):
    from normswap.report.tables import text_table
    from normswap.study.study_report import claims_rows, summary_lines

    lines = summary_lines(results, "/tmp/study")
    assert not too_wide(lines) and len(lines) > 20
    # negative control: the same claims laid out unwrapped, as the summary printed them before, ran to
    # about 300 columns (results/study-20261201T1642Z/stdout.txt of that run: 312)
    header = ["claim", "arms", "verdict", "decided by"]
    assert max(len(line) for line in text_table(header, claims_rows(results), width=None).splitlines()) > 250
    assert not too_wide(text_table(header, claims_rows(results), width=100).splitlines())
    # the table itself: a 312-character row wraps to fit, and unwrapped it would not
    row = ["equal loss at equal tokens", "rmsnorm", "not measurable here", "final held-out loss " + "x " * 130]
    assert len(text_table(["claim", "arm", "verdict", "decided by"], [row], width=None).splitlines()[2]) > 300
    wrapped = text_table(["claim", "arm", "verdict", "decided by"], [row, ["a", "b", "c", "d"]], width=100).splitlines()
    assert not too_wide(wrapped) and any("x x x" in line for line in wrapped[3:])
    # an unbreakable cell still fits (broken inside the word)
    assert not too_wide(text_table(["a", "b"], [["y" * 150, "z" * 150]], width=100).splitlines())


def test_the_report_opens_with_the_bottom_line_and_defines_its_terms(results, tmp_path):
    from normswap.study.study_report import markdown, write_report

    write_report(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    headings = [line for line in md.splitlines() if line.startswith("## ")]
    assert headings[0].startswith("## Bottom line: rmsnorm against layernorm on normswap:kjv-gpt2")
    top = md.split("## What was measured")[0]
    for topic in ("quality", "speed", "memory", "stability"):
        assert f"- **{topic}: " in top
    assert top.count("*what would change it:*") == 4
    # the measured 3.8 % memory difference is a verdict in words, not only a cell of a wide table
    assert "rmsnorm uses 3.8% more peak memory than layernorm" in top
    assert "norm share of a step: rmsnorm 4.2–9.3%, layernorm 0.8–2.5%" in top
    terms = md.split("## Terms")[1]
    for term in ("paired interval", "TOST margin", "null control", "Amdahl bound", "norm share"):
        assert f"**{term}**" in terms
    html = (tmp_path / "report.html").read_text()
    assert html.index("Bottom line") < html.index("<h2>Claims") and "<dt>Amdahl bound</dt>" in html
    # a study of the baseline and its null control alone says that it compared no norm
    only_control = copy.deepcopy(results)
    del only_control["comparisons"]["rmsnorm"]
    only_control["claims"] = []
    md = markdown(only_control, {})
    assert "## Bottom line: no arm besides the null control" in md and "measures the noise floor" in md


def test_measured_differences_become_verdicts_and_noise_does_not(results):
    from normswap.study.bottom_line import bottom_line, differences

    diffs = {(d["measure"], tuple(a for a, _ in d["arms"])): d for d in differences(results)}
    mem = diffs[("peak memory ratio", ("rmsnorm",))]
    assert mem["measured"] and mem["verdict"] == "more memory"
    assert not diffs[("training tokens/s ratio", ("rmsnorm", "layernorm-control"))]["measured"]
    # negative control: the same memory ratio with an interval that reaches 1 is no verdict
    noisy = copy.deepcopy(results)
    noisy["comparisons"]["rmsnorm"]["peak_memory_ratio"].update(low=0.99, verdict="no measurable difference")
    mem = next(d for d in differences(noisy) if d["measure"] == "peak memory ratio")
    assert not mem["measured"] and [a for a, _ in mem["arms"]] == ["rmsnorm", "layernorm-control"]
    memory = {b["topic"]: b for b in bottom_line(noisy)}["memory"]
    assert memory["verdict"] == "no measurable difference" and "more peak memory" not in memory["says"]


def test_a_verdict_several_arms_share_is_said_once(results):
    from normswap.study.study_report import claims_rows, summary_lines

    shared = copy.deepcopy(results)
    extra = [dict(c, arm="dyt") for c in shared["claims"]]
    shared["claims"] += extra
    rows = claims_rows(shared)
    migration = [r for r in rows if r[0].startswith("migration rule")]
    assert len(migration) == 1 and migration[0][1] == "rmsnorm, dyt"
    text = "\n".join(summary_lines(shared, "/tmp/s"))
    assert text.count("needs --lr-sweep") == 1
    # negative control: evidence that differs keeps its own row
    extra[0]["decided_by"] = "final held-out loss +3.00% [+2.00%, +4.00%] vs LayerNorm"
    rows = claims_rows(shared)
    assert len([r for r in rows if r[0] == "equal loss at equal tokens"]) == 2


def test_newer_keys_render_and_change_the_words(results, tmp_path):
    from normswap.study.bottom_line import bottom_line, differences
    from normswap.study.study_report import summary_lines, write_report

    new = copy.deepcopy(results)
    new["setup"].update(margin_nats=0.02, lr_schedule="cosine to 10 % after 20 warmup steps")
    new["baselines"] = {"unigram_loss": 6.18, "bigram_loss": 5.41}  # the arms end near 5.83: above the bigram
    new["comparisons"]["rmsnorm"]["amdahl_bound"] = 1.025
    new["comparisons"]["rmsnorm"]["throughput_ratio_bootstrap"] = {
        "median": 1.012,
        "low": 1.004,
        "high": 1.021,
        "repeats": 60,
        "seeds": 3,
    }
    new["setup"]["kernels"] = {"option": "best", "rms_impl": "normswap", "speedup": {"rmsnorm": {"speedup": 1.55}}}
    for u in new["units"]:
        u.update(norm_kernel="normswap rms_norm" if u["arm"] == "rmsnorm" else "F.layer_norm", norm_kernel_fused=True)
        u["norm_compute_dtype"] = "float32"
    new["stability"] = {"layernorm": {"largest_stable_lr": 0.008}, "rmsnorm": {"largest_stable_lr": 0.016}}
    new["stability"]["rmsnorm"].update(largest_stable_lr_per_seed=[0.016, 0.032], runs=8, diverged_runs=2)
    new["stability_sweep"] = {
        "comparisons": {
            "rmsnorm": {
                "largest_stable_steps_difference": {"mean": 1.5, "low": 1.1, "high": 1.9, "n": 2, "verdict": "higher"},
                "diverged_runs_difference": {
                    "mean": 0.0,
                    "low": -1.0,
                    "high": 1.0,
                    "n": 2,
                    "verdict": "no measurable difference",
                },
            }
        }
    }
    new["warnings"] = ["only 4,096 held-out tokens"]
    items = {b["topic"]: b for b in bottom_line(new)}
    assert "no better than a bigram model (5.410 nats)" in items["quality"]["says"]
    assert "reference models on the same text: unigram 6.180 nats, bigram 5.410 nats" in items["quality"]["evidence"]
    speed = "\n".join(items["speed"]["evidence"])
    assert (
        "Amdahl bound: rmsnorm's norms (kernel ×1.55 the speed of layernorm's) can make the step at most ×1.025"
        in speed
    )
    # the verdict's own interval (bootstrap over steps) is the one shown, and it is a measured difference
    assert "1.0120 [1.0040, 1.0210]" not in speed and "1.012 [1.004, 1.021] (median of step-time quotients" in speed
    assert "rmsnorm faster" in speed
    assert "rmsnorm normswap rms_norm (fused), computing in float32" in " ".join(items["speed"]["evidence"])
    stab = items["stability"]["evidence"]
    assert "rmsnorm: largest stable lr 0.016 (per seed 0.016, 0.032), diverged 2 of 8 runs" in stab
    assert "layernorm: largest stable lr 0.008" in stab
    assert (
        "largest stable learning rate (sweep steps), rmsnorm − layernorm: +1.50 [+1.10, +1.90] (2 seeds, paired): "
        "higher" in stab
    )
    # an fp32 study's claim is not measurable (claim_judges.py); the bottom line says why, whatever the sweep found
    new["claims"][2]["verdict"] = "not measurable here"
    assert {b["topic"]: b for b in bottom_line(new)}["stability"]["says"].startswith("trained in fp32")
    measured = [d for d in differences(new) if d["measured"]]
    assert [d["measure"] for d in measured][-1] == "largest stable learning rate (sweep steps)"
    new["claims"][1]["verdict"] = "not measurable here"
    assert "at most ×1.025" in {b["topic"]: b for b in bottom_line(new)}["speed"]["says"]
    lines = summary_lines(new, "/tmp/s")
    assert lines[1].startswith("WARNING: only 4,096") and not too_wide(lines)
    write_report(new, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "schedule cosine to 10 %" in md and "equivalence margin ±0.02 nats" in md and "Amdahl bound" in md
    assert "kernels best (RMSNorm implementation: normswap)" in md
    assert md.index("> **Warning.** only 4,096") < md.index("## Bottom line")
    # negative control: a run that beats the bigram by the margin is judged on its interval instead
    new["baselines"]["bigram_loss"] = 6.0
    assert "bigram" not in {b["topic"]: b for b in bottom_line(new)}["quality"]["says"]


def test_charts_have_honest_axes_and_show_the_control(results, tmp_path):
    from normswap.report.plots import interval_dots, plt, range_bars

    fig, (a, b) = plt.subplots(1, 2)
    rows = [("rmsnorm", 1.0376, 1.0376, 1.0376, "C0"), ("layernorm-control", 1.0, 1.0, 1.0, "C1")]
    interval_dots(a, rows, reference=1.0, xlabel="ratio")
    lo, hi = a.get_xlim()
    assert lo < 1.0 < 1.0376 < hi  # the control's dot at 1 sits inside the axis, not on its edge
    assert [t.get_text() for t in a.get_yticklabels()] == ["rmsnorm", "layernorm-control"]  # first on top
    assert {t.get_text() for t in a.texts} == {"1.038", "1.000"}
    range_bars(b, [("layernorm", 1.8, 0.8, 2.5, "C0", True), ("rmsnorm", 7.2, 4.2, 9.3, "C1", True)], ylabel="%")
    assert b.get_ylim()[0] == 0 and b.get_ylim()[1] > 9.3  # bars from 0, every whisker inside
    plt.close(fig)
    from normswap.study.study_report import bars_plot

    assert bars_plot(results, tmp_path).stat().st_size > 10_000


def test_speed_says_every_reason_it_cannot_tell_and_quality_keeps_a_measured_gap(results):
    from normswap.study.bottom_line import bottom_line

    busy = copy.deepcopy(results)
    cmp = busy["comparisons"]["rmsnorm"]
    cmp["amdahl_bound"] = 1.002
    cmp["throughput_gates"] = {"amdahl_below_claim": True, "busy_load": 13.1, "cpus": 2, "control_within": False}
    busy["claims"][1]["verdict"] = "not measurable here"
    speed = {b["topic"]: b for b in bottom_line(busy)}["speed"]["says"]
    assert "at most ×1.002" in speed and "load average 13.1 on 2 CPUs; the null control outside its band" in speed
    # control: a quiet machine names no noise
    cmp["throughput_gates"] = {"amdahl_below_claim": True, "busy_load": None, "cpus": 2, "control_within": True}
    assert "too noisy" not in {b["topic"]: b for b in bottom_line(busy)}["speed"]["says"]
    # equal within the margin, yet measurably apart: both are said
    busy["claims"][0]["verdict"] = "reproduced"
    cmp["final_eval_loss_difference"].update(mean=0.0438, low=0.0361, high=0.0516, verdict="higher")
    quality = {b["topic"]: b for b in bottom_line(busy)}["quality"]["says"]
    assert "within ±1% of the loss" in quality and "measurably worse: +0.0438 [+0.0361, +0.0516] nats" in quality
    cmp["final_eval_loss_difference"].update(low=-0.01, verdict="no measurable difference")
    assert "measurably" not in {b["topic"]: b for b in bottom_line(busy)}["quality"]["says"]


def test_every_committed_study_and_a_stripped_one_render(tmp_path):
    """Older results.json files (every study committed in results/, whatever version
    wrote them) and one stripped of every optional block still render, within 100 columns."""
    from normswap.study.study_report import summary_lines, write_report

    found = sorted(REPO.glob("results/study*/results.json"))
    assert len(found) >= 2
    stripped = json.loads(COMMITTED.read_text())
    for k in ("precision", "null_control", "timing", "lr_sweep", "migration_rule", "notes", "architecture"):
        stripped.pop(k, None)
    for u in stripped["units"]:
        u.pop("memory", None)
        u.pop("timing", None)
    for i, results in enumerate([json.loads(p.read_text()) for p in found] + [stripped]):
        out = tmp_path / str(i)
        out.mkdir()
        write_report(results, out)
        assert (out / "report.md").read_text().startswith("# LayerNorm vs RMSNorm")
        assert not too_wide(summary_lines(results, "/tmp/s"))


def test_holm_and_downstream_scores_are_rendered(results, tmp_path):
    from normswap.study.bottom_line import bottom_line
    from normswap.study.study_report import markdown, summary_lines

    new = copy.deepcopy(results)
    assert "Holm" not in markdown(new, {}) and "lm-eval" not in markdown(new, {})  # control: older results
    new["claims"][0]["p_holm"] = 0.0123
    new["multiplicity"] = {
        "method": "Holm step-down over the claims decided by a test",
        "family_size": 3,
        "alpha": 0.05,
        "claims_judged": 4,
        "untested": 1,
    }
    new["lm_eval"] = {
        "layernorm": {"seed": 0, "scores": {"normswap_kjv": {"bits_per_byte": 2.101, "bits_per_byte_stderr": 0.1}}},
        "rmsnorm": {"seed": 0, "scores": {"normswap_kjv": {"bits_per_byte": 2.093}}},
    }
    md = markdown(new, {})
    assert "(Holm-adjusted p = 0.0123)" in md and "3 claim(s) in the family at α = 0.05; 1 decided without a test" in md
    assert "**Holm correction**" in md.split("## Terms")[1]
    assert "| rmsnorm | 0 | 2.0930 |" in md and "stderr" not in md.split("## Downstream")[1].split("##")[0]
    quality = {b["topic"]: b for b in bottom_line(new)}["quality"]["evidence"]
    shown = "lm-eval (seed 0 shown; paired over seeds in results lm_eval): normswap_kjv bits_per_byte"
    assert f"{shown} layernorm 2.1010, rmsnorm 2.0930" in quality
    assert not too_wide(summary_lines(new, "/tmp/s"))
