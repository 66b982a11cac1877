"""`normswap slice --fraction auto --max-ppl-increase P` (normswap/slice/auto.py): bisection over the
--round-to grid of widths, one calibration and one rotation; the chosen width on a model whose
residual stream has a planted rank; one-line refusals before torch loads."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from normswap.assets.models import model_path

RANK = 40  # the planted stream's rank (besides the all-ones direction the conversion deletes)
FAST = ("--calibration-tokens", "1024", "--eval-tokens", "512", "--round-to", "16", "--device", "cpu")
P = 0.05  # percent: 500x the float32 noise of an exact width (~1e-5 %); width 32 here rises ~0.5 %


def _planted(path):
    """kjv-gpt2 (LayerNorm original, d = 128) with every writer of the residual stream (the token and
    position tables, each attention's and MLP's output projection and bias) projected onto the top
    RANK directions of its centred token table: the stream lives in a RANK-dim subspace (plus the
    all-ones direction), so any width >= RANK keeps the model and a narrower one cuts into it."""
    from transformers import GPT2LMHeadModel

    shutil.rmtree(path)
    shutil.copytree(model_path("kjv-gpt2"), path)
    model = GPT2LMHeadModel.from_pretrained(str(path), dtype=torch.float32)
    wte = model.transformer.wte.weight.detach().double()
    basis = torch.linalg.svd(wte - wte.mean(0), full_matrices=False)[2][:RANK].T  # d × RANK, orthonormal
    keep = (basis @ basis.T).float()
    with torch.no_grad():
        writers = [model.transformer.wte.weight, model.transformer.wpe.weight]
        for block in model.transformer.h:  # GPT-2's Conv1D stores (in, out): the stream is the last axis
            writers += [
                block.attn.c_proj.weight,
                block.attn.c_proj.bias,
                block.mlp.c_proj.weight,
                block.mlp.c_proj.bias,
            ]
        for w in writers:
            w.copy_(w @ keep)
    model.save_pretrained(str(path))


@pytest.fixture
def planted(built_once):
    return built_once(f"slice-auto-planted-rank-{RANK}", _planted)


def _auto(run_cli, src, out, p=P):
    code, stdout, err = run_cli("slice", src, out, "--fraction", "auto", "--max-ppl-increase", p, *FAST, "--json")
    assert code == 0, err
    return json.loads(stdout)


def test_auto_picks_the_narrowest_grid_width_at_or_above_the_planted_rank(planted, tmp_path, run_cli):
    """On the planted model every tried width >= RANK keeps perplexity (to float noise) and every
    narrower one raises it by more than P: the chosen width is the smallest grid width >= RANK (48),
    the largest fraction, found in at most ⌈log2(7 + 1)⌉ = 3 evaluations of the grid 16..112."""
    summary = _auto(run_cli, planted, tmp_path / "out")
    auto = summary["auto"]
    want = -(-RANK // 16) * 16
    assert auto["chosen"]["width"] == summary["width"] == want
    assert summary["fraction"] == pytest.approx(1 - want / 128) == auto["chosen"]["fraction"]
    assert 1 <= len(auto["tried"]) <= math.ceil(math.log2(7 + 1))
    for t in auto["tried"]:
        if t["width"] >= RANK:
            assert abs(t["increase_pct"]) < 1e-2 and t["passed"], t
        else:
            assert t["increase_pct"] > P and not t["passed"], t
    assert any(t["width"] < RANK for t in auto["tried"]), "the narrower side was tried"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["normswap"]["slice"]["width"] == want  # only the chosen width is written
    assert summary["perplexity"]["sliced"] == pytest.approx(auto["chosen"]["perplexity"], rel=1e-4)


def test_control_the_full_rank_model_picks_a_smaller_fraction(tmp_path, run_cli):
    """Control: kjv-gpt2 itself (no planted rank) under the same P cannot keep its perplexity at
    width 48, so auto chooses a wider width (a smaller fraction) than on the planted model."""
    summary = _auto(run_cli, model_path("kjv-gpt2"), tmp_path / "out")
    chosen = summary["auto"]["chosen"]
    assert chosen["width"] > -(-RANK // 16) * 16 and chosen["increase_pct"] <= P
    failed = [t for t in summary["auto"]["tried"] if not t["passed"]]
    assert failed and all(t["increase_pct"] > P for t in failed)


# --- the search itself (pure Python) ---


def _counting(table):
    calls = []

    def evaluate(width):
        calls.append(width)
        return table(width)

    return evaluate, calls


def test_search_bisects_and_takes_the_narrowest_passing_width_it_tried():
    """A step at width 40 on the grid 8..120 (15 widths): chosen 40 in <= 4 evaluations. Control: a
    non-monotone table (width 16 passes, 24..32 fail) is not searched exhaustively: the search
    returns a width that passed among those it tried, which need not be the narrowest passing one."""
    from normswap.slice import auto

    widths = auto.width_grid(128, 8)
    assert widths == list(range(8, 128, 8))
    evaluate, calls = _counting(lambda w: 100.0 if w >= 40 else 110.0)
    record = auto.search(widths, 128, 100.0, evaluate, 1.0)
    assert record["chosen"]["width"] == 40 and len(calls) <= 4 == math.ceil(math.log2(len(widths) + 1))
    assert [t["width"] for t in record["tried"]] == calls
    evaluate, calls = _counting(lambda w: 100.0 if w >= 40 or w == 16 else 110.0)
    record = auto.search(widths, 128, 100.0, evaluate, 1.0)
    assert record["chosen"]["passed"] and record["chosen"]["width"] in calls and len(calls) <= 4


def test_search_refuses_when_no_width_passes():
    from normswap.errors import NormswapError
    from normswap.slice import auto

    evaluate, calls = _counting(lambda w: 200.0)
    with pytest.raises(NormswapError, match="no width keeps"):
        auto.search(auto.width_grid(64, 8), 64, 100.0, evaluate, 5.0)
    assert calls[-1] == 56  # the widest on the grid was tried before refusing
    # control: the same table within a generous budget passes at the narrowest width
    assert auto.search(auto.width_grid(64, 8), 64, 100.0, evaluate, 100.0)["chosen"]["width"] == 8


_REFUSALS = textwrap.dedent("""
    import io, json, sys
    from normswap.cli.main import main
    results = []
    for args in json.loads(sys.argv[1]):
        sys.stderr = err = io.StringIO()
        try:
            main(args)
            code = 0
        except SystemExit as e:
            code = e.code
        sys.stderr = sys.__stderr__
        results.append([code, "torch" in sys.modules, err.getvalue()])
    print(json.dumps(results))
