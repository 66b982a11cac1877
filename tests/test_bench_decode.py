"""`normswap bench decode` (#26, #37): decode at batch 1, converted ÷ original, with a null control
in the same run, timed by normswap/timing.py. No wall-clock thresholds: the tests check what the
numbers are made of (the per-pair seconds behind each ratio) and how the run says it stopped."""

import json
import statistics

from helpers import tiny_model

from normswap import timing
from normswap.stats import verdicts


def _check_decode_result(r):
    pairs = r["timing"]["pair_seconds"]
    assert set(pairs) == {"converted", "null control"}
    for key, name in (("converted_over_original", "converted"), ("null_control_over_original", "null control")):
        iv = r[key]
        assert iv["pairs"] == len(pairs[name]) == r["pairs"]
        # the ratio is the median of per-pair speed ratios (original seconds / its seconds)
        assert iv["ratio"] == statistics.median(base / other for base, other in pairs[name])
        assert iv["low"] <= iv["ratio"] <= iv["high"] and iv["verdict"] in verdicts.VERDICTS
    assert r["stop_reason"] in (timing.CONVERGED, timing.BUDGET, timing.MAX_PAIRS)
    assert r["batch"] == 1 and len(r["machine"]["load_before"]) == 3


def test_bench_decode_reports_ratio_and_null_control(tmp_path, run_cli):
    tiny_model("gpt2", 0).save_pretrained(tmp_path / "src")
    out = tmp_path / "decode.json"
    # a source alone is converted first (exact), into a temporary directory
    code, stdout, _ = run_cli(
        "bench", "decode", tmp_path / "src", "--repeats", "12", "--new-tokens", "2", "--cache-tokens", "8",
        "--json", out,
    )  # fmt: skip
    assert code == 0 and "null control" in stdout and "converted/original" in stdout
    assert "stopped: max_pairs" in stdout  # 12 pairs are reached long before the default budget
    (r,) = json.loads(out.read_text())["decode"]
    _check_decode_result(r)
    assert r["pairs"] == 12 and r["cache_tokens"] == 8 and r["decode_steps_per_block"] == 2
    assert r["timing"]["calls_per_sample"] == 2
    assert r["timing"]["balanced"]  # every model as often as the original (#43)
    assert r["replicas"] == 3 and r["timing"]["replicas"] == {"original": 3, "converted": 3, "null control": 3}
    # control: the converted model is its own run, not the original's seconds again
    assert [o for _, o in r["timing"]["pair_seconds"]["converted"]] != [
        b for b, _ in r["timing"]["pair_seconds"]["converted"]
    ]


def test_bench_decode_on_its_defaults_times_every_shipped_model(tmp_path, run_cli):
    """No MODEL: every shipped model, converted here; a budget of ~0 s stops after one round each."""
    out = tmp_path / "decode.json"
    code, stdout, _ = run_cli("bench", "decode", "--budget", "0", "--json", out)
    assert code == 0, stdout
    results = json.loads(out.read_text())["decode"]
    assert [r["source"] for r in results] == ["normswap:kjv-gpt2", "normswap:kjv-neox"]
    for r in results:
        _check_decode_result(r)
        assert r["stop_reason"] == timing.BUDGET and r["pairs"] == 1
        # one pair decides nothing: too few pairs for any verdict but "no difference" / "too noisy"
        assert r["converted_over_original"]["verdict"] in (verdicts.NO_DIFFERENCE, verdicts.TOO_NOISY)
    assert stdout.count("stopped: budget") == 2


def test_bench_decode_refuses_a_missing_conversion(tmp_path, run_cli):
    code, _, err = run_cli("bench", "decode", f"{tmp_path}/src={tmp_path}/nowhere", "--repeats", "5")
    assert code != 0 and "nowhere" in err and len(err.strip().splitlines()) == 1
