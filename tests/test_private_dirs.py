"""Directories normswap keeps outside OUT are private; nothing another user planted is loaded or written through.

Issue #22, cases 1 and 2: a `.so` planted in the kernel cache's temp-dir fallback (a predictable
name under a shared /tmp) or in a cache directory other users can write must never be loaded;
an autotune table there is never read; a symlink planted at OUT's lock name must not make
normswap overwrite its target. Each unsafe variant is refused (or skipped, and said); the same
thing made private is used.
"""

import json
import os
import stat
from pathlib import Path

import pytest

from normswap import private_dirs
from normswap.kernels import autotune, cpu
from normswap.testing import forget_kernel_choices

needs_posix = pytest.mark.skipif(not hasattr(os, "getuid"), reason="owners and modes are POSIX")
OTHER_UID = 4242  # a user that is not us


def _can_chown() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _plant_build(root: Path, name: str) -> Path:
    """What an attacker plants: a build directory holding a library and ninja files saying it is up to date."""
    d = root / "cpu_kernel" / name
    d.mkdir(parents=True)
    (d / f"{name}.so").write_bytes(b"planted library")
    (d / "build.ninja").write_text("# nothing to rebuild\n")
    return d


@pytest.fixture
def build_calls(monkeypatch):
    """torch's cpp_extension.load replaced (a real build takes a minute): records where it would build and load."""
    from torch.utils import cpp_extension

    calls = []

    def fake_load(*, name, build_directory, **kwargs):
        calls.append(Path(build_directory))
        lib = Path(build_directory, f"{name}.so")
        if not lib.exists():
            lib.write_bytes(b"built by normswap")
        return object()

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(cpu, "_compiler_missing", lambda: None)
    return calls


