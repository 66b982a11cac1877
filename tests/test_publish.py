"""normswap.publish: atomic files and directories, path safety, the OUT lock, leftovers of killed runs.

The kill tests run the real publishing code in a child process that SIGKILLs itself just before
its k-th filesystem change, for every k until it finishes: every instant at which a kill can land
between two steps is covered, not one chosen instant.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from normswap import publish
from normswap.errors import NormswapError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# A child that publishes OUT (new content: version "new") and SIGKILLs itself before its K-th
# filesystem change. It prints "done" when it got through.
CHILD = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    from normswap import publish

    out, force, kill_at, fallback = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4] == "1"
    count = [0]

    def hooked(fn):
        def wrapper(*a, **k):
            count[0] += 1
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **k)
        return wrapper

    for mod, name in ((os, "rename"), (os, "replace"), (os, "mkdir"), (os, "unlink"), (os, "write"),
                      (shutil, "rmtree"), (publish, "_exchange")):
        setattr(mod, name, hooked(getattr(mod, name)))
    if fallback:
        publish._exchange = hooked(lambda a, b: False)

    with publish.output_lock(out):
        with publish.staging_dir(out) as tmp:
            for i in range(3):
                publish.atomic_write_text(tmp / f"part{i}.txt", "new")
            publish.atomic_write_json(tmp / "config.json", {"version": "new"})
            publish.publish_dir(tmp, out, force=force)
    print("done")
""")


def _complete(out: Path, marker_ok=False) -> str | None:
    """'old' or 'new' when OUT is one complete version, None when absent; fails on anything else.

    ``marker_ok``: a kill right after the fallback's second rename leaves its marker in OUT for
    the next run to remove."""
    if not out.exists():
        return None
    names = sorted(p.name for p in out.iterdir() if not (marker_ok and p.name == publish.COMPLETE_MARKER))
    assert names == ["config.json", "part0.txt", "part1.txt", "part2.txt"], names
    version = json.loads((out / "config.json").read_text())["version"]
    assert all((out / f"part{i}.txt").read_text() == version for i in range(3))
    return version


def _write_old(out: Path):
    out.mkdir()
    for i in range(3):
        (out / f"part{i}.txt").write_text("old")
    (out / "config.json").write_text(json.dumps({"version": "old"}))


def _next_run(out: Path) -> list[str]:
    """What the next command does first: take the lock (which cleans up); returns its messages."""
    said = []
    with publish.output_lock(out, say=said.append):
        pass
    return said


@pytest.mark.parametrize(
    "force,fallback",
    [(False, False), (True, False), (True, True)],
    ids=["fresh", "force-exchange", "force-two-renames"],
)
def test_kill_at_every_step_of_publishing_leaves_one_complete_out(tmp_path, force, fallback):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    outcomes, k = set(), 0
    while True:
        k += 1
        work = tmp_path / f"k{k}"
        work.mkdir()
        out = work / "out"
        if force:
            _write_old(out)
        proc = subprocess.run(
            [sys.executable, str(script), str(out), "1" if force else "0", str(k), "1" if fallback else "0"],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=60,
        )
        finished = proc.stdout.strip() == "done"
        assert finished or proc.returncode == -signal.SIGKILL, proc.stderr
        state = _complete(out, marker_ok=fallback)
        said = _next_run(out)
        after = _complete(out)
        if force and not fallback:
            assert state in ("old", "new"), f"killed before step {k}: no complete OUT"
        elif force:
            # two renames: OUT is missing between them, and the next run restores the new one
            assert state in ("old", "new") or (after == "new" and "restored out" in said[0]), (k, said)
        # the next run leaves nothing but a complete OUT (or nothing), and says what it removed
        assert sorted(p.name for p in work.iterdir()) == ([] if after is None else ["out"]), k
        assert after == state or (state is None and after == "new")
        assert len(said) <= 1
        outcomes.add((state, bool(said)))
        if finished:
            assert state == "new" and not said
            break
    assert k > 8, "the child got through with too few filesystem steps to be a meaningful test"
    # kills landed both before and after the switch, and some of them left something to clean
    # (the two-rename fallback also hit its gap, which the next run repaired)
    assert {s for s, _ in outcomes} == ({"old", "new"} | ({None} if fallback else set()) if force else {None, "new"})
    assert any(cleaned for _, cleaned in outcomes)


def test_lock_refuses_a_second_process_and_dies_with_its_holder(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from normswap import publish\n"
            "with publish.output_lock(sys.argv[1], command='normswap convert SRC OUT'):\n"
            "    print('locked', flush=True); time.sleep(600)",
            str(out),
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(NormswapError) as e:
            with publish.output_lock(out):
                pass
        msg = str(e.value)
        assert "\n" not in msg and f"pid {holder.pid}" in msg and "normswap convert SRC OUT" in msg
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the lock with the killed holder: the next process takes it at once (the
    # lock never waits: while held, output_lock raised above; now it succeeds)
    with publish.output_lock(out):
        assert (tmp_path / ".out.normswap.lock").is_file()
    assert not (tmp_path / ".out.normswap.lock").exists()  # released and removed by its holder


def test_lock_is_reentrant_in_one_process_and_released_after(tmp_path):
    out = tmp_path / "out"
    with publish.output_lock(out):
        with publish.staging_dir(out) as tmp:  # takes the same lock again: no self-deadlock
            assert tmp.is_dir()
        assert (tmp_path / ".out.normswap.lock").exists()
    assert list(tmp_path.iterdir()) == []


def test_staging_of_a_live_process_is_left_alone(tmp_path):
    out = tmp_path / "out"
    live = tmp_path / f".out{publish.STAGING_TAG}{os.getppid()}-abcd"  # a pid that certainly runs
    dead = tmp_path / f".out{publish.STAGING_TAG}999999999-abcd"
    live.mkdir()
    dead.mkdir()
    said = _next_run(out)
    assert live.exists() and not dead.exists()
    assert len(said) == 1 and dead.name in said[0] and "stopped process 999999999" in said[0]


def test_path_safety(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for bad in (model, model / "inside", tmp_path):
        with pytest.raises(NormswapError, match="overlaps"):
            publish.check_output_path(bad, force=True, reads=[model])
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(NormswapError, match="symlink .* does not exist"):
        publish.check_output_path(dangling, force=True)
    with pytest.raises(NormswapError, match="symlink .* does not exist"):
        with publish.output_lock(dangling):
            pass
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NormswapError, match="not a directory"):
        publish.check_output_path(f, force=True)
    with pytest.raises(NormswapError, match="already exists"):
        publish.check_output_path(model, force=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert publish.check_output_path(empty, force=False, allow_empty=True) == empty
    assert publish.check_output_path(tmp_path / "new", force=False) == tmp_path / "new"


def test_atomic_write_leaves_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "run.json"
    publish.atomic_write_text(target, "old")

    def half_then_fail(f):  # bytes already in the temporary file when the writer fails
        f.write(b'{"partial": ')
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        publish.atomic_write_with(target, half_then_fail)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["run.json"]
    publish.atomic_write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
