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


class _Calls(list):
    loaded: list  # the bytes of each library handed to the loader (through its /proc/self/fd path)


@pytest.fixture
def build_calls(monkeypatch):
    """torch's cpp_extension.load replaced (a real build takes a minute): records where it would build,
    and what normswap's loader was handed to load (read through the handle it opened)."""
    from torch.utils import cpp_extension

    calls = _Calls()
    calls.loaded = []

    def fake_exec(module_name, path):
        calls.loaded.append(Path(path).read_bytes())
        return object()

    def fake_load(*, name, build_directory, **kwargs):
        calls.append(Path(build_directory))
        lib = Path(build_directory, f"{name}.so")
        if not lib.exists():
            lib.write_bytes(b"built by normswap")
        return object()

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(cpu, "_exec_extension", fake_exec)
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
    assert build_calls.loaded == [b"built by normswap"]
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
    assert build_calls.loaded == [b"planted library"]
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
    key = ("cpu", "float32", 64, "few", False, True, False)
    entry = {
        "device": key[0],
        "dtype": key[1],
        "width_bucket": key[2],
        "rows": key[3],
        "grad": key[4],
        "weight": key[5],
        "residual": key[6],
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


# ------------------------------------------------------------------ issue #29, case 1: the way to the cache
@needs_posix
@pytest.mark.skipif(not _can_chown(), reason="a directory owned by another user needs root")
@pytest.mark.parametrize("scratch_owner", ["another user", "root"])
def test_no_directory_on_the_way_to_the_cache_may_belong_to_another_user(tmp_path, monkeypatch, capsys, scratch_owner):
    """NORMSWAP_CACHE_DIR=scratch/me/nscache in a sticky scratch directory: normswap makes scratch/me
    itself (0700), so the cache and its parent pass; but when scratch belongs to another user, that user
    may rename scratch/me away and put their own tree there, sticky bit or not. Every name on the way is
    checked; the control: the same layout in a root-owned sticky scratch (like /tmp) is used."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o1777)
    if scratch_owner == "another user":
        os.chown(scratch, OTHER_UID, OTHER_UID)
    cache = scratch / "me" / "nscache"
    _isolate(monkeypatch, tmp_path, cache)

    d = private_dirs.cache_dir("cpu_kernel", "x")

    err = capsys.readouterr().err
    if scratch_owner == "another user":
        assert d == private_dirs.temp_root() / "cpu_kernel" / "x", d  # the next candidate, checked the same way
        assert f"{scratch} belongs to uid {OTHER_UID}" in private_dirs.check_private_dir(cache)
        assert "Traceback" not in err
    else:
        assert d == cache / "cpu_kernel" / "x" and err == ""
        assert private_dirs.check_private_dir(d) is None


@needs_posix
def test_a_loose_directory_anywhere_above_the_cache_is_refused(tmp_path):
    """Not only the cache's parent: a group- or other-writable, non-sticky directory two levels up
    lets anyone swap the whole subtree (round two checked only the parent)."""
    loose = tmp_path / "loose"
    (loose / "me" / "cache").mkdir(parents=True, mode=0o700)
    os.chmod(loose / "me", 0o700)
    os.chmod(loose, 0o777)
    why = private_dirs.check_private_dir(loose / "me" / "cache")
    assert why and "loose is writable by other users" in why and "not sticky" in why
    with pytest.raises(private_dirs.NotPrivate, match="not sticky"):
        private_dirs.ensure_private_dir(loose / "me" / "cache", base=loose / "me" / "cache")
    # a symlink on the way counts where it points, '..' after it too
    (tmp_path / "link").symlink_to(loose / "me")
    assert "not sticky" in private_dirs.check_private_dir(tmp_path / "link" / "cache")
    os.chmod(loose, 0o755)  # the control
    assert private_dirs.check_private_dir(loose / "me" / "cache") is None
    assert private_dirs.check_private_dir(tmp_path / "link" / "cache") is None


_EXTENSION_C = r"""
#include <Python.h>
#include <stdio.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "%(name)s", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_%(name)s(void) {
    PyObject *m = PyModule_Create(&def);
    if (m) PyModule_AddStringConstant(m, "who", "%(who)s");
    return m;
}
__attribute__((constructor)) static void on_load(void) {
    FILE *f = fopen("%(marker)s", "a");
    if (f) { fputs("%(who)s\n", f); fclose(f); }
}
"""


def _fresh_module_name(monkeypatch) -> str:
    """A build name of its own for each test: Python keeps an imported extension module by name and
    path (``/proc/self/fd/N`` repeats), so a second test importing the same name would get the first's."""
    import secrets

    name = f"normswap_cpu_test{secrets.token_hex(6)}"
    monkeypatch.setattr(cpu, "_build_name", lambda *a, **k: name)
    return name


