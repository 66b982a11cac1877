"""A fine-tune's run directory is untrusted input when it is read back (issue #39, round 4).

`--resume` reads OUT/checkpoints/step-K/* (weights, optimizer, random state, trainer state), the log
and the run record. Each test plants what an attacker (or a careless copy) could leave there: a link
out of OUT, a file or directory another user can write, another user's file, a tampered optimizer
state. Each refusal is one line naming the path and why; nothing outside OUT is deleted or
written; the published model never carries weights from outside OUT. The control: an untouched
stopped run resumes bit for bit the uninterrupted one, and a planted *regular* file (what the checks
let through) is loaded — so the test sees the difference.

All runs: the shipped 5 MB kjv-gpt2, 4 steps of 2 x 32 tokens (a few seconds each).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

MODEL = "normswap:kjv-gpt2"
SMALL = dict(data="embedded", seq_len=32, batch_size=2, eval_tokens=256, progress=False, device="cpu", seed=3)
CLI_SMALL = ["--device", "cpu", "--no-progress"]
PLANTED = 0.0123
BIAS = "transformer.h.0.attn.c_proj.bias"
OTHER_UID = 4242
needs_posix = pytest.mark.skipif(not hasattr(os, "getuid"), reason="owners and modes are POSIX")
needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving files away needs root")


class _Stop(Exception):
    pass


def _run(out, *, echo=None, hooks=None, **kw):
    from normswap.finetune import FinetuneConfig, run_finetune

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: one thread is faster than two fighting ones
    try:
        return run_finetune(FinetuneConfig(model=MODEL, out=str(out), **{**SMALL, **kw}), hooks=hooks, echo=echo)
    finally:
        torch.set_num_threads(threads)


def _final(out) -> dict:
    from safetensors.torch import load_file

    return load_file(Path(out) / "model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the uninterrupted 4-step run, the same run stopped after its step-2 checkpoint): each test
    copies the stopped one."""
    from normswap.testing import FinetuneHooks

    root = tmp_path_factory.mktemp("rundir")
    straight = root / "straight"
    _run(straight, steps=4, save_every=1, keep_checkpoints=0)

    def stop(step):
        if step == 2:
            raise _Stop

    stopped = root / "stopped"
    with pytest.raises(_Stop):
        _run(stopped, steps=4, save_every=1, keep_checkpoints=0, hooks=FinetuneHooks(after_step=stop))
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == ["step-1", "step-2"]
    return straight, stopped


@pytest.fixture
def out(runs, tmp_path):
    dest = tmp_path / "OUT"
    shutil.copytree(runs[1], dest, symlinks=True)
    return dest


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("normswap: error:")]
    assert len(lines) == 1, err
    return lines[0]


def _resume_cli(run_cli, out, *extra):
    return run_cli("finetune", MODEL, out, "--resume", "--steps", "4", *CLI_SMALL, *extra)