def _isolate(monkeypatch, tmp_path, cache: Path) -> Path:
    """The cache root and the temporary directory both under tmp_path; returns the temp-dir fallback."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o1777)
    os.chmod(tmp, 0o1777)  # like /tmp: everybody may create, the sticky bit keeps them from removing others' entries
    monkeypatch.setenv("NORMSWAP_CACHE_DIR", str(cache))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr("tempfile.tempdir", None)
    private_dirs._said.clear()
    private_dirs._fresh.clear()
    return private_dirs.temp_root()


@needs_posix
@pytest.mark.skipif(not _can_chown(), reason="planting a directory owned by another user needs root")
def test_a_planted_kernel_library_is_never_loaded(tmp_path, monkeypatch, capsys, build_calls):
    name = cpu._build_name(*cpu._flags())
    # the configured cache: writable by everyone (mode 0777), with a library in it
    shared = tmp_path / "shared-cache"
    planted_shared = _plant_build(shared, name)
    for p in (shared, shared / "cpu_kernel", planted_shared):
        os.chmod(p, 0o777)
    fallback = _isolate(monkeypatch, tmp_path, shared)
    # the temp-dir fallback: planted first, by another user, with the victim's predictable name
    planted_tmp = _plant_build(fallback, name)
    for p in (fallback, fallback / "cpu_kernel", planted_tmp):
        os.chown(p, OTHER_UID, OTHER_UID)
        os.chmod(p, 0o755)

    cpu._load()

    assert len(build_calls) == 1
    used = build_calls[0]
    assert used not in (planted_shared, planted_tmp)
    assert not used.is_relative_to(shared) and not used.is_relative_to(fallback)
    assert stat.S_IMODE(os.stat(used).st_mode) == 0o700 and os.stat(used).st_uid == os.getuid()
    assert (used / f"{name}.so").read_bytes() == b"built by normswap"  # built fresh, nothing copied from a planted dir
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "fresh private temporary directory" in line]
    assert len(said) == 1, err
    assert "writable by other users" in said[0] and f"belongs to uid {OTHER_UID}" in said[0]
    assert "Traceback" not in err


@needs_posix
def test_a_private_cache_is_used(tmp_path, monkeypatch, capsys, build_calls):
    """The control: the same planted-looking build in a cache that is ours alone is the one loaded."""
    name = cpu._build_name(*cpu._flags())
    cache = tmp_path / "cache"
    ours = _plant_build(cache, name)
    _isolate(monkeypatch, tmp_path, cache)

    cpu._load()

    assert build_calls == [ours]
    assert (ours / f"{name}.so").read_bytes() == b"planted library"  # found, loaded, not rebuilt
    assert "fresh private temporary directory" not in capsys.readouterr().err


@needs_posix
def test_cache_directories_are_created_private_even_under_a_loose_umask(tmp_path, monkeypatch):
    cache = tmp_path / "new" / "cache"
    _isolate(monkeypatch, tmp_path, cache)
    old = os.umask(0)
    try:
        d = private_dirs.cache_dir("cpu_kernel", "x")
    finally:
        os.umask(old)
    assert d == cache / "cpu_kernel" / "x"
    for level in (cache, cache / "cpu_kernel", d):
        assert stat.S_IMODE(os.stat(level).st_mode) == 0o700, level


@needs_posix
def test_a_cache_in_a_directory_others_can_swap_is_refused(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)  # not sticky: anyone may rename our directory away and plant theirs
    (loose / "cache").mkdir(mode=0o700)
    assert "writable by other users" in private_dirs.check_private_dir(loose / "cache")
    with pytest.raises(private_dirs.NotPrivate, match="not sticky"):
        private_dirs.ensure_private_dir(loose / "cache")
    os.chmod(loose, 0o1777)  # sticky, like /tmp: only the owner may remove or rename it
    assert private_dirs.check_private_dir(loose / "cache") is None


def _table(ranking):
    key = ("cpu", "float32", 64, "few", False)
    entry = {
        "device": key[0],
        "dtype": key[1],
        "width_bucket": key[2],
        "rows": key[3],
        "grad": key[4],
        "ranking": ranking,
        "measured": True,
        "why": "planted",
    }
    return key, json.dumps({"version": autotune.FILE_VERSION, "machines": {"this machine": [entry]}})


@needs_posix
@pytest.mark.parametrize("how", ["group-writable dir", "other-writable file", "symlinked file", "private"])
def test_autotune_table_is_read_only_from_a_private_cache(tmp_path, monkeypatch, how):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("NORMSWAP_CACHE_DIR", str(cache))
    monkeypatch.setattr(autotune, "_machine_id", lambda: "this machine")  # the real one builds the CPU kernel first
    key, text = _table(["composite", "native"])
    if how == "symlinked file":
        (tmp_path / "elsewhere.json").write_text(text)
        (cache / "autotune.json").symlink_to(tmp_path / "elsewhere.json")
    else:
        (cache / "autotune.json").write_text(text)
    if how == "group-writable dir":
        os.chmod(cache, 0o770)
    if how == "other-writable file":
        os.chmod(cache / "autotune.json", 0o666)
    forget_kernel_choices()
    try:
        autotune._load_disk()
        assert (autotune._memory.get(key) == ["composite", "native"]) == (how == "private")
    finally:
        forget_kernel_choices()


# ---------------------------------------------------------------------------------------- locks
def test_a_symlink_at_the_lock_name_is_not_followed(tmp_path, run_cli):
    victim = tmp_path / "precious.txt"
    victim.write_text("the user's own file\n")
    out = tmp_path / "out"
    (tmp_path / ".out.normswap.lock").symlink_to(victim)

    code, _, err = run_cli("convert", tmp_path / "no-such-model", out)

    assert code == 2
    assert victim.read_text() == "the user's own file\n"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "is a symbolic link" in lines[0] and ".out.normswap.lock" in lines[0], err
    assert not out.exists() and (tmp_path / ".out.normswap.lock").is_symlink()  # left for the user to look at


def test_the_lock_works_and_refuses_a_hard_link(tmp_path, run_cli):
    from normswap.publish import output_lock

    out = tmp_path / "out"
    with output_lock(out):  # the control: a normal lock is taken, holds our pid, and goes away
        lock = tmp_path / ".out.normswap.lock"
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()

    victim = tmp_path / "precious.txt"
    victim.write_text("keep\n")
    os.link(victim, lock)  # a second name for the user's file, planted where the lock goes
    code, _, err = run_cli("convert", tmp_path / "no-such-model", out)
    assert code == 2 and "hard link" in err and "Traceback" not in err, err
    assert victim.read_text() == "keep\n"


def test_an_out_name_too_long_for_the_lock_is_refused_first(tmp_path, run_cli):
    out = tmp_path / ("n" * 250)
    code, _, err = run_cli("convert", tmp_path / "no-such-model", out)
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "bytes long" in lines[0] and "choose a name of at most" in lines[0], err
    assert list(tmp_path.iterdir()) == []  # nothing created
    # the control: the longest name it allows gets as far as the model lookup
    limit = int(lines[0].rsplit("at most ", 1)[1].split()[0])
    code, _, err = run_cli("convert", tmp_path / "no-such-model", tmp_path / ("n" * limit))
    assert code == 2 and "model not found" in err, err
