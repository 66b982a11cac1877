"""A study's DIR, its recorded options and its counts are untrusted input (issue #29, cases 7, 10, 13):
counts have upper bounds wherever they come from (command line, recipe, resumed study_run.json), a
resumed run file is validated like the command line, DIR must be the user's alone, and nothing
written into DIR follows a planted link. Each refusal has a control: the ordinary study runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from normswap.errors import NormswapError

REPO = Path(__file__).resolve().parents[1]
TINY = dict(
    model_type="gpt2",
    n_layer=1,
    n_embd=16,
    n_head=2,
    n_positions=32,
    vocab_size=4096,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
COMMON = dict(seq_len=16, batch_size=2, eval_tokens=64, eval_every=0, warmup=0, progress=False, device="cpu", threads=1)
COMMON.update(max_seeds=1, budget=0, lm_eval_tasks=["none"], workers=1, speed_seconds=0)  # one seed, no lm-eval
OPTS = dict(arms=["layernorm"], steps=3, seeds=1)  # step 3 is the first profiled one (study/measuring/measure.py)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _study(model, out, **opts):
    from normswap.study.config import StudyConfig
    from normswap.study.runner import run_study

    cfg = StudyConfig(model=str(model), out=str(out), **{**COMMON, **OPTS, **opts})
    return run_study(cfg, echo=lambda m: None)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """(config path, DIR of a finished one-unit study): copied by each test that edits it."""
    root = tmp_path_factory.mktemp("study")
    config = root / "tiny.json"
    config.write_text(json.dumps(TINY))
    out = root / "done"
    _study(config, out)
    return config, out


def _copy(finished, tmp_path) -> Path:
    out = tmp_path / "dir"
    shutil.copytree(finished[1], out, symlinks=True)
    os.chmod(out, 0o700)
    return out


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


# -- case 10: counts have upper bounds --------------------------------------------------------------


def test_counts_have_upper_bounds_from_every_entry_point(tmp_path, finished):
    from normswap.study.config import MAX_SEEDS, option_errors

    # declared once: the bound is refused before anything is listed or built (checked first, so that
    # an unbounded implementation fails here instead of allocating)
    hostile = dict(seeds=10**8, steps=10**12, threads=10**6, eval_tokens=10**12, batch_size=10**9, seq_len=10**9)
    named = {name for name, _ in option_errors(hostile)}
    assert named == set(hostile), named
    sweep = ",".join(str(1 + i / 1000) for i in range(10_000))
    assert [n for n, _ in option_errors({"lr_sweep": sweep})] == ["lr_sweep"]
    assert option_errors({"seeds": MAX_SEEDS, "lr_sweep": "0.5,1,2"}) == []  # control: the largest allowed
    # run_study (the command line's path): one line, DIR untouched
    with pytest.raises(NormswapError, match=r"--seeds must be <= 1,?000, got 100000000"):
        _study(finished[0], tmp_path / "a", seeds=10**8)
    assert not (tmp_path / "a").exists()
    # a resumed study_run.json that says seeds: 1e8
    out = _copy(finished, tmp_path)
    run = json.loads((out / "study_run.json").read_text())
    run["config"]["seeds"] = 10**8
    (out / "study_run.json").write_text(json.dumps(run))
    with pytest.raises(NormswapError, match=r"study_run.json records --seeds must be <="):
        _study(finished[0], out, resume=True)


def test_recipe_seeds_bound_is_checked_by_run_check(tmp_path):
    recipe = tmp_path / "r.yaml"
    text = (
        "name: t\nsource: normswap:kjv-gpt2\nvariants:\n  exact: {{convert: {{mode: exact}}}}\n"
        "study: {{seeds: {seeds}, steps: 2}}\n"
    )
    recipe.write_text(text.format(seeds=10**8))
    limit = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
        "from normswap.cli.main import main; main(sys.argv[1:])"
    )
    cmd = [sys.executable, "-c", limit, "run", str(recipe), "--check"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "seeds" in lines[0] and "<=" in lines[0], proc.stderr[-800:]
    recipe.write_text(text.format(seeds=2))  # control: a sane count passes the check
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-800:]


# -- case 13: resumed options are validated like the command line -----------------------------------


@pytest.mark.parametrize(
    "key,value,flag",
    [
        ("batch_size", 0, "--batch-size must be >= 1"),
        ("lr", -1, "--lr must be > 0"),
        ("steps", 0, "--steps must be >= 1"),
        ("precision", "fp64", "--precision must be one of fp32, bf16, fp16, got 'fp64'"),
        ("kernels", "evil", "--kernels must be one of"),
        ("arms", 5, "--arms must be a list of strings, got 5"),
        ("seq_len", "64", "--seq-len must be a whole number, got '64'"),
    ],
)
def test_resumed_options_are_validated_like_the_command_line(tmp_path, finished, key, value, flag):
    out = _copy(finished, tmp_path)
    run = json.loads((out / "study_run.json").read_text())
    run["config"][key] = value
    (out / "study_run.json").write_text(json.dumps(run))
    before = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(NormswapError) as e:
        _study(finished[0], out, resume=True)
    msg = str(e.value)
    assert "study_run.json" in msg and flag in msg and f"got {value!r}" in msg and "\n" not in msg, msg
    assert sorted(p.name for p in out.rglob("*")) == before


def test_resume_of_an_untouched_study_still_works(tmp_path, finished):
    out = _copy(finished, tmp_path)
    unit = next((out / "units").iterdir())
    kept = unit.read_bytes()
    res = _study(finished[0], out, resume=True)
    assert [u["status"] for u in res["units"]] == ["finished"] and unit.read_bytes() == kept


def test_resumed_bad_option_is_one_line_from_the_command(tmp_path, finished):
    out = _copy(finished, tmp_path)
    run = json.loads((out / "study_run.json").read_text())
    run["config"]["precision"] = "fp64"
    (out / "study_run.json").write_text(json.dumps(run))
    proc = subprocess.run(
        [sys.executable, "-m", "normswap", "study", str(finished[0]), "--out", str(out), "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "--precision must be one of" in lines[0], proc.stderr[-800:]
    assert "Traceback" not in proc.stderr


# -- case 7: DIR is the user's alone; writes never follow a planted link ---------------------------


def test_dir_writable_by_others_or_owned_by_another_user_is_refused(tmp_path, finished):
    shared = tmp_path / "scratch-study"
    shared.mkdir()
    os.chmod(shared, 0o777)  # a pre-created world-writable DIR: another user could plant links in it
    with pytest.raises(NormswapError, match=r"writable by other users \(mode 0o777\)"):
        _study(finished[0], shared)
    assert list(shared.iterdir()) == []
    if os.getuid() == 0:  # as root, stand in for the other user by giving the directory away
        os.chmod(shared, 0o755)
        os.chown(shared, 12345, 12345)
        with pytest.raises(NormswapError, match="belongs to uid 12345, not to you"):
            _study(finished[0], shared)
        os.chown(shared, 0, 0)
    os.chmod(shared, 0o700)  # control: the same directory, private, takes the study
    res = _study(finished[0], shared)
    assert (shared / "results.json").is_file() and res["units"][0]["status"] == "finished"


def test_resume_replaces_planted_links_and_never_writes_through_them(tmp_path, finished):
    out = _copy(finished, tmp_path)
    victim = tmp_path / "bashrc"
    victim.write_text("export PATH=$HOME/bin:$PATH\n")
    figures = [p.name for p in out.glob("*.png")]
    assert "curves.png" in figures
    for name in figures + ["report.md", "report.html", "results.json"]:
        (out / name).unlink()
        (out / name).symlink_to(victim)  # each of the study's outputs, a link to the user's file
    (out / "units" / "seed0-x1-layernorm.json").unlink()  # the unit runs again and is written
    _study(finished[0], out, resume=True)
    assert victim.read_text() == "export PATH=$HOME/bin:$PATH\n"  # untouched
    for name in figures + ["report.md", "report.html", "results.json", "units/seed0-x1-layernorm.json"]:
        assert (out / name).is_file() and not (out / name).is_symlink(), name  # replaced by the real output


def test_planted_unit_link_to_a_device_is_refused_not_read(tmp_path, finished):
    out = _copy(finished, tmp_path)
    unit = out / "units" / "seed0-x1-layernorm.json"
    unit.unlink()
    unit.symlink_to("/dev/zero")
    with pytest.raises(NormswapError, match=r"seed0-x1-layernorm.json is a symbolic link \(to /dev/zero\)"):
        _study(finished[0], out, resume=True)
    fifo_dir = _copy(finished, tmp_path / "b")
    (fifo_dir / "units" / "seed0-x1-layernorm.json").unlink()
    os.mkfifo(fifo_dir / "units" / "seed0-x1-layernorm.json")
    with pytest.raises(NormswapError, match=r"is a FIFO \(named pipe\)"):
        _study(finished[0], fifo_dir, resume=True)


def test_a_unit_another_user_could_have_written_is_refused_in_one_line(tmp_path, finished):
    """A unit file writable by group or others (anyone could have planted its numbers) is refused on
    --resume, naming the file and why; the same unit made private again resumes (the control)."""
    out = _copy(finished, tmp_path)
    unit = out / "units" / "seed0-x1-layernorm.json"
    os.chmod(unit, 0o666)
    with pytest.raises(
        NormswapError, match=r"refusing a study's unit file .*seed0-x1-layernorm.json: .*writable by other"
    ):
        _study(finished[0], out, resume=True)
    os.chmod(unit, 0o600)
    res = _study(finished[0], out, resume=True)
    assert res["units"] and res["units"][0]["arm"] == "layernorm"
