"""Signals reach every process we start: SIGTERM (or Ctrl-C) to a command ends it and every process it
started within seconds, with one line; a second signal never prints a traceback.

Each test starts a real command in its own session, waits until its worker processes run, signals the
command only (as `kill PID` does) and checks, with psutil, that every process it started is gone by a
deadline. The control in each: the workers are there, alive, before the signal (a test that found no
worker would pass trivially). On the code before normswap.processes, the study's workers were never
signalled and trained on (the `gone` assertion failed), and the second SIGTERM printed a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
# seconds from the signal until the command and every worker are gone: "within seconds", with room for
# a loaded 2-core CI machine (the command's own grace before SIGKILL is 3 s)
DEADLINE = 20.0
TINY = dict(model_type="gpt2", n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=4096)


def _env():
    # no CPU kernel build: the workers waited for are the study's own
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "NORMSWAP_DEBUG": "",
        "NORMSWAP_CPU_KERNEL": "0",
    }


def _start(args, tmp_path):
    err = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "normswap", *args],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=err,
        start_new_session=True,  # not this test's process group: only the command is signalled
        # as a shell starts a foreground command: SIGINT at its default even where this test runs with it
        # ignored (a background job of a non-interactive shell), so Python installs its Ctrl-C handler
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    return proc, err


def _wait_for_workers(proc, count, timeout=120.0):
    """The command's descendants once ``count`` of them run Python code of ours (the control)."""
    me = psutil.Process(proc.pid)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, "the command ended before its workers started"
        # a worker is ready once normswap.processes.child_started has run (it leads its own process group),
        # or, on code without it, once it has worked for a while
        kids = [p for p in me.children(recursive=True) if _alive(p) and (_pgid(p) == p.pid or _busy(p))]
        if len(kids) >= count:
            time.sleep(1.0)  # let them get into their work
            return me.children(recursive=True)
        time.sleep(0.2)
    raise AssertionError(f"no {count} workers within {timeout} s")


def _busy(p) -> bool:
    try:
        return "spawn_main" in " ".join(p.cmdline()) and sum(p.cpu_times()[:2]) > 8.0
    except psutil.Error:
        return False


def _pgid(p):
    try:
        return os.getpgid(p.pid)
    except OSError:
        return None


def _cmdline(p):
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _gone_by(proc, workers, deadline):
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline:
        if proc.poll() is not None and not any(_alive(w) for w in workers):
            return True
        time.sleep(0.1)
    return False


def _cleanup(proc, workers):
    for p in [*workers, proc]:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(10)


def _own_lines(stderr: str) -> list[str]:
    """What the command said beyond the study's header (its first line and the indented ones)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(("normswap study:", "  "))]


def _study_args(tmp_path):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    return [
        "study", str(cfg), "--out", str(tmp_path / "study"), "--arms", "layernorm,rmsnorm", "--seeds", "2",
        "--max-seeds", "2", "--steps", "100000", "--warmup", "2", "--seq-len", "32", "--batch-size", "4",
        "--eval-tokens", "512", "--workers", "2", "--threads", "1", "--device", "cpu", "--no-progress",
        "--lm-eval-tasks", "none", "--speed-seconds", "0", "--budget", "0",
    ]  # fmt: skip


@pytest.mark.slow  # a study started for real: about 20 s until its workers train on two loaded cores
@pytest.mark.parametrize("second", [False, True], ids=["one-sigterm", "two-sigterms"])
def test_sigterm_to_a_study_ends_its_workers(tmp_path, second):
    proc, err = _start(_study_args(tmp_path), tmp_path)
    workers = []
    try:
        workers = _wait_for_workers(proc, 2)
        assert all(_alive(w) for w in workers)  # the control: training workers, alive before the signal
        os.kill(proc.pid, signal.SIGTERM)
        if second:
            time.sleep(0.3)
            os.kill(proc.pid, signal.SIGTERM)
        assert _gone_by(proc, workers, DEADLINE), f"still running: {[w.pid for w in workers if _alive(w)]}"
    finally:
        _cleanup(proc, workers)
    err.seek(0)
    text = err.read()
    # a second signal after the command has unwound meets the default action: killed by it, at once
    assert proc.returncode in (128 + signal.SIGTERM, -signal.SIGTERM if second else None), text
    assert "Traceback" not in text and text.count("normswap: stopped by SIGTERM") == 1, text
    assert _own_lines(text) == ["normswap: stopped by SIGTERM"], text


@pytest.mark.slow
def test_ctrl_c_to_a_study_ends_its_workers_with_one_line(tmp_path):
    """SIGINT to the command alone (workers sit in their own process group, so a terminal's Ctrl-C reaches
    only the command, which ends them): no KeyboardInterrupt traceback from any worker."""
    proc, err = _start(_study_args(tmp_path), tmp_path)
    workers = []
    try:
        workers = _wait_for_workers(proc, 2)
        os.kill(proc.pid, signal.SIGINT)
        assert _gone_by(proc, workers, DEADLINE), f"still running: {[w.pid for w in workers if _alive(w)]}"
    finally:
        _cleanup(proc, workers)
    err.seek(0)
    text = err.read()
    assert proc.returncode != 0 and "Traceback" not in text, text
    lines = _own_lines(text)
    assert len(lines) == 1 and "interrupted" in lines[0], text


@pytest.mark.slow
def test_a_worker_dies_with_its_command_even_on_sigkill(tmp_path):
    """SIGKILL cannot be caught: the kernel ends the workers (their parent-death signal)."""
    proc, err = _start(_study_args(tmp_path), tmp_path)
    workers = []
    try:
        workers = _wait_for_workers(proc, 2)
        os.kill(proc.pid, signal.SIGKILL)
        study_workers = [w for w in workers if "spawn_main" in " ".join(_cmdline(w))]
        assert _gone_by(proc, study_workers, DEADLINE), f"still running: {[w.pid for w in study_workers]}"
    finally:
        _cleanup(proc, workers)
