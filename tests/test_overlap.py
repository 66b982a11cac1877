"""One overlap rule (normswap/overlap.py) for every command: what it writes or deletes never touches
what it reads - models, teachers, data, recipes, family files - and a refusal comes before any work.

Each case of issue #22 that this covers (3: `run --force` and a source inside --out; 4: `--force`
next to the user's corpus; 6: `finetune M M/ft`) is run through the real CLI with its unsafe
variant (refused in one line, every input byte-identical, nothing created) and its safe variant
(the same command with the input moved aside works).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from normswap.assets.models import model_path
from normswap.overlap import check_disjoint, overlaps

FT_FAST = [
    "--steps",
    "1",
    "--seq-len",
    "32",
    "--batch-size",
    "2",
    "--eval-tokens",
    "64",
    "--warmup-steps",
    "0",
    "--no-progress",
]
EVAL_FAST = ["--seq-len", "32", "--max-tokens", "256", "--no-speed", "--no-memory", "--no-diagnostics", "--quiet"]


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _refused(code, err, *needles):
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.startswith("normswap: error:")]
    assert len(lines) == 1, err
    for needle in ("which this command reads", *needles):
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def model(tmp_path):
    """A private copy of the shipped kjv-gpt2 (a real trained GPT-2 with its tokenizer)."""
    path = tmp_path / "M"
    shutil.copytree(model_path("kjv-gpt2"), path)
    return path


@pytest.fixture
def corpus(tmp_path):
    from normswap.data import load_text

    path = tmp_path / "corpus.txt"
    path.write_text(load_text("embedded", "validation")[:40_000])
    return path


# ------------------------------------------------------------------------------ the rule
def test_rule_is_symmetric_and_sees_through_symlinks(tmp_path):
    d = tmp_path / "D"
    (d / "sub").mkdir(parents=True)
    (d / "corpus.txt").write_text("x")
    assert (
        overlaps(d, d) and overlaps(d, d / "corpus.txt") and overlaps(d / "sub" / "new", d)
    )  # equal, contains, inside
    assert not overlaps(d / "sub", d / "corpus.txt") and not overlaps(tmp_path / "E", d)  # siblings: negative control
    link = tmp_path / "link.txt"
    link.symlink_to(d / "corpus.txt")  # the data, reached through a symlink outside D
    assert overlaps(d, link)
    dlink = tmp_path / "Dlink"
    dlink.symlink_to(d)  # OUT spelled through a symlink to D
    assert overlaps(dlink / "sub", d / "corpus.txt") is False and overlaps(dlink, d / "corpus.txt")
    inside = d / "inside-link"
    inside.symlink_to(tmp_path / "elsewhere.txt")  # a symlink *named* inside OUT goes with OUT
    (tmp_path / "elsewhere.txt").write_text("y")
    assert overlaps(d, inside)
    with pytest.raises(Exception, match=r"OUT D overlaps the data .*which this command reads"):
        check_disjoint([("the data", link), ("the data", "embedded"), ("the model", "no/such/hub-id")], [("OUT D", d)])
    check_disjoint(
        [("the data", "embedded"), ("the model", tmp_path / "missing")], [("OUT D", d)]
    )  # nothing local: fine


# ------------------------------------------------------------------------------ case 6
def test_finetune_into_the_model_is_refused_before_training(tmp_path, model, run_cli):
    before = _tree_hash(model)
    code, _, err = run_cli("finetune", model, model / "ft", *FT_FAST)
    _refused(code, err, "the model")
    assert "held-out loss" not in err and _tree_hash(model) == before and not (model / "ft").exists()
    # the safe variant: the same fine-tune beside the model
    code, _, err = run_cli("finetune", model, tmp_path / "ft", *FT_FAST)
    assert code == 0, err
    assert (tmp_path / "ft" / "config.json").is_file() and _tree_hash(model) == before

    # --resume of a run that lies inside its model: refused before it trains again
    run = json.loads((tmp_path / "ft" / "finetune_run.json").read_text())
    (tmp_path / "ft" / "finetune_run.json").write_text(json.dumps(dict(run, status="running")))
    shutil.move(tmp_path / "ft", model / "ft")
    before = _tree_hash(model)
    code, _, err = run_cli("finetune", model / "ft", "--resume", "--no-progress")
    _refused(code, err, "the model")
    assert _tree_hash(model) == before  # the log was not cut, no step was trained again


# ------------------------------------------------------------------------------ case 4
def test_finetune_force_never_replaces_a_directory_holding_its_data(tmp_path, model, corpus, run_cli):
    out = tmp_path / "D"
    out.mkdir()
    shutil.copy(corpus, out / "corpus.txt")
    before = _tree_hash(out)
    for data_flag in ("--data", "--eval-data"):
        code, _, err = run_cli("finetune", model, out, "--force", data_flag, out / "corpus.txt", *FT_FAST)
        _refused(code, err, "the data" if data_flag == "--data" else "the held-out data")
        assert _tree_hash(out) == before
    # the safe variant: the data beside OUT
    code, _, err = run_cli("finetune", model, out, "--force", "--data", corpus, *FT_FAST)
    assert code == 0, err
    assert (out / "config.json").is_file() and not (out / "corpus.txt").exists()


def test_eval_report_force_never_replaces_a_directory_holding_its_data(tmp_path, model, corpus, run_cli):
    out = tmp_path / "D"
    out.mkdir()
    shutil.copy(corpus, out / "corpus.txt")
    before = _tree_hash(out)
    code, _, err = run_cli("eval", "report", model, "--out", out, "--force", "--data", out / "corpus.txt", *EVAL_FAST)
    _refused(code, err, "the data")
    assert _tree_hash(out) == before
    code, _, err = run_cli("eval", "report", model, "--out", out, "--force", "--data", corpus, *EVAL_FAST)
    assert code == 0, err
    assert (out / "results.json").is_file() and not (out / "corpus.txt").exists()


def test_convert_force_never_replaces_a_directory_holding_its_family_file(tmp_path, model, run_cli):
    import normswap.architectures

    out = tmp_path / "D"
    out.mkdir()
    fam = out / "gpt2.yaml"
    shutil.copy(Path(normswap.architectures.__file__).parent / "data" / "gpt2.yaml", fam)
    before = _tree_hash(out)
    code, _, err = run_cli("convert", model, out, "--force", "--family-file", fam)
    _refused(code, err, "the family file")
    assert _tree_hash(out) == before
    assert not list(tmp_path.glob(".D.normswap*"))  # refused before the lock file was made


# ------------------------------------------------------------------------------ case 3
RECIPE = """\
name: tiny
source: normswap:kjv-gpt2
variants:
  exact: {convert: {mode: exact, verify: false}}