""")


def test_bad_auto_options_are_one_line_before_torch_loads(tmp_path):
    """--max-ppl-increase without auto, a negative / nan / inf P, auto without P, auto with no
    held-out tokens: exit 2, one line, torch never imported, nothing written. Control: a valid pair
    gets past these checks (it is refused later, for its missing source, in other words)."""
    out = str(tmp_path / "out")
    base = ["slice", str(model_path("kjv-gpt2")), out]
    cases = [
        ["--max-ppl-increase", "5"],
        ["--fraction", "0.3", "--max-ppl-increase", "5"],
        ["--fraction", "auto", "--max-ppl-increase", "-1"],
        ["--fraction", "auto", "--max-ppl-increase", "nan"],
        ["--fraction", "auto", "--max-ppl-increase", "inf"],
        ["--fraction", "auto"],
        ["--fraction", "auto", "--max-ppl-increase", "5", "--eval-tokens", "0"],
    ]
    control = ["slice", str(tmp_path / "no-such-model"), out, "--fraction", "auto", "--max-ppl-increase", "5"]
    runs = [base + args for args in cases] + [control]
    proc = subprocess.run(
        [sys.executable, "-c", _REFUSALS, json.dumps(runs)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    *refused, (control_code, _, control_err) = json.loads(proc.stdout)
    for args, (code, torch_loaded, err) in zip(cases, refused):
        lines = err.strip().splitlines()
        assert code == 2 and not torch_loaded and len(lines) == 1, (args, err)
        assert "max-ppl-increase" in lines[0] or "eval-tokens" in lines[0], lines
    assert control_code != 0 and "max-ppl-increase" not in control_err and "eval-tokens" not in control_err
    assert not (tmp_path / "out").exists()
