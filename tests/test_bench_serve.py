"""`normswap bench serve`: its options' bad input is one line, and its goals read the numbers they name
(a met and an unmet row each, so a goal that always passes fails here). The runs themselves are
benchmarks (results/serve-*), never timed tests."""

from __future__ import annotations

from normswap.benchmarks.serve import quality_goals, speed_goals


def test_unknown_kind_is_one_line(run_cli, tmp_path):
    save = tmp_path / "out.json"
    code, out, err = run_cli("bench", "serve", "--kinds", "decode,warp", "--save", save)
    assert code != 0 and "--kinds: warp" in err and len(err.strip().splitlines()) == 1
    assert not save.exists()


def _ratio(low, high=None):
    return {"ratio": low, "low": low, "high": high or low}


def test_speed_goals_read_the_lower_ends():
    run = {"over_original": {"sliced": _ratio(1.3), "sliced int8": _ratio(2.2)}, "null_control": _ratio(0.99, 1.01)}
    goals = speed_goals({"decode": run})
    assert goals["decode sliced low >= 1.25"]["met"]
    assert not goals["decode sliced int8 low >= 2.3"]["met"]
    assert goals["decode null control inside ±2%"]["met"]
    run["null_control"] = _ratio(0.97, 1.01)
    assert not speed_goals({"decode": run})["decode null control inside ±2%"]["met"]


def _arm(loss, agree=0.95):
    return {"perplexity": 10 * (1 + loss), "loss_vs_float32": loss, "greedy_agreement_with_float32": agree}


def test_quality_goals_compare_rotated_with_unrotated():
    row = {
        "model": "m",
        "variants": {
            "sliced": {"float32": {"perplexity": 10}, "int8": _arm(0.05), "int8 rotated": _arm(0.005)},
            "planted outlier": {"float32": {"perplexity": 10}, "int8": _arm(0.004), "int8 rotated": _arm(0.003, 0.8)},
        },
    }
    goals = quality_goals([row])
    assert goals["m sliced: int8 rotated loses <= 1%"]["met"]
    assert goals["m sliced: rotated no worse than without"]["met"]
    assert not goals["m planted outlier: unrotated loses clearly more"]["met"]
    assert not goals["m planted outlier int8 rotated: greedy agreement >= 90%"]["met"]
    row["variants"]["planted outlier"]["int8"] = _arm(0.2)
    assert quality_goals([row])["m planted outlier: unrotated loses clearly more"]["met"]