def _extension(tmp_path: Path, name: str, who: str, dest: Path, marker: Path) -> None:
    """A real Python extension module ``name`` (what torch builds is one): importing it runs its
    constructor, which appends ``who`` to ``marker``, as a planted library would run its code."""
    import shutil
    import subprocess
    import sysconfig

    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    src = tmp_path / f"{who}.c"
    src.write_text(_EXTENSION_C % {"name": name, "who": who, "marker": marker})
    inc = sysconfig.get_paths()["include"]
    subprocess.run(["cc", "-shared", "-fPIC", f"-I{inc}", str(src), "-o", str(dest)], check=True)


@needs_posix
@pytest.mark.skipif(not _can_chown(), reason="planting another user's tree needs root")
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="loads through /proc/self/fd")
@pytest.mark.parametrize("when", ["during the build", "after the last check"])
def test_a_tree_swapped_in_during_the_build_is_never_loaded(tmp_path, monkeypatch, when):
    """The rename race of issue #29 case 1, played out: while the kernel builds (or just after normswap's
    last check), the cache directory is renamed away and another user's tree with a planted library put
    in its place. normswap loads through the handle on the directory it opened and checked first: the
    planted code never runs. The control at the end: loading by path at that moment (what torch's own
    import did) runs the planted library."""
    name = _fresh_module_name(monkeypatch)
    cache = tmp_path / "home" / "cache"
    _isolate(monkeypatch, tmp_path, cache)
    marker = tmp_path / "ran.txt"
    build_dir = private_dirs.cache_dir("cpu_kernel", name)
    _extension(tmp_path, name, "ours", build_dir / f"{name}.so", marker)
    moved = tmp_path / "home" / "moved"

    def swap():
        cache.rename(moved)
        planted = cache / "cpu_kernel" / name
        planted.mkdir(parents=True)
        _extension(tmp_path, name, "planted", planted / f"{name}.so", marker)
        for p in (planted / f"{name}.so", planted, planted.parent, cache):
            os.chown(p, OTHER_UID, OTHER_UID)

    monkeypatch.setattr(cpu, "_compiler_missing", lambda: None)
    if when == "during the build":
        monkeypatch.setattr(cpu, "_build", lambda name, *a: (swap(), name)[1])
    else:
        monkeypatch.setattr(cpu, "_build", lambda name, *a: name)
        real_import = cpu._import_at  # between normswap's last look at the path and the load
        monkeypatch.setattr(cpu, "_import_at", lambda *a: (swap(), real_import(*a))[1])

    if when == "during the build":
        with pytest.raises(private_dirs.NotPrivate, match="was replaced while the kernel was built"):
            cpu._load()
    else:
        module = cpu._load()
        assert module.who == "ours"  # loaded from the directory normswap checked, now at home/moved
    assert not marker.exists() or marker.read_text() == "ours\n"
    assert "planted" not in (marker.read_text() if marker.exists() else "")

    # the control: the attack is real - importing by path now runs the other user's code
    cpu._exec_extension(name, str(cache / "cpu_kernel" / name / f"{name}.so"))
    assert "planted" in marker.read_text()


@needs_posix
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="loads through /proc/self/fd")
def test_the_private_cache_loads_through_its_handle(tmp_path, monkeypatch):
    """The control: nothing swapped, a library of ours (made under a loose umask: group-writable) loads."""
    name = _fresh_module_name(monkeypatch)
    _isolate(monkeypatch, tmp_path, tmp_path / "cache")
    marker = tmp_path / "ran.txt"
    build_dir = private_dirs.cache_dir("cpu_kernel", name)
    _extension(tmp_path, name, "ours", build_dir / f"{name}.so", marker)
    os.chmod(build_dir / f"{name}.so", 0o775)
    monkeypatch.setattr(cpu, "_compiler_missing", lambda: None)
    monkeypatch.setattr(cpu, "_build", lambda name, *a: name)
    assert cpu._load().who == "ours" and marker.read_text() == "ours\n"
    assert stat.S_IMODE(os.stat(build_dir / f"{name}.so").st_mode) == 0o755
