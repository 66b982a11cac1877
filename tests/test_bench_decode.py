"""`normswap bench decode` (#26): decode at batch 1, converted ÷ original, with a null control in
the same run; ratios are the paired per-repeat ratios of the recorded samples (no wall-clock
thresholds: only what the numbers are made of)."""

import json
import statistics

from helpers import tiny_model


def test_bench_decode_reports_ratio_and_null_control(tmp_path, run_cli):
    tiny_model("gpt2", 0).save_pretrained(tmp_path / "src")
    out = tmp_path / "decode.json"
    # a source alone is converted first (exact), into a temporary directory
    code, stdout, _ = run_cli("bench", "decode", tmp_path / "src", "--repeats", "5", "--new-tokens", "3", "--json", out)
    assert code == 0 and "null control" in stdout and "converted/original" in stdout
    (r,) = json.loads(out.read_text())["decode"]
    assert r["batch"] == 1 and r["decode_tokens"] == 2 and r["repeats"] == 5
    s = r["samples"]
    assert set(s) == {"original", "converted", "null control"} and all(len(v) == 5 for v in s.values())
    for key, name in (("converted_over_original", "converted"), ("null_control_over_original", "null control")):
        paired = [a / b for a, b in zip(s[name], s["original"])]
        iv = r[key]
        assert (iv["low"], iv["high"], iv["median"]) == (min(paired), max(paired), statistics.median(paired))
    # control: the converted model is its own run, not the original measured again
    assert s["converted"] != s["original"] and s["null control"] != s["original"]
    assert len(r["machine"]["load_before"]) == 3


def test_bench_decode_refuses_a_missing_conversion(tmp_path, run_cli):
    code, _, err = run_cli("bench", "decode", f"{tmp_path}/src={tmp_path}/nowhere", "--repeats", "5")
    assert code != 0 and "nowhere" in err and len(err.strip().splitlines()) == 1
