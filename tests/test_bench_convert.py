"""`normswap bench convert` on its own defaults but the size (#37: every bench subcommand runs in the
suite): the copy baseline, convert --no-verify and a verified convert of one built checkpoint, each
in its own process, with the time and memory each took against the copy. No wall-clock
thresholds: what is checked is what the numbers are made of and that the conversion happened."""

import json


def test_bench_convert_on_its_defaults_at_test_size(tmp_path, run_cli):
    work = tmp_path / "work"
    code, _, err = run_cli("bench", "convert", "--workdir", work, "--json")  # not there yet: one line
    assert code != 0 and "no such directory" in err and len(err.strip().splitlines()) == 1
    work.mkdir()
    # the defaults (family, dtype, shards, mode) but a checkpoint of ~30 M parameters, one round
    code, out, err = run_cli("bench", "convert", "--params", "30000000", "--rounds", "1", "--workdir", work, "--json")
    assert code == 0, err
    r = json.loads(out)
    ckpt = r["checkpoint"]
    assert ckpt["family"] == "gpt_neox" and ckpt["dtype"] == "bfloat16" and ckpt["files"] >= 2
    assert 20e6 < ckpt["parameters"] < 40e6
    steps = r["steps"]
    assert set(steps) == {"copy", "convert_no_verify", "convert_verified"}
    for name, step in steps.items():
        assert step["seconds_all"] and all(s > 0 for s in step["seconds_all"]), name
        assert step["peak_rss_bytes_max"] > 0
    # the ratios are what they say: each step's median over the copy's
    copy = steps["copy"]["seconds_median"]
    for name in ("convert_no_verify", "convert_verified"):
        x = steps[name]["seconds_median"] / copy  # both rounded in the JSON: 2 % slack
        assert abs(steps[name]["x_copy"] - x) < 0.02 * x + 0.01
    assert r["mode"] == "exact" and r["baseline"]["returncode"] == 0
    # negative control: a size the family cannot hold is one line and a non-zero exit, nothing built
    code, _, err = run_cli("bench", "convert", "--params", "2000000", "--workdir", work, "--json")
    assert code != 0 and "too small" in err and len(err.strip().splitlines()) == 1
