"""Speed verdicts that survive a busy machine: the null control (the baseline timed twice) decides
whether a speed ratio may be called a difference and coloured (normswap/stats/verdicts.py).

The render tests use synthetic per-repeat timing records, shaped as evaluate() writes them, so the
verdicts are known in advance; one test runs evaluate() on tiny models for the keys it writes.
"""

from __future__ import annotations

import pytest

QUIET_NULL = [100.0, 99.0, 101.0, 100.5, 99.5]  # the baseline against itself within ±1 %
BUSY_NULL = [100.0, 61.0, 140.0, 85.0, 118.0]  # another job came and went during the run
BASE = [100.0] * 5
CLEAR = [120.0, 119.0, 121.0, 122.0, 118.0]  # ×1.18–1.22 in every repeat


def _row(name, fwd, decode=None, kind="converted (exact)"):
    samples = {"forward": fwd} | ({"decode": decode} if decode else {})
    return {
        "name": name,
        "kind": kind,
        "perplexity": 100.0,
        "bits_per_byte": 1.5,
        "word_perplexity": 500.0,
        "tokens_per_second": {k: sorted(v)[len(v) // 2] for k, v in samples.items()},
        "norm_time_share": 0.03,
        "norm_time": {"norm_ms_per_forward": 0.3},
        "peak_memory_bytes": None,
        "memory_detail": {"method": "not measured"},
        "speed_setup": {"samples": samples},
        "flops_per_token": {"norms": 8, "model_estimate": 100},
    }


def synthetic(models: dict, null=None, null_decode=None, *, load=(0.2, 0.3)):
    """results.json as evaluate() assembles it: ``models`` {name: forward samples}, the null control's
    forward samples (None: a run without one)."""
    from normswap.evaluate.side_by_side import ratios, speed_noise
    from normswap.evaluate.speed_intervals import null_intervals, ratio_intervals

    base = _row("base", BASE, BASE if null_decode else None, kind="original")
    rows = [base] + [_row(n, *(s if isinstance(s, tuple) else (s,))) for n, s in models.items()]
    results = {
        "baseline": "base",
        "models": rows,
        "data": None,
        "device": "cpu (test)",
        "dtype": "float32",
        "created": "2026-12-01",
        "speed_setup": {"repeats": 5, "batch_size": 2, "seq_len": 16, "warmup": 1, "prompt_len": 8, "new_tokens": 4},
    }
    null_row = None
    if null is not None:
        null_row = _row("base (null control)", null, null_decode, kind="original")
        null_row["of"] = "base"
        results["null_control"] = null_row
    null_ivs = null_intervals(null_row, base) if null_row else None
    for m in rows:
        m["ratios"] = ratios(m, base)
        m["ratio_intervals"] = ratio_intervals(m, base, null_ivs)
    machine = {
        "load_before": [load[0]] * 3,
        "load_after": [load[1]] * 3,
        "cpu_count": 2,
        "usable_cpus": 2,
        "torch_threads": 2,
    }
    results["speed_noise"] = speed_noise(null_ivs, machine)
    return results


def _states(results):
    from normswap.report.render import headlines, table_rows

    cards = {c["name"]: {label: state for label, _, state, _ in c["items"]} for c in headlines(results)}
    header, rows = table_rows(results)
    col = header.index("forward tok/s")
    table = {row[0][0]: row[col][2] for row in rows}
    return cards, table


def _documents(results, tmp_path):
    from normswap.report.render import html_report, markdown

    return markdown(results, {}), html_report(results, {})


def test_a_noisy_null_control_colours_nothing_and_says_so(tmp_path):
    from normswap.report.claims import claims
    from normswap.report.render import noise_banner

    results = synthetic({"clear": CLEAR, "slower": [80.0, 81.0, 79.0, 80.5, 79.5]}, null=BUSY_NULL, load=(5.8, 7.1))
    cards, table = _states(results)
    # every ratio excludes 1 in every repeat, yet the null control ranged 0.61-1.40: nothing is coloured
    assert cards["clear"]["forward"] == "same" and cards["slower"]["forward"] == "same"
    assert table["clear"] == "same" and table["slower"] == "same"
    assert results["models"][1]["ratio_intervals"]["tokens_per_second"]["forward"]["verdict"] == "too noisy to tell"
    banner = noise_banner(results)
    assert banner and "[0.61–1.40]" in banner and "no speed ratio" in banner and "7.1" in banner
    md, html = _documents(results, tmp_path)
    assert md.count("Too noisy to tell.**") == 1 and banner in md  # said once, above the headline
    assert md.index(banner) < md.index("## Headline")
    assert html.count("class='noisy'") == 1
    assert "class='v good'" not in html and "class='v bad'" not in html and "r good" not in html and "r bad" not in html
    # the claims follow the same rule: no verdict from a run that could not tell
    throughput = claims(results)[2]
    assert throughput["verdict"] == "not measurable here"
    assert results["speed_noise"]["tight"] == {"forward": False} and results["speed_noise"]["load_after"] == [7.1] * 3


def test_a_tight_null_control_lets_a_clear_difference_be_coloured(tmp_path):
    from normswap.report.claims import claims
    from normswap.report.render import noise_banner

    results = synthetic({"clear": CLEAR}, null=QUIET_NULL)
    cards, table = _states(results)
    assert cards["clear"]["forward"] == "good" and table["clear"] == "good"
    assert noise_banner(results) is None
    md, html = _documents(results, tmp_path)
    assert "Too noisy" not in md and "class='noisy'" not in html and "class='v good'" in html
    assert claims(results)[2]["verdict"] == "reproduced"  # ×1.18 or more in every repeat, on a quiet machine
    assert results["speed_noise"]["tight"] == {"forward": True}


def test_a_ratio_inside_the_null_controls_range_is_no_difference():
    # ×1.02–1.03 excludes 1, but the baseline against itself did 0.97–1.04: that is what noise does here
    inside = [102.0, 103.0, 102.5, 102.0, 103.0]
    null = [97.0, 104.0, 100.0, 101.0, 99.0]
    cards, table = _states(synthetic({"inside": inside}, null=null))
    assert cards["inside"]["forward"] == "same" and table["inside"] == "same"
    # control: the same ratio without a null control (older results) is coloured by the interval alone
    cards, table = _states(synthetic({"inside": inside}, null=None))
    assert cards["inside"]["forward"] == "good" and table["inside"] == "good"


def test_noise_is_judged_per_kind():
    from normswap.report.render import noise_banner

    # forward quiet, decode noisy: forward is coloured, decode is not, and the banner names decode only
    results = synthetic(
        {"m": (CLEAR, [70.0, 71.0, 69.0, 70.0, 70.5])}, null=QUIET_NULL, null_decode=[100.0, 70.0, 130.0, 90.0, 110.0]
    )
    cards, _ = _states(results)
    assert cards["m"]["forward"] == "good" and cards["m"]["decode"] == "same"
    banner = noise_banner(results)
    assert "no decode ratio" in banner and "forward" not in banner.split("ranged")[1].split("against")[0]


def test_too_few_repeats_are_not_called_noise():
    from normswap.stats.verdicts import NO_DIFFERENCE, min_max_interval

    iv = min_max_interval([120.0, 121.0], [100.0, 100.0], {"low": 0.5, "high": 2.0, "repeats": 2})
    assert iv["verdict"] == NO_DIFFERENCE


def test_evaluate_times_a_null_control_and_records_the_machine():
    from helpers import tiny_model

    from normswap.evaluate.config import EvalConfig, SpeedConfig
    from normswap.evaluate.side_by_side import ModelEntry, evaluate
    from normswap.stats.verdicts import judged

    base = tiny_model("gpt2")
    entries = [ModelEntry("orig", model=base), ModelEntry("copy", model=tiny_model("gpt2"))]
    cfg = EvalConfig(
        perplexity=False,
        diagnostics=False,
        memory=False,
        fidelity=False,
        seq_len=16,
        batch_size=2,
        speed_setup=SpeedConfig(repeats=12, warmup=0, min_time=0.0, new_tokens=3),
    )
    results = evaluate(entries, cfg, baseline_name="orig")
    null = results["null_control"]
    assert null["name"] == "orig (null control)" and null["of"] == "orig"
    # timed in every round of pairs, like the models (normswap/timing.py): 12 pairs per kind at most
    assert null["speed_setup"]["paired"]["forward"]["pairs"] == results["speed_timing"]["forward"]["rounds"] <= 12
    assert [m["name"] for m in results["models"]] == ["orig", "copy"]  # never shown as a model
    noise = results["speed_noise"]
    assert noise["null_control"] and noise["delta"] == pytest.approx(0.02)
    assert set(noise["null_spread"]) >= {"forward", "train_step", "decode"}
    assert len(noise["load_before"]) == 3 and noise["usable_cpus"] >= 1
    assert "norm_ms_per_forward" in noise["null_spread"]  # time in norms has a null control too
    for kind, iv in noise["null_spread"].items():
        # time in norms is the instrument's speed interval turned over: the band is judged on that
        low, high = (1 / iv["high"], 1 / iv["low"]) if kind == "norm_ms_per_forward" else (iv["low"], iv["high"])
        within = 0.98 <= low and high <= 1.02
        assert noise["tight"][kind] == (within if judged(iv) else None)  # None: too few pairs to judge
        timed = "norms" if kind == "norm_ms_per_forward" else kind
        assert results["speed_timing"][timed]["stop_reason"] in ("converged", "budget", "max_pairs")
    # a noisy kind's ratio is never a difference
    for kind, iv in results["models"][1]["ratio_intervals"]["tokens_per_second"].items():
        if iv and noise["tight"].get(kind) is False:
            assert iv["verdict"] == "too noisy to tell"
    # opting out: no null control, and the report says the verdicts rest on the intervals alone
    import dataclasses

    from normswap.report.render import null_control_note

    off = evaluate(
        entries,
        dataclasses.replace(cfg, speed_setup=dataclasses.replace(cfg.speed_setup, null_control=False, repeats=1)),
        baseline_name="orig",
    )
    assert "null_control" not in off and off["speed_noise"]["null_control"] is False
    assert null_control_note(off).startswith("No null control")


def test_the_report_says_how_its_throughput_brackets_were_made():
    """A report of the instrument's pairs names the median per-pair ratio and its bootstrap interval over
    the pairs actually run; control: results written before the instrument (raw per-repeat samples, no
    pairs) keep the per-repeat words they were judged by."""
    from helpers import tiny_model

    from normswap.evaluate.config import EvalConfig, SpeedConfig
    from normswap.evaluate.side_by_side import ModelEntry, evaluate
    from normswap.evaluate.speed_intervals import throughput_method
    from normswap.report.claims import claims
    from normswap.report.render import table_notes
    from normswap.report.tables import summary_rows, summary_table

    entries = [ModelEntry("orig", model=tiny_model("gpt2")), ModelEntry("copy", model=tiny_model("gpt2"))]
    cfg = EvalConfig(
        perplexity=False, diagnostics=False, memory=False, fidelity=False, seq_len=16, batch_size=2,
        speed_setup=SpeedConfig(repeats=12, warmup=0, min_time=0.0, new_tokens=3),
    )  # fmt: skip
    results = evaluate(entries, cfg, baseline_name="orig")
    pairs = results["models"][1]["ratio_intervals"]["tokens_per_second"]["forward"]["pairs"]
    words = throughput_method(results)
    assert "per-pair ratios" in words and f"{pairs}" in words and "bootstrap" in words
    assert words in " ".join(table_notes(results)) and "per-repeat" not in " ".join(table_notes(results))
    assert words in claims(results)[2]["meaning"]
    assert summary_table(summary_rows(results))[0][-2] == "ratio [95% interval]"

    old = synthetic({"clear": CLEAR}, QUIET_NULL)  # raw per-repeat samples, as before the instrument
    assert "per-repeat" in throughput_method(old) and "per-pair" not in throughput_method(old)
    assert "ratio [per-repeat range]" in summary_table(summary_rows(old))[0]


def test_time_in_norms_claim_quotes_the_ratio_its_interval_brackets():
    """The instrument's norm-time ratio is the median of per-pair ratios; the two models' median ms can
    give another number (0.38 here against a per-pair 0.41 [0.40-0.42]), which printed beside the
    interval read as a ratio outside its own bracket. The claim quotes the paired median, and decides
    both ways: 59 % less time reproduces "7-64 % less", 1 % less does not."""
    from normswap.evaluate.side_by_side import speed_noise
    from normswap.evaluate.speed_intervals import null_intervals, ratio_intervals
    from normswap.report.claims import claims

    def row(name, ms, speed=None):
        paired = {} if speed is None else {"norms": {**speed, "pairs": 60, "stop_reason": "budget"}}
        return {
            "name": name,
            "kind": "original" if speed is None else "converted (exact)",
            "tokens_per_second": {"forward": 1000.0},
            "norm_time_share": ms / 40,
            "norm_time": {"share_of_forward": ms / 40, "norm_ms_per_forward": ms, "layers": 9, "classes": ["X"]},
            "speed_setup": {"paired": paired},
        }

    base = row("base", 0.60)
    # the instrument's *speed* ratios (base seconds / model seconds): 1/0.41 = 2.44, interval 1/0.42-1/0.40
    lighter = row("lighter", 0.228, {"ratio": 1 / 0.41, "low": 1 / 0.42, "high": 1 / 0.40, "verdict": "faster"})
    alike = "no measurable difference"
    same = row("same", 0.594, {"ratio": 1 / 0.99, "low": 1 / 1.0, "high": 1 / 0.98, "verdict": alike})
    null = row("base (null control)", 0.60, {"ratio": 1.0, "low": 0.995, "high": 1.006, "verdict": alike})
    null_ivs = null_intervals(null, base)
    results = {"baseline": "base", "models": [base, lighter, same], "null_control": null}
    for m in results["models"]:
        m["ratio_intervals"] = ratio_intervals(m, base, null_ivs)
    results["speed_noise"] = speed_noise(null_ivs, {})
    iv = lighter["ratio_intervals"]["norm_ms_per_forward"]
    assert (iv["low"], iv["median"], iv["high"]) == pytest.approx((0.40, 0.41, 0.42)) and iv["verdict"] == "lower"
    claim = next(c for c in claims(results) if c["claim"].startswith("RMSNorm takes 7-64% less time"))
    line = {text.split(":")[0]: text for text in claim["measured"]}
    assert "ratio ×0.41 [0.40–0.42]" in line["lighter"] and "×0.38" not in line["lighter"], line["lighter"]
    assert "59.0% less time" in line["lighter"] and line["lighter"].endswith(": reproduced")
    assert line["same"].endswith(": not reproduced"), line["same"]
    # the table's time-in-norms cell: the share, the time ratio with its interval, green only when less time
    from normswap.report.render import table_rows

    header, rows = table_rows(results)
    col = header.index("time in norms")
    cells = {row[0][0]: row[col] for row in rows}
    assert cells["lighter"] == ("0.6%", "×0.41 [0.40–0.42]", "good")
    assert cells["same"][2] == "same" and "no measurable difference" in cells["same"][1]
    assert cells["base (baseline)"] == ("1.5%", "", "")


def test_eval_speeds_terminal_table_shows_the_norm_time_ratio(capsys):
    """`normswap eval speed` prints the share and, against the baseline, the norm-time ratio with its
    interval: the demo's run of 2026-12-03 (converted norms ×0.41 of the LayerNorms' time); the baseline, only
    its share."""
    import json
    from pathlib import Path

    from normswap.cli.eval_command import _print_speed

    results = json.loads((Path(__file__).resolve().parent / "data" / "demo-results-2026-12-03.json").read_text())
    _print_speed(results)
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.split()}
    assert "0.7% ×0.41 [0.40–0.42]" in rows["exact"] and "n.d." not in rows["exact"].split("0.7%")[1]
    assert rows["original"].rstrip().endswith("1.6%")
