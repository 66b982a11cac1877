"""Every script under bench/ is a driver: it answers `python bench/<script>.py --help` from the repository
root without doing its work, imports no other bench script (shared code lives in normswap/benchmarks/),
and none shadows an importable package: a script run directly puts bench/ first on
sys.path, where a script named kernels.py once hid the `kernels` package transformers imports (ImportError on
the GPU machine, #44)."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


def bench_imports(sources: dict[str, str]) -> list[str]:
    """Bench scripts that import another bench script by its bare name: a library kept beside the
    drivers, which works only while bench/ is first on sys.path (libraries live in normswap/benchmarks/)."""
    found = []
    for name, source in sorted(sources.items()):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [(node.module or "").split(".")[0]]
            else:
                continue
            found += [f"{name} imports bench/{t}.py" for t in targets if t in sources and t != name]
    return found


def test_a_bench_script_imported_as_a_library_is_flagged():
    # negative control: the two forms a driver once used to reach a sibling are each found
    planted = {
        "driver": "from saved_result import save_and_print\nimport decode_timing\n",
        "saved_result": "import json\n",
        "decode_timing": "import time\n",
    }
    assert bench_imports(planted) == ["driver imports bench/saved_result.py", "driver imports bench/decode_timing.py"]
    assert bench_imports({"driver": "from normswap.benchmarks.saved_result import save_and_print\n"}) == []


def test_bench_holds_drivers_only():
    found = bench_imports({s.stem: s.read_text(encoding="utf-8") for s in SCRIPTS})
    assert not found, "libraries belong in normswap/benchmarks/:\n" + "\n".join(found)
