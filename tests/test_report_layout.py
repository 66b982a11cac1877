"""What a report shows and where: encoder headlines and columns, the throughput chart's labels and
axis, and signed percentages (tested on the data the plot functions draw, plus one rendered PNG)."""

from __future__ import annotations

import pytest
from test_speed_verdicts import QUIET_NULL, synthetic


def _encoder_results():
    def row(name, fid, kind):
        return {
            "name": name,
            "kind": kind,
            "model_kind": "masked-lm",
            "perplexity": None,
            "bits_per_byte": None,
            "tokens_per_second": {"forward": 1000.0, "train_step": 300.0},
            "norm_time_share": 0.05,
            "peak_memory_bytes": 10_000_000,
            "ratios": {"tokens_per_second": {"forward": 1.0, "train_step": 1.0}},
            "fidelity": fid,
            "speed_setup": {"samples": {}},
        }

    return {
        "baseline": "orig",
        "fidelity_setup": {"reference": "orig"},
        "data": None,
        "models": [
            row("orig", {"hidden_cosine": 1.0, "embedding_cosine": 1.0, "embedding_cosine_min": 1.0}, "original"),
            row(
                "approx",
                {"hidden_cosine": 0.97, "embedding_cosine": 0.9912, "embedding_cosine_min": 0.9531},
                "converted (approx)",
            ),
        ],
    }


def test_encoder_report_headlines_fidelity_and_drops_columns_that_do_not_apply():
    from normswap.report.render import headlines, table_rows

    results = _encoder_results()
    cards = headlines(results)
    assert [c["name"] for c in cards] == ["approx"]
    items = {label: value for label, value, _, _ in cards[0]["items"]}
    assert items["sentence cosine, mean"] == "0.9912" and items["sentence cosine, worst"] == "0.9531"
    header, rows = table_rows(results)
    assert "perplexity" not in header and "bits/byte" not in header and "decode tok/s" not in header
    assert "forward tok/s" in header and "peak memory" in header and all(len(r) == len(header) for r in rows)
    # control: a causal-LM run keeps its perplexity and decode columns, and has no fidelity items
    lm = synthetic({"m": ([100.0] * 5, [100.0] * 5)}, null=QUIET_NULL, null_decode=QUIET_NULL)
    header, _ = table_rows(lm)
    assert "perplexity" in header and "decode tok/s" in header
    assert not any(label.startswith("sentence") for label, *_ in headlines(lm)[0]["items"])


def test_encoder_finetune_summary_names_its_metric():
    from normswap.finetune.objectives import heldout_line

    distill = {
        "initial_eval_loss": 0.0312,
        "final_eval_loss": 0.0045,
        "initial_perplexity": None,
        "final_perplexity": None,
        "eval_tokens": 4096,
        "heldout_metric": "distillation loss",
        "heldout_perplexity_name": None,
    }
    line = heldout_line(distill)
    assert line == "held-out distillation loss 0.0312 -> 0.0045, 4,096 held-out tokens" and "n/a" not in line
    mlm = dict(
        distill,
        initial_perplexity=20.5,
        final_perplexity=12.25,
        heldout_metric="masked-LM cross-entropy",
        heldout_perplexity_name="masked-token perplexity",
        initial_eval_loss=3.02,
        final_eval_loss=2.5055,
    )
    assert "(masked-token perplexity 20.50 -> 12.25)" in heldout_line(mlm)


def test_signed_percent_has_no_negative_zero():
    from normswap.report.tables import signed_percent

    assert signed_percent(-0.001) == "0.00%" and signed_percent(0.004) == "0.00%"
    assert signed_percent(-0.27) == "-0.27%" and signed_percent(1.8) == "+1.80%"


def test_throughput_labels_sit_on_the_bars_and_an_outlying_whisker_is_clipped(tmp_path):
    from normswap.report.plots import throughput_bars, throughput_plot

    # "wild" has one repeat at x21: its whisker must not set the axis
    results = synthetic(
        {"calm": [101.0, 99.0, 100.0, 102.0, 98.0], "wild": [100.0, 2100.0, 99.0, 98.0, 101.0]}, null=QUIET_NULL
    )
    bars, top = throughput_bars(results)
    by = {b.model: b for b in bars}
    assert by["wild"].high == pytest.approx(21.0) and by["wild"].clipped
    assert top < 2.0  # sized to the bars (~1.0), not to 21
    assert not by["calm"].clipped and by["calm"].high < top
    for b in bars:
        assert b.label_y == b.value and b.label == f"{b.value:.2f}"  # on the bar, not at the whisker's top
    # control: without the outlier nothing is clipped and the axis still holds every whisker
    calm_only = synthetic({"calm": [101.0, 99.0, 100.0, 102.0, 98.0]}, null=QUIET_NULL)
    bars, top = throughput_bars(calm_only)
    assert not any(b.clipped for b in bars) and all(b.high < top for b in bars)
    results["null_control"]["tokens_per_second"]["decode"] = None
    assert throughput_plot(results, tmp_path).is_file()
