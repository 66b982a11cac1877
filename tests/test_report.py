"""`normswap eval report` end to end on real checkpoints (original, exact conversion, a
fine-tuned one with its train log): every documented file and key, ratios, the HTML is
self-contained, and OUT is never clobbered without --force."""

from __future__ import annotations

import base64
import json
import re
import shutil

import pytest
from test_evaluate_fixtures import kjv_tokenizer, save_tiny

CONTRACT_TOP = ("device", "dtype", "data", "created", "versions", "models")
CONTRACT_MODEL = (
    "name",
    "path",
    "perplexity",
    "bits_per_byte",
    "word_perplexity",
    "tokens_per_second",
    "peak_memory_bytes",
    "norm_time_share",
    "diagnostics",
    "ratios",
    "tasks",
)


@pytest.fixture(scope="module")
def checkpoints(built_once):
    """original, exact conversion and a 'fine-tuned' copy with its train log: built once per test run
    (tests/conftest.py built_once), whichever xdist worker asks first; no test writes into them."""
    root = built_once("report-checkpoints", _build_checkpoints)
    return {name: str(root / name) for name in ("orig", "conv", "ft")}


def _build_checkpoints(root):
    import normswap
    from normswap.checkpoint.write import save_checkpoint
    from normswap.convert import convert_model

    orig = save_tiny(root / "orig", seed=7)
    model = normswap.load_model(orig)
    convert_model(model, mode="exact")
    conv = save_checkpoint(model, root / "conv", tokenizer=kjv_tokenizer())
    ft = root / "ft"
    shutil.copytree(conv, ft)
    with open(ft / "train_log.jsonl", "w") as f:
        for step in range(1, 41):
            row = {
                "step": step,
                "loss": 6.0 - step * 0.05,
                "lr": 1e-4,
                "grad_norm": 1.0,
                "tokens_per_second": 1000.0,
                "world_size": 1,
            }
            if step % 10 == 0:
                row["eval_loss"] = 6.1 - step * 0.04
            f.write(json.dumps(row) + "\n")
        f.write('{"step": 41, "loss": ')  # a run killed mid-line must not break the report


@pytest.fixture(scope="module")
def report_dir(checkpoints, built_once):
    """One `eval report` of the three checkpoints (lm-eval task, speed, diagnostics), run once per
    test run; the tests below read it and never write into it."""
    return built_once("report-rep", lambda root: _report(checkpoints, root / "rep")) / "rep"


def _report(checkpoints, out):
    from normswap.cli.main import main

    args = [
        "eval",
        "report",
        f"orig={checkpoints['orig']}",
        f"conv={checkpoints['conv']}",
        f"ft={checkpoints['ft']}",
        "--baseline",
        "orig",
        "--out",
        str(out),
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--max-tokens",
        "800",
        "--repeats",
        "1",
        "--min-time",
        "0.01",
        "--new-tokens",
        "4",
        "--tasks",
        "normswap_kjv",
        "--limit",
        "1",
        "--quiet",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]  # pinned: the ratios below are float32 facts (auto is bf16 on CUDA)
    try:
        main(args)
    except SystemExit as e:
        assert not e.code, f"eval report exited {e.code}"


