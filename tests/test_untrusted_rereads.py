"""Everything a command reads back that it wrote earlier is untrusted input (issue #39, the sweep):
a received or hand-edited results.json that `eval render` rebuilds a report from, a recipe run's
directory (`normswap run --resume`), the kernel choice cache. Each case plants what another user or a
careless copy could leave (a wrong type, a link, another user's write bit) and has a control that the
untouched file still works. (The fine-tune run directory: test_untrusted_run_dir.py; study units:
test_study_untrusted.py; eval has no --resume.)"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the demo's run of 2026-12-03 (its numbers are quoted below)
DEMO = json.loads((REPO / "tests" / "data" / "demo-results-2026-12-03.json").read_text())
needs_posix = pytest.mark.skipif(not hasattr(os, "getuid"), reason="owners and modes are POSIX")


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("normswap: error:")]
    assert len(lines) == 1, err
    return lines[0]


# --------------------------------------------------------------------- eval render: the schema
TAMPERED = {
    "a model that is a string": (lambda r: r["models"].__setitem__(0, "x"), "models[0] is 'x'; expected an object"),
    "speeds that are a string": (
        lambda r: r["models"][0].__setitem__("tokens_per_second", "fast"),
        "models[0].tokens_per_second is 'fast'; expected an object",
    ),
    "a model without a name": (lambda r: r["models"][0].pop("name"), "models[0].name is missing; expected a str"),
    "a NaN perplexity": (
        lambda r: r["models"][0].__setitem__("perplexity", float("nan")),
        "models[0].perplexity is nan; expected a number (not NaN)",
    ),
    "ratios that are a list": (lambda r: r["models"][1].__setitem__("ratios", [1]), "models[1].ratios is a list"),
    "data that is a string": (lambda r: r.__setitem__("data", "x"), "data is 'x'; expected an object"),
    "models that are an object": (lambda r: r.__setitem__("models", {}), "models is an object; expected a list"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_render_of_a_wrongly_typed_results_json_is_a_schema_refusal(tmp_path, run_cli, case):
    tamper, said = TAMPERED[case]
    results = copy.deepcopy(DEMO)
    tamper(results)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    code, _, err = run_cli("eval", "render", path)
    line = _one_error_line(err)
    assert code != 0 and str(path) in line and "results.json schema" in line and said in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # nothing rendered


def test_render_of_the_untouched_results_json_and_of_an_infinite_perplexity_works(tmp_path, run_cli):
    """The control: the demo's own results.json renders; so does an infinite perplexity (text the
    model cannot predict; the table holds it, the chart leaves it out), which is not NaN."""
    from normswap.report.schema import schema_problem

    assert schema_problem(DEMO) is None
    results = copy.deepcopy(DEMO)
    results["models"][0]["perplexity"] = float("inf")
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    code, _, err = run_cli("eval", "render", path)
    assert code == 0, err
    assert (tmp_path / "report.html").is_file() and (tmp_path / "perplexity.png").is_file()


def test_render_of_a_norm_timing_with_a_zero_speed_ratio_reads_no_interval(tmp_path, run_cli):
    """The time-in-norms interval is the stored speed ratio turned over; a file whose stored intervals
    are gone and whose speed ratio reads 0 (edited by hand) renders without that interval rather than
    dividing by zero. Control: the same file with its ratio intact shows the interval."""
    results = copy.deepcopy(DEMO)
    for m in results["models"]:
        m["ratio_intervals"] = None
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert run_cli("eval", "render", path)[0] == 0
    assert "×0.41 [0.40–0.42]" in (tmp_path / "report.md").read_text()  # recomputed from the paired ratios
    results["models"][1]["speed_setup"]["paired"]["norms"]["low"] = 0
    path.write_text(json.dumps(results))
    code, _, err = run_cli("eval", "render", path)
    assert code == 0, err
    assert "exact: 0.26 ms" in (tmp_path / "report.md").read_text()


# --------------------------------------------------------------------- the kernel choice cache
@needs_posix
def test_a_kernel_cache_table_of_another_user_is_never_read(tmp_path, monkeypatch):
    """Round 2 covers a loose directory, a loose file and a linked file; here the table belongs to
    another user (root gives it away), and the cache directory is a link to another user's
    directory. Control: the same table, ours, is read."""
    if os.geteuid() != 0:
        pytest.skip("giving a file away needs root")
    from normswap.kernels import autotune
    from normswap.testing import forget_kernel_choices

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("NORMSWAP_CACHE_DIR", str(cache))
    monkeypatch.setattr(autotune, "_machine_id", lambda: "this machine")
    key = ("cpu", "float32", 64, "16", False, True, False)
    entry = dict(zip(autotune.KEY_FIELDS, key), ranking=["composite"], measured=True)
    (cache / "autotune.json").write_text(
        json.dumps({"version": autotune.FILE_VERSION, "machines": {"this machine": [entry]}})
    )

    def read():
        forget_kernel_choices()
        try:
            autotune._load_disk()
            return autotune._memory.get(key)
        finally:
            forget_kernel_choices()

    assert read() == ["composite"]  # the control
    os.chown(cache / "autotune.json", 4242, 4242)
    assert read() is None
    os.chown(cache / "autotune.json", 0, 0)
    theirs = tmp_path / "theirs"
    cache.rename(theirs)
    os.chown(theirs, 4242, 4242)
    cache.symlink_to(theirs)
    assert read() is None


# --------------------------------------------------------------------- a recipe run's DIR
RECIPE = """\
name: tiny
source: normswap:kjv-gpt2
device: cpu
variants:
  exact: {convert: {mode: exact}}
eval: {seq_len: 64, stride: 32, max_tokens: 256, speed: false, diagnostics: false}
report: {title: tiny}
"""


def _run_dir(tmp_path) -> Path:
    """What a finished recipe run leaves (its shape, not its numbers: the check reads no values)."""
    out = tmp_path / "run"
    (out / "models" / "exact").mkdir(parents=True)
    (out / "report").mkdir()
    (out / "run.json").write_text(json.dumps({"status": "finished", "steps": {}}))
    (out / "models" / "exact" / "model.safetensors").write_bytes(b"weights")
    (out / "models" / "exact" / "normswap_manifest.json").write_text("{}")
    (out / "report" / "results.json").write_text("{}")
    return out


PLANTS = {
    "a linked model": lambda out, there: _swap_for_link(out / "models" / "exact", there),
    "linked weights": lambda out, there: _swap_for_link(out / "models" / "exact" / "model.safetensors", there),
    "a linked report": lambda out, there: _swap_for_link(out / "report", there),
    "a run.json others can write": lambda out, there: os.chmod(out / "run.json", 0o666),
    "a model others can write": lambda out, there: os.chmod(out / "models" / "exact", 0o777),
}


def _swap_for_link(path: Path, there: Path) -> None:
    path.rename(there)
    path.symlink_to(there)


@needs_posix
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_recipe_run_never_reads_back_a_link_or_another_users_file(tmp_path, run_cli, plant):
    """--resume skips a step found done and reads its output: a model linked in from elsewhere would
    be evaluated and reported as the run's own. Refused before any step, in one line naming it."""
    from normswap.recipes.steps import run_dir_problem

    out = _run_dir(tmp_path)
    assert run_dir_problem(out) is None  # the control: the untouched DIR passes
    PLANTS[plant](out, tmp_path / "elsewhere")
    why = run_dir_problem(out)
    assert why and ("symbolic link" in why or "writable by other users" in why), why
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(RECIPE)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    code, _, err = run_cli("run", recipe, "--out", out, "--resume")
    line = _one_error_line(err)
    assert code != 0 and why in line, line
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
