"""`normswap bench slice`: a sliced model's speed against the exact conversion and the LayerNorm
original (each comparison with its own null control), and the bases' perplexity before healing.
No wall-clock thresholds: the tests check what the numbers are made of."""

import json
import statistics

from normswap import timing

TINY = ["--layers", "2", "--width", "64", "--heads", "4", "--vocab", "300"]


def test_bench_slice_times_both_baselines_with_their_null_controls(tmp_path, run_cli):
    out = tmp_path / "slice.json"
    code, stdout, err = run_cli("bench", "slice", *TINY, "--repeats", "4", "--new-tokens", "2", "--save", out, "--json")
    assert code == 0, err
    r = json.loads(out.read_text())
    assert json.loads(stdout) == r  # --json: the saved result, and nothing else, on stdout
    facts = r["facts"]
    assert (facts["hidden_size"], facts["width"]) == (64, 48)
    # one rotation: every stream matmul shrinks, so the bound is above 1; the per-layer design pays for
    # its shortcut matrices (control: a bound that ignored them would read the same for both)
    assert facts["flop_bound"] > 1 and facts["flop_bound_per_layer"] < facts["flop_bound"]
    assert facts["parameters"]["sliced"] < facts["parameters"]["original"]
    assert facts["parameters"]["per-layer"] > facts["parameters"]["sliced"]
    for kind in ("forward", "decode"):
        runs = r["speed"][kind]
        assert runs["vs_original"]["baseline"] == "original" and runs["vs_conversion"]["baseline"] == "conversion"
        assert set(runs["vs_original"]["ratios"]) == {"conversion", "sliced"}
        assert set(runs["vs_conversion"]["ratios"]) == {"sliced", "per-layer"}
        for run in runs.values():
            assert run["pairs"] == 4 and run["stop_reason"] == timing.MAX_PAIRS and run["timing"]["balanced"]
            pairs = run["timing"]["pair_seconds"]
            for name, ratio in [*run["ratios"].items(), ("null", run["null_control"])]:
                name = run["timing"]["null_name"] if name == "null" else name
                # the ratio is the median of per-pair speed ratios (baseline seconds / its seconds)
                assert ratio["ratio"] == statistics.median(b / o for b, o in pairs[name])
            # control: the sliced model's seconds are its own run, not the baseline's again
            assert [o for _, o in pairs["sliced"]] != [b for b, _ in pairs["sliced"]]
    assert set(r["goals"]) and all(isinstance(g["met"], bool) for g in r["goals"].values())
    assert "null control" in err and "FLOP bound" in err  # under --json the summary lines go to stderr


def test_bench_slice_quality_puts_pca_far_below_random(tmp_path, run_cli):
    out = tmp_path / "quality.json"
    code, stdout, _ = run_cli(
        "bench", "slice", "--quality", "--model", "normswap:kjv-gpt2", "--fractions", "0.5",
        "--calibration-tokens", "2048", "--eval-tokens", "4096", *TINY, "--plot", tmp_path, "--save", out,
    )  # fmt: skip
    assert code == 0, stdout
    r = json.loads(out.read_text())
    (row,) = r["quality"]
    (entry,) = row["fractions"]
    conv = row["conversion"]["perplexity"]
    assert abs(conv - row["original"]["perplexity"]) < 1e-3 * conv  # the conversion is exact
    pca, per, rnd = (entry[b]["perplexity"] for b in ("pca", "per-layer", "random"))
    # the control is the random basis: same shapes, no alignment with the data, and far worse
    # (deleting directions can also move perplexity a little below the conversion's on a short text)
    assert pca < rnd and abs(pca - conv) < 0.5 * (rnd - conv)
    assert per < rnd
    assert entry["pca"]["parameters"] < row["original"]["parameters"]
    shape = r["shape_parameters"]
    assert shape["fractions"][0]["pca"] < shape["original"]
    # the curve the report draws, from the same numbers
    (curve,) = r["slice_curve"]["perplexity"]
    assert curve["points"][0]["perplexity"] == {"pca": pca, "per-layer": per, "random": rnd}
    assert (tmp_path / "slice_curve.png").stat().st_size > 0


def test_bench_slice_refuses_bad_fractions_in_one_line(run_cli):
    code, _, err = run_cli("bench", "slice", "--quality", "--fractions", "0.2,1.5")
    assert code != 0 and "--fractions" in err and len(err.strip().splitlines()) == 1