@pytest.mark.slow
def test_report_files_and_contract_keys(report_dir, checkpoints):
    for name in (
        "results.json",
        "report.md",
        "report.html",
        "perplexity.png",
        "throughput.png",
        "activations.png",
        "finetune_loss.png",
    ):
        assert (report_dir / name).is_file() and (report_dir / name).stat().st_size > 0, name
    assert not [
        p for p in report_dir.parent.iterdir() if ".normswap-" in p.name
    ]  # staging dir renamed away, lock released
    r = json.loads((report_dir / "results.json").read_text())
    for key in CONTRACT_TOP:
        assert key in r, key
    assert r["data"]["truncated"] and r["data"]["max_tokens"] == 800 and r["data"]["split"] == "test"
    assert r["baseline"] == "orig"
    assert [m["name"] for m in r["models"]] == ["orig", "conv", "ft"]
    by = {m["name"]: m for m in r["models"]}
    for m in r["models"]:
        for key in CONTRACT_MODEL:
            assert key in m, (m["name"], key)
        for key in ("forward", "train_step", "generate", "prefill", "decode"):
            assert m["tokens_per_second"][key] > 0
        assert m["peak_memory_bytes"] > 0
        assert m["diagnostics"]["loss"] > 0 and len(m["diagnostics"]["layers"]) == 5
        assert m["tasks"]["normswap_kjv"]["bits_per_byte"] > 0
    assert by["orig"]["path"] == str(checkpoints["orig"])
    assert (by["orig"]["kind"], by["conv"]["kind"], by["ft"]["kind"]) == ("original", "converted (exact)", "fine-tuned")
    # the baseline against itself is exactly 1; the exact conversion keeps the perplexity
    base_ratios = by["orig"]["ratios"]
    assert base_ratios["perplexity"] == 1.0 and base_ratios["peak_memory_bytes"] == 1.0
    assert all(v == 1.0 for v in base_ratios["tokens_per_second"].values())
    assert by["conv"]["ratios"]["perplexity"] == pytest.approx(1.0, abs=1e-4)
    assert by["conv"]["tasks"]["normswap_kjv"]["bits_per_byte"] == pytest.approx(
        by["orig"]["tasks"]["normswap_kjv"]["bits_per_byte"], rel=1e-4
    )
    # one number per quantity: normswap on lm-eval's own windows gives lm-eval's number
    for m in r["models"]:
        check = m["task_crosscheck"]["normswap_kjv"]
        assert check["documents"] == 1 and check["window"] == 128
        assert check["bits_per_byte"] == pytest.approx(m["tasks"]["normswap_kjv"]["bits_per_byte"], rel=1e-5)
    assert r["lm_eval_log"] == "lm_eval.log" and (report_dir / "lm_eval.log").stat().st_size > 0
    # every speed ratio carries its per-repeat interval; one repeat can never be a measured difference
    assert r["ratio_method"].startswith("throughput: median of per-pair speed ratios")
    for key in ("forward", "train_step", "generate", "prefill", "decode"):
        iv = by["conv"]["ratio_intervals"]["tokens_per_second"][key]
        assert iv["repeats"] == 1 and iv["low"] <= iv["high"] and iv["verdict"] == "no measurable difference"
    assert by["orig"]["ratio_intervals"]["tokens_per_second"]["forward"] is None  # the baseline has no ratio to doubt
    assert oct(report_dir.stat().st_mode & 0o777) != oct(0o700)  # readable by others, as the umask allows
    ft = by["ft"]["finetune"]
    assert ft["steps"][-1] == 40 and ft["eval_steps"] == [10, 20, 30, 40] and ft["final_loss"] == pytest.approx(4.0)
    assert by["orig"]["finetune"] is None


@pytest.mark.slow
def test_html_is_self_contained_and_markdown_links_its_figures(report_dir):
    html = (report_dir / "report.html").read_text()
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", html)
    assert len(images) == 4
    assert all(base64.b64decode(img)[:8] == b"\x89PNG\r\n\x1a\n" for img in images)
    assert not re.search(r"(src|href)=['\"]?(https?:|file:|//)", html)  # nothing fetched from anywhere
    for heading in ("Side by side", "Claims vs measured", "Headline", "lm-eval tasks", "Training diagnostics"):
        assert heading in html
    md = (report_dir / "report.md").read_text()
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert sorted(linked) == sorted(["perplexity.png", "throughput.png", "activations.png", "finetune_loss.png"])
    assert "| orig (baseline) |" in md and "8d" in md
    # noise is never coloured as a win or a loss, and the claims carry verdicts
    assert not re.search(r"class='r (good|bad)'", html) and "no measurable difference" in html
    assert re.search(r"class='verdict v-(yes|no|na)'>(reproduced|not reproduced|not measurable here|mixed)", html)
    assert "normswap on lm-eval's windows" in md and "the same number" in md


@pytest.mark.slow
def test_existing_out_needs_force_and_render_rebuilds(report_dir, run_cli, tmp_path):
    before = (report_dir / "results.json").read_bytes()
    code, out, err = run_cli("eval", "report", "normswap:kjv-gpt2", "--out", report_dir, "--no-speed")
    assert code == 2 and err.strip().startswith("normswap: error:") and "pass --force" in err
    assert len(err.strip().splitlines()) == 1  # refused before loading anything
    assert (report_dir / "results.json").read_bytes() == before
    code, out, err = run_cli("eval", "render", report_dir / "results.json", "--out", tmp_path / "again")
    assert code == 0, err
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert again["models"] == json.loads(before)["models"]
    assert (tmp_path / "again" / "report.html").read_text().count("data:image/png;base64,") == 4


