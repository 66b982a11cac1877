"""bench/gpu.sh's machinery (bench/gpu_lib.sh, bench/gpu_summary.py): a step is cut at the limit it is
given and what it wrote so far survives into the results and the summary; a background job is cut
at its own limit and awaited; the committed plan fits its 9-minute slot with room for one more step.
The planted steps sleep instead of working (seconds in all, no GPU)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PLANTED = r"""
set -uo pipefail
export RES=$1 WORK=$2
T0=$(date +%s) KILL_AFTER=1
source bench/gpu_lib.sh
mkdir -p "$RES" "$WORK"; : >"$RES/steps.tsv"
collect_slow() { cp "$WORK/made-by-slow.txt" "$RES/slow/" ; }
plan late 1 'sleep 30' background
slow='echo "given $STEP_LIMIT s" >"$STEP_OUT/partial.txt"; echo part >"$WORK/made-by-slow.txt"; sleep 30'
plan slow 2 "$slow"'; echo x >"$STEP_OUT/never.txt"'
plan quick 20 'echo done >"$STEP_OUT/done.txt"'
plan late await
echo "worst $(plan_seconds)"
run_plan
"""


def _run_planted(tmp_path: Path) -> tuple[Path, str]:
    res, work = tmp_path / "res", tmp_path / "work"
    r = subprocess.run(
        ["bash", "-c", PLANTED, "planted", str(res), str(work)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    return res, r.stdout + r.stderr


def test_a_slow_step_is_cut_at_its_limit_and_keeps_what_it_wrote(tmp_path):
    res, out = _run_planted(tmp_path)
    rows = {line.split("\t")[0]: line.split("\t")[1:] for line in (res / "steps.tsv").read_text().splitlines()}
    assert list(rows) == ["slow", "quick", "late"], out  # written as they end; the background when awaited
    rc, seconds, limit = rows["slow"]
    assert rc == "124" and limit == "2" and int(seconds) < 30, out  # cut by its limit, not by its own end
    assert (res / "slow" / "partial.txt").read_text() == "given 2 s\n"  # STEP_LIMIT: its budget, passed in
    assert not (res / "slow" / "never.txt").exists()
    assert (res / "slow" / "made-by-slow.txt").read_text() == "part\n"  # collect_slow ran after the cut
    assert "TIMED OUT after 2s" in (res / "slow.log").read_text()
    assert rows["quick"][0] == "0" and (res / "quick" / "done.txt").exists()  # control: a step within its limit
    assert rows["late"][0] == "124" and rows["late"][2] == "1"  # the background job, cut at its own limit
    # worst case: 2 + 20 (+ 1 kill-after each); the background ends inside it, so awaiting it adds nothing
    assert "worst 24" in out

    r = subprocess.run(
        [sys.executable, "bench/gpu_summary.py", str(res), "--dry-run"], cwd=REPO, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    status = json.loads((res / "status.json").read_text())
    assert {s["step"]: s["status"] for s in status["steps"]} == {"slow": "timeout", "quick": "ok", "late": "timeout"}
    md = (res / "summary.md").read_text()
    assert "| slow | timeout | 124 |" in md and "## slow: timeout (log tail)" in md and "TIMED OUT" in md


def test_the_committed_plan_fits_its_slot_with_room_for_one_more_step():
    r = subprocess.run(["bash", "bench/gpu.sh", "--plan"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    worst, headroom, slot = map(int, re.search(r"worst case (\d+)s, headroom (\d+)s, slot (\d+)s", r.stdout).groups())
    assert slot == 540 and headroom >= 40 and worst + headroom <= slot
    steps = [line.split() for line in r.stdout.splitlines() if len(line.split()) == 3]
    names = [name for name, mode, _ in steps if mode == "step"]
    # the order of value: the user's path, 1.5B speed, kernels, CUDA tests, the study
    assert names == ["setup", "user-path", "xl-speed", "kernels", "cuda-tests", "study", "summary"]
    fg = sum(int(limit) + 3 for _, mode, limit in steps if mode == "step" and _ != "summary")
    assert worst >= fg  # every step at its limit is counted (background and await add nothing here)


def test_the_plan_check_refuses_a_plan_past_the_slot(tmp_path):
    """Negative control of the check above: one more 60 s step no longer fits."""
    script = tmp_path / "gpu.sh"
    text = (REPO / "bench" / "gpu.sh").read_text()
    script.write_text(text.replace("plan study 90 'study_run'", "plan study 90 'study_run'\nplan extra 60 'true'"))
    (tmp_path / "bench").mkdir()
    for f in ("gpu_lib.sh",):
        (tmp_path / "bench" / f).write_text((REPO / "bench" / f).read_text())
    (tmp_path / "bench" / "gpu.sh").write_text(script.read_text())
    r = subprocess.run(["bash", "bench/gpu.sh", "--plan"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 99 and "must stay free" in r.stderr
