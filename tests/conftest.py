import os

# Tests never touch a hub: everything is built from configs or shipped in the package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n N runs N workers side by side: one thread each, so they do not fight over the cores
    # (child processes the tests start inherit it)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import shutil
from pathlib import Path

import pytest
from helpers import assert_no_traceback


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one and a half workers per core (at most --maxprocesses). Many tests wait on the
    child processes they start (CLI runs, torchrun, kills), so a third worker on two cores keeps them busy."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (3 * cpus) // 2)


@pytest.fixture
def run_cli(capsys):
    """Run the real `normswap` entry point in-process; return (exit code, stdout, stderr)."""
    from normswap.cli.main import main

    def _run(*args):
        code = 0
        try:
            main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capsys.readouterr()
        assert_no_traceback(args, code, err)
        return code, out, err

    return _run


@pytest.fixture
def fresh_autotune(tmp_path, monkeypatch):
    """The kernel autotuner with no choices in memory and its on-disk table in an empty private
    directory (``tmp_path``, returned); its in-memory choices are dropped again afterwards."""
    from normswap.testing import forget_kernel_choices

    monkeypatch.setenv("NORMSWAP_CACHE_DIR", str(tmp_path))
    forget_kernel_choices()
    yield tmp_path
    forget_kernel_choices()


@pytest.fixture(scope="session")
def built_once(tmp_path_factory):
    """``built_once(name, build)`` -> a directory that ``build(path)`` filled, once per test run.

    pytest-xdist gives every worker its own session, so a session fixture alone is still built once
    per worker (three times on `-n 3`), and a module fixture once per worker that runs a test of the
    module. The workers' temporary roots share a parent (the controller's basetemp): the first worker
    to ask builds there under a file lock, and the others wait for it and read the same files.
    Callers must not modify what they get."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    root = root / "built-once"
    root.mkdir(exist_ok=True)

    def get(name: str, build) -> Path:
        path, done = root / name, root / f"{name}.done"
        with FileLock(str(root / f"{name}.lock")):
            if not done.exists():
                # built in place (checkpoints record their own and their source's paths), marked
                # complete afterwards; a build that failed part-way is started again from nothing
                shutil.rmtree(path, ignore_errors=True)
                path.mkdir()
                build(path)
                done.touch()
        return path

    return get
