"""lm-eval is optional: where it cannot be imported (the project's GPU machine has neither lm-eval nor
`datasets`), `normswap study` and `eval report` skip its tasks with a one-line note in their results
instead of failing after the work. The package is made unimportable the way bench/gpu.sh's dry run
does it (bench/dry_run_site/sitecustomize.py): ``sys.modules[name] = None``, which both ``import``
and ``importlib.util.find_spec`` read as "not installed"."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from normswap.evaluate.lm_eval_adapter import unavailable

HAVE_LM_EVAL = all(importlib.util.find_spec(n) is not None for n in ("lm_eval", "datasets"))


@pytest.fixture
def no_lm_eval(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)


@pytest.mark.parametrize("missing", ["lm_eval", "datasets"])
def test_unavailable_names_the_missing_package(monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)
    why = unavailable()
    assert why is not None and repr(missing) in why and "\n" not in why


@pytest.mark.skipif(not HAVE_LM_EVAL, reason="lm-eval and datasets are not installed here")
def test_unavailable_is_none_where_lm_eval_is_installed():
    assert unavailable() is None  # negative control of the test above


def test_study_without_lm_eval_trains_and_notes_the_skipped_tasks(tmp_path, no_lm_eval):
    from test_study import _config, _study

    said = []
    res = _study(
        _config(tmp_path), tmp_path / "s", arms=["layernorm", "rmsnorm"], steps=2, seeds=1,
        lm_eval_tasks=["normswap_kjv"], echo=said.append,
    )  # fmt: skip
    assert {u["status"] for u in res["units"]} == {"finished"} and res["lm_eval"] is None
    notes = [n for n in res["notes"] if "normswap_kjv not scored" in n]
    assert len(notes) == 1 and "'lm_eval' package is not installed" in notes[0]
    assert any(notes[0] in line for line in said)  # said before the training, not only recorded
    assert notes[0] in (tmp_path / "s" / "report.md").read_text()
    assert not any("lm-eval normswap_kjv on every seed" in line for line in said)


def test_eval_report_without_lm_eval_scores_the_rest_and_warns(run_cli, tmp_path, no_lm_eval):
    out = tmp_path / "rep"
    code, _, err = run_cli(
        "eval", "report", "normswap:kjv-gpt2", "--out", out, "--tasks", "normswap_kjv", "--no-speed", "--no-memory",
        "--no-diagnostics", "--max-tokens", "1024", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    note = "lm-eval tasks normswap_kjv not scored: lm-eval cannot run here: the 'lm_eval' package is not installed"
    assert any(w.startswith(note) for w in results["warnings"])
    assert results["models"][0]["perplexity"] is not None and not results["models"][0]["tasks"]
    assert note in (out / "report.md").read_text()
