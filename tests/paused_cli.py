"""Run the real `normswap` CLI in a child process that stops at a chosen point of its work.

Tests that kill a command part-way used to poll the filesystem every few milliseconds and send the
signal when they saw the stage: a fast (or descheduled) child could finish in between, so the kill
landed somewhere else, or nowhere. Here the child watches itself instead: an audit hook
(sys.addaudithook) checks, at each file operation the child makes in the pattern's directory (or
through a directory handle), whether a glob pattern now matches; the first time it does, the child
prints PAUSED on stdout and waits for a line on stdin, holding whatever it holds (its lock, its
staging directory). The test then kills it there, or lets it go on by writing a line. The stage is
therefore exact: the files the pattern names exist, and the operation that follows them in that
directory has not run yet.

The product reads nothing of this: the hook is installed by the wrapper below, in the test's
child only.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "PAUSED"

_WRAPPER = f"""
import glob, os, sys
pattern = sys.argv.pop(1).replace("{{pid}}", str(os.getpid()))
# the directory the pattern's literal part names: an operation elsewhere (the thousands of opens
# that importing torch makes) cannot complete the stage, and is not worth a glob each
first = min([i for i in (pattern.find(c) for c in "*?[") if i >= 0] or [len(pattern)])
where = os.path.dirname(pattern[:first])
state = {{"armed": True}}
def elsewhere(args):
    path = args[0] if args else None
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False  # a file descriptor: cannot tell, so look
    path = os.fsdecode(path)
    return os.path.isabs(path) and not path.startswith(where)
def hook(event, args):
    if state["armed"] and event in ("open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", \
"shutil.rmtree") and not elsewhere(args) and glob.glob(pattern):
        state["armed"] = False
        print({MARKER!r}, flush=True)
        sys.stdin.readline()
sys.addaudithook(hook)
sys.argv[0] = "normswap"
from normswap.cli.main import main
main(sys.argv[1:])
"""


def escape_dir(path) -> str:
    """A directory as the literal start of a glob pattern."""
    return glob.escape(str(path))


def start(pattern: str, *args, env=None) -> subprocess.Popen:
    """`normswap ARGS...` in a child that pauses once `pattern` ({pid}: the child's pid) matches."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", _WRAPPER, pattern, *map(str, args)],
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def wait_paused(proc: subprocess.Popen) -> bool:
    """Block until the child pauses (True) or exits without reaching the stage (False)."""
    for line in proc.stdout:
        if line.strip() == MARKER:
            return True
    return False


def resume(proc: subprocess.Popen) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()
