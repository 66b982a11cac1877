"""Commands that write a directory, under kills, concurrency and hostile OUT paths (real CLI, real models).

Kills land at several stages of a real `normswap convert` (lock taken, staging created, weights
written, verification done), with SIGKILL and SIGTERM, fresh and with --force over an existing OUT.
The child stops itself at each stage (tests/paused_cli.py) and is killed there: no polling race.
"""

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import paused_cli
import pytest
from helpers import checked_run, tiny_model

from normswap import publish
from normswap.checkpoint.shards import SINGLE_NAME

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "gpt2"
    tiny_model("gpt2", n_layer=4, n_embd=128, vocab_size=2048).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def old_out(tmp_path_factory, src):
    """A complete earlier conversion (approx mode), to be replaced with --force."""
    from normswap.convert.pipeline import convert_checkpoint

    path = tmp_path_factory.mktemp("old") / "out"
    convert_checkpoint(str(src), path, mode="approx", verify=False)
    return path


def _staging(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}{publish.STAGING_TAG}*"))


STAGES = {  # stage -> glob pattern of what exists once the stage is reached ({pid}: the converting process)
    "lock taken": lambda out: f"{paused_cli.escape_dir(out.parent)}/.{out.name}{publish.LOCK_SUFFIX}",
    "staging created": lambda out: f"{paused_cli.escape_dir(out.parent)}/.{out.name}{publish.STAGING_TAG}{{pid}}-*",
    "weights written": lambda out: (
        f"{paused_cli.escape_dir(out.parent)}/.{out.name}{publish.STAGING_TAG}{{pid}}-*/{SINGLE_NAME}"
    ),
    "verified": lambda out: (
        f"{paused_cli.escape_dir(out.parent)}/.{out.name}{publish.STAGING_TAG}{{pid}}-*/normswap_manifest.json"
    ),
}


def _kind(out: Path, old_hash=None):
    """None (absent), 'old' (untouched), or 'new' (a complete, verified conversion)."""
    if not out.exists():
        return None
    if old_hash is not None and _tree_hash(out) == old_hash:
        return "old"
    manifest = json.loads((out / "normswap_manifest.json").read_text())
    assert manifest["conversion"]["mode"] == "exact" and manifest["verification"]["passed"] is True
    from safetensors.torch import load_file

    assert load_file(out / SINGLE_NAME)
    return "new"


# (fresh or --force over an earlier conversion, signal, stage): five stages, both signals, both modes
KILLS = [
    (False, signal.SIGKILL, "lock taken"),
    (False, signal.SIGTERM, "staging created"),
    (False, signal.SIGKILL, "weights written"),
    (True, signal.SIGTERM, "weights written"),
    (True, signal.SIGKILL, "verified"),
]


def test_convert_killed_at_each_stage_leaves_one_complete_out(tmp_path, src, old_out):
    import shutil

    for i, (force, sig, stage) in enumerate(KILLS):
        out = tmp_path / f"run{i}" / "out"
        out.parent.mkdir()
        old_hash = None
        if force:
            shutil.copytree(old_out, out)
            old_hash = _tree_hash(out)
        proc = paused_cli.start(
            STAGES[stage](out),
            "convert",
            src,
            out,
            "--mode",
            "exact",
            *(["--force"] if force else []),
            env={"OMP_NUM_THREADS": "1"},
        )
        assert paused_cli.wait_paused(proc), (stage, proc.communicate(timeout=120)[1][-2000:])
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
        state = _kind(out, old_hash)
        assert state in (("old", "new") if force else (None, "new")), (stage, err)
        leftovers = sorted(p.name for p in out.parent.iterdir() if p.name != "out")
        if sig == signal.SIGTERM:
            # SIGTERM unwinds: the staging directory and the lock go with the process
            assert leftovers == [], (stage, leftovers)
        # the next run removes whatever is left, says so in one line, and leaves OUT as it was
        said = []
        with publish.output_lock(out, say=said.append):
            pass
        assert sorted(p.name for p in out.parent.iterdir()) == (["out"] if state else [])
        assert _kind(out, old_hash) == state
        had_staging = any(publish.STAGING_TAG in name for name in leftovers)
        assert len(said) == (1 if had_staging else 0), (stage, said, leftovers)