def test_ppl_json_matches_the_library(checkpoints, run_cli):
    import normswap
    from normswap.data import load_text
    from normswap.evaluate.perplexity import perplexity, truncate_text

    code, out, err = run_cli(
        "eval",
        "ppl",
        f"a={checkpoints['orig']}",
        "--seq-len",
        "32",
        "--stride",
        "16",
        "--max-tokens",
        "300",
        "--json",
        "--quiet",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    )  # the library call below runs there
    assert code == 0, err
    got = json.loads(out)
    tok = normswap.load_tokenizer(checkpoints["orig"])
    text, _ = truncate_text(load_text("embedded", "test"), tok, 300)
    want = perplexity(normswap.load_model(checkpoints["orig"]), tok, text, seq_len=32, stride=16)
    assert got["models"][0]["name"] == "a"
    assert got["models"][0]["perplexity"] == pytest.approx(want.perplexity, rel=1e-9)
    assert got["data"]["characters"] == len(text)


def test_bad_arguments_are_one_line_errors(checkpoints, run_cli):
    code, _, err = run_cli("eval", "ppl", checkpoints["orig"], "--seq-len", "4096", "--quiet")
    assert code == 2 and "context" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    code, _, err = run_cli("eval", "ppl", "/nonexistent/model", "--quiet")
    assert code == 2 and "not found" in err and len(err.strip().splitlines()) == 1


def test_tasks_path_holds_the_shipped_tasks(run_cli):
    code, out, _ = run_cli("eval", "tasks-path")
    from pathlib import Path

    path = Path(out.strip())
    assert code == 0 and (path / "normswap_kjv.yaml").is_file() and (path / "normswap_kjv_utils.py").is_file()


def test_model_labels():
    from normswap.evaluate.side_by_side import split_label

    assert split_label("base=normswap:kjv-gpt2") == ("base", "normswap:kjv-gpt2")
    assert split_label("normswap:kjv-gpt2") == (None, "normswap:kjv-gpt2")
    assert split_label("/some/dir") == (None, "/some/dir")


def test_speed_json_with_a_baseline_not_in_the_list(checkpoints, run_cli):
    code, out, err = run_cli(
        "eval",
        "speed",
        f"conv={checkpoints['conv']}",
        "--baseline",
        f"orig={checkpoints['orig']}",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--repeats",
        "1",
        "--min-time",
        "0.01",
        "--new-tokens",
        "3",
        "--json",
        "--quiet",
    )
    assert code == 0, err
    got = json.loads(out)
    assert [m["name"] for m in got["models"]] == ["orig", "conv"]  # the baseline is added, first
    orig, conv = got["models"]
    assert orig["ratios"]["tokens_per_second"]["forward"] == 1.0
    # the ratio is the interleaved pairs' median ratio (normswap/timing.py), with its interval; not the
    # quotient of two absolute throughputs (each a median over blocks that ran at different moments)
    interval = conv["ratio_intervals"]["tokens_per_second"]["forward"]
    assert interval["low"] <= conv["ratios"]["tokens_per_second"]["forward"] <= interval["high"]
    assert conv["norm_time"]["classes"] == ["RMSNorm"] and orig["norm_time"]["classes"] == ["LayerNorm"]


# ------------------------------------------------------------------ ratios and their uncertainty
def test_paired_intervals_decide_what_is_a_difference():
    from normswap.stats.verdicts import NO_DIFFERENCE, claim_verdict, min_max_interval

    base = [100.0, 50.0, 100.0, 50.0, 100.0]  # a machine whose speed halves every other repeat
    faster = [110.0, 56.0, 108.0, 54.0, 112.0]  # 4-12 % faster within every repeat
    iv = min_max_interval(faster, base)
    assert iv["verdict"] == "higher" and iv["low"] == pytest.approx(1.08) and iv["high"] == pytest.approx(1.12)
    # Negative control: the same numbers unpaired (shuffled) straddle 1, as the machine's drift would
    # suggest to a comparison of pooled samples.
    shuffled = [54.0, 110.0, 56.0, 112.0, 108.0]
    assert min_max_interval(shuffled, base)["verdict"] == NO_DIFFERENCE
    # A range that contains 1, or too few repeats, is no measurable difference whatever the median says.
    assert min_max_interval([120, 90, 130, 125, 140], [100] * 5)["verdict"] == NO_DIFFERENCE
    assert min_max_interval([120, 121, 122, 123], [100] * 4)["verdict"] == NO_DIFFERENCE
    assert min_max_interval([80, 81, 82, 83, 84], [100] * 5)["verdict"] == "lower"
    # Claims: reproduced only when every repeat meets them, refuted only when none does.
    assert claim_verdict(min_max_interval([112, 115, 111, 118, 113], [100] * 5), at_least=1.10) == "reproduced"
    assert claim_verdict(min_max_interval([102, 95, 101, 99, 103], [100] * 5), at_least=1.10) == "not reproduced"
    assert claim_verdict(min_max_interval([105, 115, 111, 118, 113], [100] * 5), at_least=1.10) == "not measurable here"
    assert claim_verdict(min_max_interval([80, 85], [100] * 2), at_most=0.93) == "not measurable here"


