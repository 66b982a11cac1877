"""The CPU kernel's build cache: a killed build blocks nobody, and two installs never share a build."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from normswap.kernels import cpu

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernel not buildable here: {cpu.unavailable_reason()}")


def _child_env(cache: Path):
    return {**os.environ, "PYTHONPATH": str(ROOT), "NORMSWAP_CACHE_DIR": str(cache)}


def test_a_killed_build_does_not_block_the_next_process(tmp_path):
    from torch.utils.file_baton import FileBaton

    name = cpu._build_name(*cpu._flags())
    built = cpu._build_dir(name)  # where available() above built it
    cache = tmp_path / "cache"
    build_dir = cache / "cpu_kernel" / name
    shutil.copytree(built, build_dir)  # a finished build: the next process only has to load it

    # a process dies in the middle of a build: it holds normswap's lock and torch's baton file
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from normswap.kernels import cpu
        build_dir = Path({str(build_dir)!r})
        with cpu._build_lock(build_dir):
            (build_dir / "lock").touch()  # what torch's FileBaton creates while it builds
            print("building", flush=True)
            time.sleep(600)
    """)], env=_child_env(cache), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "building"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert (build_dir / "lock").exists()
    assert not FileBaton(str(build_dir / "lock")).try_acquire()  # torch alone would wait on it forever

    nxt = subprocess.run([sys.executable, "-c", "from normswap.kernels import cpu; print(cpu.available(), cpu.unavailable_reason())"],
                         env=_child_env(cache), capture_output=True, text=True, timeout=300)
    assert nxt.stdout.split() == ["True", "None"], nxt.stderr[-2000:]
    assert not (build_dir / "lock").exists()
    assert "building the CPU RMSNorm kernel" not in nxt.stderr  # it loaded the finished build


def test_two_virtualenvs_use_two_build_directories(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True, timeout=120)
    probe = "import sys; from normswap.kernels import cpu; print(sys.prefix); print(cpu._build_name(*cpu._flags()))"
    runs = {}
    for python in (sys.executable, str(venv / "bin" / "python")):
        out = subprocess.run([python, "-c", probe], env={**os.environ, "PYTHONPATH": str(ROOT)},
                             capture_output=True, text=True, timeout=120, check=True).stdout.split()
        runs[out[0]] = out[1]
    assert len(runs) == 2, runs  # two interpreters with their own prefixes...
    assert len(set(runs.values())) == 2, runs  # ...build into two directories
    assert cpu._build_name(*cpu._flags()) in runs.values()


def test_a_first_build_says_so_in_one_line_and_a_cached_one_is_silent(tmp_path, monkeypatch, capsys):
    """The compiler itself is replaced (a real build takes about a minute): what is tested is the
    user-facing line, printed exactly when no built library is in the cache yet."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("NORMSWAP_CACHE_DIR", str(tmp_path))
    built = []

    def fake_build(*, name, build_directory, **kwargs):
        Path(build_directory, f"{name}.so").write_bytes(b"")
        built.append(name)
        return "extension"

    monkeypatch.setattr(cpp_extension, "load", fake_build)
    assert cpu._load() == "extension"
    first = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(first) == 1 and "building the CPU RMSNorm kernel" in first[0] and str(tmp_path) in first[0]
    assert cpu._load() == "extension" and len(built) == 2  # torch's own loader runs again, from the cache
    assert capsys.readouterr().err.strip() == ""  # control: a cached build prints nothing


def test_two_checkouts_of_the_same_sources_use_two_build_directories(tmp_path, monkeypatch):
    """torch's build.ninja names the sources by absolute path: two checkouts (worktrees) sharing a
    build directory would rebuild over each other's library in turn, so the directory is keyed by
    where the sources are, not only by what they contain."""
    here = cpu._build_name(*cpu._flags())
    assert cpu._build_name(*cpu._flags()) == here  # control: the same checkout, the same directory
    copy = tmp_path / "csrc"
    shutil.copytree(cpu._CSRC, copy)
    monkeypatch.setattr(cpu, "_CSRC", copy)
    assert cpu._build_name(*cpu._flags()) != here