def test_killed_convert_then_two_concurrent_converts(tmp_path, src):
    """A SIGKILLed convert leaves staging; the next convert removes it and says so in one line
    while it holds OUT's lock; a third started meanwhile is refused, naming the second."""
    out = tmp_path / "out"
    killed = paused_cli.start(
        STAGES["weights written"](out), "convert", src, out, "--no-verify", env={"OMP_NUM_THREADS": "1"}
    )
    assert paused_cli.wait_paused(killed), killed.communicate(timeout=120)[1][-2000:]
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    assert _staging(out), "the kill did not land while staging"

    # the second convert cleans up, then stops itself once its own staging exists, holding OUT's lock
    first = paused_cli.start(
        STAGES["staging created"](out), "convert", src, out, "--no-verify", env={"OMP_NUM_THREADS": "1"}
    )
    try:
        assert paused_cli.wait_paused(first), first.communicate(timeout=120)[1][-2000:]
        assert [p.name for p in _staging(out)] == [
            p.name for p in _staging(out) if f"{publish.STAGING_TAG}{first.pid}-" in p.name
        ]
        second = checked_run(
            [sys.executable, "-m", "normswap", "convert", str(src), str(out), "--force"],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        paused_cli.resume(first)
    _, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err
    cleaned = [line for line in first_err.splitlines() if "cleaned up after stopped process" in line]
    assert len(cleaned) == 1 and str(killed.pid) in cleaned[0], first_err
    assert second.returncode == 2
    lines = second.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and "in use by" in lines[0]
        and f"pid {first.pid}" in lines[0]
        and "normswap convert" in lines[0]
    )
    assert json.loads((out / "normswap_manifest.json").read_text())["conversion"]["mode"] == "exact"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_dangling_symlink_out_is_refused_before_any_work(tmp_path, src, run_cli, monkeypatch):
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "gone")

    def convert_checkpoint(*a, **k):
        raise AssertionError("the conversion started although OUT was refused")

    monkeypatch.setattr("normswap.convert.pipeline.convert_checkpoint", convert_checkpoint)  # refused up front
    code, _, err = run_cli("convert", src, out)
    assert code == 2 and "Traceback" not in err and "conversion started" not in err, err
    lines = [line for line in err.strip().splitlines() if line.startswith("normswap: error:")]
    assert len(lines) == 1 and "symlink" in lines[0] and "does not exist" in lines[0]
    assert out.is_symlink() and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("where", ["model itself", "inside the model", "contains the model"])
def test_eval_report_never_writes_over_an_evaluated_model(tmp_path, src, run_cli, where):
    import shutil

    model = tmp_path / "models" / "m"
    shutil.copytree(src, model)
    before = _tree_hash(tmp_path / "models")
    out = {"model itself": model, "inside the model": model / "report", "contains the model": tmp_path / "models"}[
        where
    ]
    code, _, err = run_cli("eval", "report", f"a={model}", f"b={model}", "--out", out, "--force", "--quiet")
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.startswith("normswap: error:")]
    assert len(lines) == 1 and "which this command reads" in lines[0], err
    assert _tree_hash(tmp_path / "models") == before
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m"]


def test_two_finetunes_into_one_out(tmp_path, run_cli):
    out = tmp_path / "run"
    args = [
        "finetune",
        "normswap:kjv-gpt2",
        str(out),
        "--steps",
        "3",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--eval-tokens",
        "256",
        "--save-every",
        "1000",
        "--no-progress",
    ]
    # the first run stops itself once it is training (its log exists), holding OUT's lock
    first = paused_cli.start(f"{paused_cli.escape_dir(out)}/train_log.jsonl", *args, env={"OMP_NUM_THREADS": "1"})
    try:
        assert paused_cli.wait_paused(first), first.communicate(timeout=120)[1][-2000:]
        code, _, err = run_cli(*args, "--force")
        lines = [line for line in err.strip().splitlines() if line.startswith("normswap: error:")]
        assert code == 2 and len(lines) == 1, err
        assert f"pid {first.pid}" in lines[0] and "normswap finetune" in lines[0]
        assert first.poll() is None  # the refused run neither stopped nor disturbed the first
        assert json.loads((out / "finetune_run.json").read_text())["status"] == "running"
        paused_cli.resume(first)
        _, first_err = first.communicate(timeout=600)
        assert first.returncode == 0, first_err[-2000:]  # ...and it finishes as if nothing happened
        assert json.loads((out / "finetune_run.json").read_text())["status"] == "finished"
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
