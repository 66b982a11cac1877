"""The CPU kernel's build cache: a killed build blocks nobody, two installs never share a build, and two
checkouts of the same sources do."""

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


@pytest.fixture(autouse=True)
def _kernel_buildable():
    # checked when a test of this file runs, not when it is collected: available() builds the
    # kernel (a minute or more), which `pytest -m cuda` (bench/gpu.sh) must not pay for
    if not cpu.available():
        pytest.skip(f"CPU kernel not buildable here: {cpu.unavailable_reason()}")


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
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import time
        from pathlib import Path
        from normswap.kernels import cpu
        build_dir = Path({str(build_dir)!r})
        with cpu._build_lock(build_dir):
            (build_dir / "lock").touch()  # what torch's FileBaton creates while it builds
            print("building", flush=True)
            time.sleep(600)
    """),
        ],
        env=_child_env(cache),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "building"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert (build_dir / "lock").exists()
    assert not FileBaton(str(build_dir / "lock")).try_acquire()  # torch alone would wait on it forever

    nxt = subprocess.run(
        [sys.executable, "-c", "from normswap.kernels import cpu; print(cpu.available(), cpu.unavailable_reason())"],
        env=_child_env(cache),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert nxt.stdout.split() == ["True", "None"], nxt.stderr[-2000:]
    assert not (build_dir / "lock").exists()
    assert "building the CPU RMSNorm kernel" not in nxt.stderr  # it loaded the finished build


def _venv_over_this_environment(venv: Path) -> Path:
    """A second virtualenv that sees this interpreter's packages: its own prefix, this one's torch.

    `--system-site-packages` alone would see the *base* interpreter's packages, which need not
    include torch (a user's venv made with plain `python -m venv`): the new venv instead adds this
    environment's site directories (those on its sys.path) through a .pth file (addsitedir, so
    their own .pth files, an editable install among them, still apply)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    ours = [
        p
        for p in dict.fromkeys(sys.path)
        if p.rstrip("/").endswith(("site-packages", "dist-packages")) and os.path.isdir(p)
    ]
    Path(purelib, "_normswap_test_parent_env.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in ours)
    )
    return python


def test_two_virtualenvs_use_two_build_directories(tmp_path):
    venv_python = _venv_over_this_environment(tmp_path / "venv")
    probe = "import sys; from normswap.kernels import cpu; print(sys.prefix); print(cpu._build_name(*cpu._flags()))"
    runs = {}
    for python in (sys.executable, str(venv_python)):
        proc = subprocess.run(
            [python, "-c", probe],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = proc.stdout.split()
        runs[out[0]] = out[1]
    assert len(runs) == 2, runs  # two interpreters with their own prefixes...
    assert len(set(runs.values())) == 2, runs  # ...build into two directories
    assert cpu._build_name(*cpu._flags()) in runs.values()


def test_a_first_build_says_so_in_one_line_and_a_cached_one_is_silent(tmp_path, monkeypatch, capsys):
    """The compiler itself is replaced (a real build takes about a minute): what is tested is the
    user-facing line, printed exactly when no built library is in the cache yet, and that the build
    reads the copy of the sources inside the build directory (not the checkout)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("NORMSWAP_CACHE_DIR", str(tmp_path))
    built = []

    def fake_build(*, name, build_directory, sources, **kwargs):
        assert all(Path(s).parent == Path(build_directory, "src") and Path(s).is_file() for s in sources), sources
        Path(build_directory, f"{name}.so").write_bytes(b"")
        built.append(name)
        return "extension"

    monkeypatch.setattr(cpp_extension, "load", fake_build)
    monkeypatch.setattr(cpu, "_exec_extension", lambda name, path: "extension")  # loaded through its handle
    assert cpu._load() == "extension"
    first = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(first) == 1 and "building normswap's C++ norm kernel (first use" in first[0], first
    assert str(tmp_path) in first[0]
    assert cpu._load() == "extension" and len(built) == 2  # the build step runs again (torch finds it up to date)
    assert capsys.readouterr().err.strip() == ""  # control: a cached build prints nothing


def test_a_first_build_under_a_command_is_what_its_progress_repeats():
    """Inside a command the build is said through its heartbeat, so the repeated line names the
    build ("still: building ...") instead of the step it interrupted; the step's status comes back
    after. Negative control: the same heartbeat without the announcement repeats the step."""
    from normswap.progress import Heartbeat, announced

    now = [0.0]
    lines = []
    beat = Heartbeat(lines.append, every=10, enabled=True, clock=lambda: now[0])
    beat._thread = None
    with beat:
        beat.say("verifying")
        now[0] = 11
        assert beat.tick() == "still: verifying (11 s)"  # control
        with announced(cpu.BUILD_MESSAGE.format(where="/cache")):
            now[0] = 30
            assert beat.tick().startswith("still: building normswap's C++ norm kernel (first use, ~1 min")
        now[0] = 45
        assert beat.tick() == "still: verifying (45 s)"


def _clone_name(root: Path) -> str:
    """The kernel's build name as a process running the package copied to ``root`` computes it."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from normswap.kernels import cpu; print(cpu.__file__); print(cpu._build_name(*cpu._flags()))",
        ],
        env={**os.environ, "PYTHONPATH": str(root)},
        cwd=root,  # `python -c` puts the working directory first on the path
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, name = proc.stdout.split()
    assert Path(where).is_relative_to(root), where  # the copy ran, not this checkout
    return name


def test_two_checkouts_of_the_same_sources_share_one_build_and_a_changed_source_gets_its_own(tmp_path):
    """The build name holds what is built, not where the checkout lies (the sources are built from
    their copy in the build directory), so a fresh clone reuses the built kernel; a changed source
    is another build (negative control: a name that ignored the sources would pass the first half)."""
    here = cpu._build_name(*cpu._flags())
    ignore = shutil.ignore_patterns("assets", "__pycache__")
    for clone in ("a", "b/deeper"):
        shutil.copytree(ROOT / "normswap", tmp_path / clone / "normswap", ignore=ignore)
    assert _clone_name(tmp_path / "a") == here
    assert _clone_name(tmp_path / "b/deeper") == here
    changed = tmp_path / "b/deeper/normswap/kernels/csrc/rms_norm_cpu_kernel.h"
    changed.write_bytes(changed.read_bytes() + b"\n// changed\n")
    assert _clone_name(tmp_path / "b/deeper") != here
