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
        "--save", out,
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
    code, stdout, _ = run_cli("bench", "decode", "--budget", "0", "--save", out)
    assert code == 0, stdout
    results = json.loads(out.read_text())["decode"]
    assert [r["source"] for r in results] == ["normswap:kjv-gpt2", "normswap:kjv-neox"]
    for r in results:
        _check_decode_result(r)
        assert r["stop_reason"] == timing.BUDGET and r["pairs"] == 1
        # one pair decides nothing: too few pairs for any verdict but "no difference" / "too noisy"
        assert r["converted_over_original"]["verdict"] in (verdicts.NO_DIFFERENCE, verdicts.TOO_NOISY)
    assert stdout.count("stopped: budget") == 4  # the decode steps and the generate() calls of each
    for r in results:  # generate() on the same budget (--generate-budget's default): one pair
        assert r["generate"]["pairs"] == 1 and r["generate"]["stop_reason"] == timing.BUDGET


def test_bench_decode_refuses_a_missing_conversion(tmp_path, run_cli):
    code, _, err = run_cli("bench", "decode", f"{tmp_path}/src={tmp_path}/nowhere", "--repeats", "5")
    assert code != 0 and "nowhere" in err and len(err.strip().splitlines()) == 1


def test_bench_decode_also_times_whole_generate_calls(tmp_path, run_cli):
    """Beside the decode steps: whole greedy generate() calls at batch 1, with the same models, replicas,
    balanced rounds and null control; the JSON's ``generate`` entry per model."""
    tiny_model("gpt2", 0).save_pretrained(tmp_path / "src")
    out = tmp_path / "decode.json"
    code, stdout, _ = run_cli(
        "bench", "decode", tmp_path / "src", "--repeats", "12", "--new-tokens", "2", "--cache-tokens", "8",
        "--generate-tokens", "3", "--generate-budget", "3", "--replicas", "2", "--save", out,
    )  # fmt: skip
    assert code == 0 and "generate() of 3 tokens" in stdout
    (r,) = json.loads(out.read_text())["decode"]
    _check_decode_result(r)  # the decode rows as before
    g = r["generate"]
    assert g["new_tokens"] == 3 and g["prompt_tokens"] == 8 and 1 <= g["pairs"] <= 12
    assert g["timing"]["calls_per_sample"] == 1 and g["timing"]["balanced"]
    assert g["timing"]["replicas"] == {"original": 2, "converted": 2, "null control": 2}
    pairs = g["timing"]["pair_seconds"]
    for key, name in (("converted_over_original", "converted"), ("null_control_over_original", "null control")):
        assert g[key]["ratio"] == statistics.median(base / other for base, other in pairs[name])
    # a generate() call of 3 tokens costs more than a bare decode block of 2 steps: control that the
    # rows time whole generations, not the decode steps again
    decode_s = statistics.median(b for b, _ in r["timing"]["pair_seconds"]["converted"])
    assert statistics.median(b for b, _ in pairs["converted"]) > decode_s
    assert set(g["tokens_per_second"]) == {"original", "converted", "null control"}
    # control: --no-generate leaves generate() out
    code, stdout, _ = run_cli(
        "bench", "decode", tmp_path / "src", "--repeats", "5", "--new-tokens", "1", "--cache-tokens", "4",
        "--no-generate", "--replicas", "1", "--save", out,
    )  # fmt: skip
    assert code == 0 and "generate()" not in stdout and json.loads(out.read_text())["decode"][0]["generate"] is None