def _synthetic_results(forward_samples, base_share=0.03):
    """Rows as evaluate() writes them, with chosen per-repeat samples (render functions only)."""
    from normswap.evaluate.side_by_side import ratios
    from normswap.evaluate.speed_intervals import ratio_intervals

    def row(name, fwd, share, kind):
        return {
            "name": name,
            "kind": kind,
            "perplexity": 100.0,
            "bits_per_byte": 1.5,
            "word_perplexity": 500.0,
            "tokens_per_second": {"forward": sorted(fwd)[len(fwd) // 2]},
            "norm_time_share": share,
            "norm_time": {"norm_ms_per_forward": share * 10},
            "peak_memory_bytes": None,
            "memory_detail": {"method": "not measured", "reason": "not requested (--no-memory)"},
            "speed_setup": {"samples": {"forward": fwd}},
            "flops_per_token": {"norms": 8, "model_estimate": 100},
        }

    base = row("base", [100.0] * 5, base_share, "original")
    models = [base] + [row(n, s, base_share, "converted (exact)") for n, s in forward_samples.items()]
    for m in models:
        m["ratios"] = ratios(m, base)
        m["ratio_intervals"] = ratio_intervals(m, base)
    return {"baseline": "base", "models": models, "speed_setup": {"repeats": 5}, "data": None}


def test_noise_is_never_coloured_and_beyond_amdahl_is_explained():
    from normswap.report.claims import claims
    from normswap.report.render import headlines, table_rows

    results = _synthetic_results(
        {"noisy": [93.0, 120.0, 106.0, 80.0, 130.0], "clear": [108.0, 107.0, 109.0, 109.0, 108.0]}
    )
    cards = {
        c["name"]: {label: (value, state, note) for label, value, state, note in c["items"]} for c in headlines(results)
    }
    # noise is not a headline number: the words take its place, the number goes beneath in small type
    assert cards["noisy"]["forward"] == ("no measurable difference", "same", "×1.06 [0.80–1.30]")
    # negative control: a real difference is the large coloured number
    assert cards["clear"]["forward"] == ("×1.08", "good", "[1.07–1.09]")
    header, rows = table_rows(results)
    col = header.index("forward tok/s")
    by = {row[0][0]: row for row in rows}
    assert by["noisy"][col][1].endswith("no measurable difference") and by["noisy"][col][2] == "same"
    assert by["clear"][col][2] == "good"
    throughput = claims(results)[2]
    text = "\n".join(throughput["measured"])
    # the Amdahl bound for a 3 % norm share is ×1.03: both medians exceed it, for different reasons
    assert "noisy: forward ×1.06 is above the Amdahl bound ×1.03, but its interval [0.80–1.30] reaches below" in text
    assert "clear: forward ×1.08 is above the Amdahl bound ×1.03 over its whole bracket [1.07–1.09]" in text
    # "clear" is measurably faster, but no repeat reached the quoted ×1.10; "noisy" cannot tell
    assert throughput["verdict"] == "not reproduced"


def test_memory_column_says_why_it_is_empty():
    from normswap.report.render import table_notes

    notes = table_notes(_synthetic_results({"m": [100.0] * 5}))
    assert any(n.startswith("Peak memory: not requested") for n in notes)


def test_third_party_output_goes_to_the_log(tmp_path, capfd):
    """lm-eval's bars, warnings and `git` (run as a subprocess) land in the log, not the terminal."""
    import logging
    import subprocess
    import sys
    import warnings

    from normswap.evaluate.lm_eval_adapter import routed_to

    log = tmp_path / "lm_eval.log"
    with routed_to(log):
        print("progress 50%|#####", file=sys.stderr)
        warnings.warn("model type is not a causal LM", stacklevel=2)
        logging.getLogger("lm_eval.models").warning("lm-eval says hello")
        subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path)  # fatal: not a git repository
    print("normswap's own line")  # negative control: output after the block reaches the terminal
    out, err = capfd.readouterr()
    text = log.read_text()
    assert "progress 50%" in text and "lm-eval says hello" in text and "not a git repository" in text
    assert "progress" not in err and "git" not in err and "hello" not in err
    assert out == "normswap's own line\n"