# ------------------------------------------------------------------------------- the control
def test_an_untouched_stopped_run_resumes_bit_for_bit(runs, out):
    straight, _ = runs
    said = []
    s = _run(out, resume=True, steps=4, echo=said.append)
    assert s["resumed_from_step"] == 2, said
    a, b = _final(straight), _final(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # negative control: resumed from the older checkpoint's weights with the newer one's state, it differs
    other = out.parent / "other"
    shutil.copytree(straight.parent / "stopped", other, symlinks=True)
    shutil.copy(other / "checkpoints/step-1/model.safetensors", other / "checkpoints/step-2/model.safetensors")
    _run(other, resume=True, steps=4, echo=lambda m: None)
    c = _final(other)
    assert not all(torch.equal(a[k], c[k]) for k in a)


# ------------------------------------------------------------------------------- case 1
def test_a_linked_checkpoints_dir_is_refused_and_nothing_outside_out_changes(out, tmp_path, run_cli):
    """Issue #39 case 1: OUT/checkpoints -> a directory holding step-1/ and .tmp-keep/; resuming with
    --save-every 1 --keep-checkpoints 1 deleted both there and wrote step-4/ there."""
    elsewhere = tmp_path / "elsewhere"
    shutil.move(out / "checkpoints", elsewhere)
    shutil.rmtree(elsewhere / "step-2")
    (elsewhere / ".tmp-keep").mkdir()
    (elsewhere / ".tmp-keep" / "precious").write_text("keep me")
    (out / "checkpoints").symlink_to(elsewhere)
    before = _snapshot(elsewhere)
    code, _, err = _resume_cli(run_cli, out, "--save-every", "1", "--keep-checkpoints", "1")
    line = _error_line(err)
    assert code != 0 and str(out / "checkpoints") in line and "symbolic link" in line and str(elsewhere) in line
    assert _snapshot(elsewhere) == before  # nothing deleted, nothing written there
    assert not (out / "config.json").exists()


def test_rotation_removes_only_the_checkpoints_this_run_made(out, tmp_path, run_cli):
    """The control of case 1 with planted names inside a real checkpoints/: .tmp-keep/ (not a name
    normswap makes) survives, a step-0 link is removed as a link (its target untouched), the oldest
    real checkpoints go."""
    ck = out / "checkpoints"
    (ck / ".tmp-keep").mkdir()
    (ck / ".tmp-keep" / "precious").write_text("keep me")
    target = tmp_path / "target"
    target.mkdir()
    (target / "precious").write_text("keep me too")
    (ck / "step-0").symlink_to(target)
    code, _, err = _resume_cli(run_cli, out, "--save-every", "1", "--keep-checkpoints", "1")
    assert code == 0, err
    assert (ck / ".tmp-keep" / "precious").read_text() == "keep me"
    assert (target / "precious").read_text() == "keep me too"
    assert not (ck / "step-0").is_symlink()
    assert (out / "config.json").exists()


# ------------------------------------------------------------------------------- case 2
def _planted_weights(src: Path, dest: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    w = load_file(src)
    with safe_open(src, "pt") as f:
        metadata = f.metadata()
    w[BIAS] = torch.full_like(w[BIAS], PLANTED)
    save_file(w, dest, metadata=metadata)


def _carries_planted_bias(out) -> bool:
    return float((_final(out)[BIAS] - PLANTED).abs().max()) < 1e-3


@pytest.mark.parametrize("how", ["link into a shared sticky directory", "regular file (control)"])
def test_weights_linked_from_outside_are_never_published(out, tmp_path, how):
    """Issue #39 case 2: step-2/model.safetensors -> a file in a world-writable sticky directory with
    one bias set to 0.0123; the published model carried it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    planted = shared / "model.safetensors"
    weights = out / "checkpoints/step-2/model.safetensors"
    _planted_weights(weights, planted)
    weights.unlink()
    if how.startswith("link"):
        weights.symlink_to(planted)
    else:
        shutil.copy(planted, weights)
    said = []
    s = _run(out, resume=True, steps=4, echo=said.append)
    if how.startswith("link"):
        skipped = [m for m in said if "skipped the broken checkpoint" in m]
        assert len(skipped) == 1 and str(weights) in skipped[0] and "symbolic link" in skipped[0], said
        assert s["resumed_from_step"] == 1 and not _carries_planted_bias(out)
    else:  # what the check lets through is really loaded: the test would see a followed link
        assert s["resumed_from_step"] == 2 and _carries_planted_bias(out)


# ------------------------------------------------------------------------------- another user
def _loosen(path: Path, how: str) -> None:
    if how == "o+w":
        os.chmod(path, os.stat(path).st_mode | 0o002)
    else:
        os.chown(path, OTHER_UID, OTHER_UID)


@needs_posix
@pytest.mark.parametrize(
    "how",
    ["o+w", pytest.param("another user's", marks=needs_root)],
)
@pytest.mark.parametrize(
    "name", ["step-2", "step-2/optimizer.pt", "step-2/rng-0.safetensors", "step-2/trainer_state.json"]
)
def test_a_checkpoint_another_user_can_write_is_skipped_by_name(out, how, name):
    path = out / "checkpoints" / name
    _loosen(path, how)
    said = []
    s = _run(out, resume=True, steps=4, echo=said.append)
    skipped = [m for m in said if "skipped the broken checkpoint" in m]
    why = "writable by other users" if how == "o+w" else f"belongs to uid {OTHER_UID}"
    assert len(skipped) == 1 and str(path) in skipped[0] and why in skipped[0], said
    assert s["resumed_from_step"] == 1


@needs_posix
@pytest.mark.parametrize("name", ["", "checkpoints", "train_log.jsonl", "finetune_run.json"])
def test_a_run_directory_others_can_write_is_refused_in_one_line(out, name, run_cli):
    path = out / name if name else out
    _loosen(path, "o+w")
    before = _snapshot(out)
    code, _, err = _resume_cli(run_cli, out)
    line = _error_line(err)
    assert code != 0 and str(path) in line and "writable by other users" in line, line
    assert _snapshot(out) == before


@pytest.mark.parametrize("name", ["train_log.jsonl", "finetune_run.json"])
def test_a_linked_log_or_run_record_is_refused_and_never_written_through(out, tmp_path, name, run_cli):
    """Both are read and rewritten on resume: a link there would carry another file in, or out."""
    path = out / name
    elsewhere = tmp_path / "elsewhere"
    shutil.move(path, elsewhere)
    path.symlink_to(elsewhere)
    before = elsewhere.read_bytes()
    code, _, err = _resume_cli(run_cli, out)
    line = _error_line(err)
    assert code != 0 and str(path) in line and "symbolic link" in line, line
    assert elsewhere.read_bytes() == before and path.is_symlink()


def test_a_linked_step_is_skipped_by_name_and_its_target_left_alone(out, tmp_path):
    path = out / "checkpoints/step-2"
    elsewhere = tmp_path / "elsewhere"
    shutil.move(path, elsewhere)
    path.symlink_to(elsewhere)
    before = _snapshot(elsewhere)
    said = []
    s = _run(out, resume=True, steps=4, echo=said.append)
    skipped = [m for m in said if "skipped the broken checkpoint" in m]
    assert len(skipped) == 1 and str(path) in skipped[0] and "symbolic link" in skipped[0], said
    assert s["resumed_from_step"] == 1
    assert _snapshot(elsewhere) == before  # the finished run dropped its checkpoints: the link, not its target


# ------------------------------------------------------------------------------- optimizer.pt
def _tamper_optimizer(path: Path, how: str) -> None:
    state = torch.load(path, weights_only=True)
    name = next(iter(state["state"]))
    if how == "moment shape":
        state["state"][name]["exp_avg"] = torch.zeros(3)
    elif how == "lr a string":
        state["param_groups"][0]["lr"] = "fast"
    elif how == "non-finite moment":
        state["state"][name]["exp_avg_sq"] = state["state"][name]["exp_avg_sq"] * float("nan")
    elif how == "other parameters":
        state["param_groups"][0]["params"] = state["param_groups"][0]["params"][::-1]
    torch.save(state, path)


@pytest.mark.parametrize("how", ["moment shape", "lr a string", "non-finite moment", "other parameters"])
def test_a_tampered_optimizer_state_is_named_not_blamed_on_the_learning_rate(out, how, run_cli):
    shutil.rmtree(out / "checkpoints/step-1")
    opt = out / "checkpoints/step-2/optimizer.pt"
    _tamper_optimizer(opt, how)
    code, _, err = _resume_cli(run_cli, out)
    line = _error_line(err)
    assert code != 0 and f"{opt}:" in line and "no intact checkpoint" in line, line
    assert "--lr" not in line and "learning rate" not in line


def test_an_untampered_optimizer_state_passes_its_check(out):
    """The negative control of the optimizer check: the state this run wrote matches its template."""
    from normswap.finetune import state as ckpt

    stored = torch.load(out / "checkpoints/step-2/optimizer.pt", weights_only=True)
    assert ckpt.optimizer_problem(stored, stored) is None
    bad = dict(stored, param_groups=stored["param_groups"][:1])
    assert "parameter groups" in ckpt.optimizer_problem(bad, stored)
