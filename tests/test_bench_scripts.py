"""Every script under bench/ answers `python bench/<script>.py --help` from the repository root without
doing its work, and none shadows an importable package: a script run directly puts bench/ first on
sys.path, where bench/kernels.py once hid the `kernels` package transformers imports (ImportError on
the GPU machine, #44)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def _help(script: Path) -> tuple[Path, subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(script.relative_to(REPO)), "--help"]
    return script, subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_every_bench_script_answers_help_without_doing_its_work():
    # one interpreter per script (each imports torch: seconds), two at a time on the shared cores
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(_help, SCRIPTS))
    assert len(done) >= 15  # the glob found the scripts
    for script, r in done:
        assert r.returncode == 0, f"{script.name}: {r.stderr[-2000:]}"
        assert "usage:" in r.stdout.lower(), f"{script.name} printed no usage: {r.stdout[-500:]}"
        assert "Traceback" not in r.stderr, script.name


def _importable(name: str, path: list[str]) -> bool:
    saved = sys.path[:]
    sys.path[:] = path
    try:
        return importlib.util.find_spec(name) is not None
    finally:
        sys.path[:] = saved


def test_no_bench_script_shadows_an_importable_module():
    """What Python would import under each script's name if bench/ were not first on sys.path (the
    tests' own directory left out too): nothing, or the script hides it."""
    path = [p for p in sys.path if Path(p or ".").resolve() not in (BENCH, REPO / "tests")]
    shadowing = [s.stem for s in SCRIPTS if s.stem not in sys.modules and _importable(s.stem, path)]
    assert shadowing == [], f"bench/ scripts named like importable modules: {shadowing}"
    # negative control: the name the old bench/kernels.py had, and a standard-library name, are found
    if importlib.util.find_spec("kernels") is not None:
        assert _importable("kernels", path)
    assert _importable("statistics", path)


@pytest.mark.parametrize("script", ["decode_timing.py", "saved_result.py"])
def test_a_bench_module_run_as_a_script_refuses_in_one_line(script):
    r = subprocess.run(
        [sys.executable, f"bench/{script}"], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2 and "nothing to run" in r.stderr and "Traceback" not in r.stderr