eval: {seq_len: 32, max_tokens: 128, speed: false, memory: false, diagnostics: false}
"""


def test_run_force_never_deletes_a_source_inside_out(tmp_path, run_cli):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(RECIPE)
    out = tmp_path / "run"
    code, _, err = run_cli("run", recipe, "--out", out)
    assert code == 0, err
    # the next run's source lies in the previous run's models/ (which --force clears)
    src = out / "models" / "src"
    shutil.copytree(model_path("kjv-gpt2"), src)
    before = _tree_hash(src)
    code, _, err = run_cli("run", recipe, "--out", out, "--force", "--set", f"source={src}")
    _refused(code, err, "the source model", "models")
    assert _tree_hash(src) == before and (out / "run.json").is_file()
    # the safe variant: the source elsewhere in DIR, which the run never writes
    shutil.copytree(src, out / "mine")
    code, _, err = run_cli("run", recipe, "--out", out, "--force", "--set", f"source={out / 'mine'}")
    assert code == 0, err
    assert _tree_hash(out / "mine") == before
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    # the recipe file is read too: a run never writes over it
    shutil.copy(recipe, out / "recipe.yaml")
    code, _, err = run_cli("run", out / "recipe.yaml", "--out", out, "--force")
    _refused(code, err, "the recipe")


# ------------------------------------------------------------------------------ issue #29, case 6
def test_dotdot_after_a_symlink_is_where_the_os_goes(tmp_path):
    """``work/ln/../src`` with ``work/ln -> models/sub`` is ``models/src`` (the OS resolves the link, then
    ``..``); comparing ``abspath`` forms made it ``work/src`` and let OUT replace the model."""
    src = tmp_path / "models" / "src"
    (tmp_path / "models" / "sub").mkdir(parents=True)
    src.mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "ln").symlink_to(tmp_path / "models" / "sub")
    sneaky = tmp_path / "work" / "ln" / ".." / "src"
    assert os.path.samefile(sneaky, src)  # what the OS writes to
    assert overlaps(sneaky, src) and overlaps(src, sneaky) and overlaps(sneaky / "x", src)
    assert overlaps(tmp_path / "work" / "ln" / "..", src)  # a path ending in .. is its resolved self
    # the control: the same spelling without the symlink names another directory
    (tmp_path / "work" / "plain").mkdir()
    assert not overlaps(tmp_path / "work" / "plain" / ".." / "src", src)


def test_convert_and_export_refuse_out_that_reaches_the_model_through_a_symlink_and_dotdot(tmp_path, run_cli):
    models = tmp_path / "models"
    (models / "sub").mkdir(parents=True)
    src = models / "src"
    shutil.copytree(model_path("kjv-gpt2"), src)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "ln").symlink_to(models / "sub")
    before = _tree_hash(src)
    sneaky = f"{tmp_path}/work/ln/../src"
    code, _, err = run_cli("convert", src, sneaky, "--force")
    _refused(code, err, "the model")
    code, _, err = run_cli("export", src, sneaky, "--format", "stock", "--force")
    assert code == 2 and "overlaps" in err and "Traceback" not in err, err
    assert _tree_hash(src) == before
    # the control: the same spelling through a plain directory names work/out, which is free to write
    from normswap.publish import check_output_path

    (tmp_path / "work" / "plain").mkdir()
    check_output_path(f"{tmp_path}/work/plain/../out", force=True, reads=[("the model", src)])
