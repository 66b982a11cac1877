"""Issue #45, case 1: torch.compile's caches are normswap's own, never ``$TMPDIR/torchinductor_<user>``.

Inductor loads what it finds in its cache directory under the expected name. Its default is a
predictable name in the shared temporary directory that torch makes with ``exist_ok=True`` and
never checks, so another user who makes it first has their modules imported by the victim's
``eval speed --compile``. Every compile normswap does goes through ``normswap.compile_cache.compiled``:
these tests plant that directory (owned by another uid, writable by all) and check that nothing in
torch still points at it, that the list of torch modules binding ``default_cache_dir`` is complete for
the installed torch, and (slow) that a real compile neither reads nor writes the planted directory.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OTHER_UID = 4242
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="planting another user's directory needs chown (root)"
)


def _child(code: str, env: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (torch computes its temporary directory once per process)."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    full = {**inherited, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True, timeout=timeout
    )


def _plant(tmp_path: Path) -> tuple[Path, Path]:
    """A shared temporary directory holding another user's ``torchinductor_<user>`` (mode 0777)."""
    import getpass

    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    planted = shared / f"torchinductor_{getpass.getuser()}"
    planted.mkdir()
    os.chmod(planted, 0o777)
    os.chown(planted, OTHER_UID, OTHER_UID)
    return shared, planted


_WHERE = """
    import json, os, sys
    from torch._inductor.runtime import cache_dir_utils
    import torch._inductor.codecache as codecache
    import torch._inductor.runtime.runtime_utils as runtime_utils
    import torch._inductor.cache as inductor_cache
    if sys.argv[-1] != "plain":
        from normswap.compile_cache import private_compile_cache
        private_compile_cache()
    from torch._inductor.runtime.caching import implementations
    print(json.dumps({
        "cache_dir": cache_dir_utils.cache_dir(),
        "default (cache_dir_utils)": cache_dir_utils.default_cache_dir(),
        "default (runtime_utils)": runtime_utils.default_cache_dir(),
        "default (codecache)": codecache.default_cache_dir(),
        "precompiled headers": codecache._HEADER_DIR,
        "triton": cache_dir_utils.triton_cache_dir(0),
        "on-disk cache": str(inductor_cache.InductorOnDiskCache().base_dir),
        "caching implementations": str(implementations._OnDiskCacheImpl()._base_dir),
        "children's TMPDIR": os.environ["TMPDIR"],
    }))
"""


@needs_root
@pytest.mark.parametrize("mode", ["normswap", "plain"])
def test_every_cache_path_torch_computes_is_private(tmp_path, mode):
    """After ``private_compile_cache``, every directory torch would put compiled code in lies in
    normswap's private cache, none in the planted default; ``plain`` (torch as it comes) is the
    negative control: there they lie in the planted directory."""
    import json

    shared, planted = _plant(tmp_path)
    cache = tmp_path / "nscache"
    r = _child(_WHERE.replace('sys.argv[-1] != "plain"', repr(mode != "plain")),
               {"TMPDIR": str(shared), "NORMSWAP_CACHE_DIR": str(cache)})  # fmt: skip
    assert r.returncode == 0, r.stderr
    where = json.loads(r.stdout.strip().splitlines()[-1])
    inside_planted = {k: v for k, v in where.items() if Path(v).resolve().is_relative_to(planted)}
    if mode == "plain":
        assert inside_planted, "negative control: torch's defaults should lie in the planted directory"
        return
    assert not inside_planted, f"still in another user's directory: {inside_planted}"
    private = (cache / "torch-compile").resolve()
    assert all(Path(v).resolve().is_relative_to(private) for v in where.values()), where
    assert oct(private.stat().st_mode & 0o777) == "0o700"
    assert list(planted.iterdir()) == []


def test_every_torch_module_binding_default_cache_dir_is_redirected():
    """The installed torch, read as text: every module that imports ``default_cache_dir`` by name at
    module level, or computes a path from it while being imported, is one compile_cache redirects.
    A torch that starts binding it somewhere new fails here, before it can bypass the rule."""
    import torch

    from normswap.compile_cache import DEFAULT_CACHE_DIR_USERS

    base = Path(torch.__file__).parent
    binders, import_time = set(), set()
    for path in base.rglob("*.py"):
        if "test" in path.parts:
            continue
        text = path.read_text(errors="replace")
        if "default_cache_dir" not in text:
            continue
        module = ".".join(("torch", *path.relative_to(base).with_suffix("").parts)).removesuffix(".__init__")
        for line in text.splitlines():
            top_level = not line[:1].isspace()
            if top_level and re.match(r"(from \S+ )?import\b", line) and "default_cache_dir" in line:
                binders.add(module)
            elif re.match(r"\s*from (\S+) import .*default_cache_dir", line):  # a function's own import
                binders.add(re.match(r"\s*from (\S+) import", line).group(1))
            if top_level and re.search(r"\bdefault_cache_dir\(\)", line) and not line.startswith("def "):
                import_time.add(module)
    vendored = {m for m in binders if m.startswith("torch._vendor")}  # their own default_cache_dir, not Inductor's
    assert binders - vendored <= set(DEFAULT_CACHE_DIR_USERS), binders - vendored - set(DEFAULT_CACHE_DIR_USERS)
    # paths computed from it at import: compile_cache re-points each (codecache's precompiled headers)
    assert import_time <= {"torch._inductor.codecache"}, import_time


@pytest.mark.slow
@needs_root
def test_a_real_compile_never_touches_the_planted_default(tmp_path):
    """The whole attack: the planted default holds, under the names a compile of this function uses,
    modules that write a marker when imported. Compiled through normswap, the function's result is
    right, the marker never appears and nothing is added to the planted directory."""
    shared, planted = _plant(tmp_path)
    marker = tmp_path / "planted-code-ran"
    fn = textwrap.dedent("""
        import torch
        def f(x):
            return torch.nn.functional.rms_norm(x, (8,)) * 3
        x = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    """)
    # what an attacker does first: compile the same function into the planted directory, then
    # make every generated Python module run their code
    r = _child(fn + "torch.compile(f)(x)\n", {"TORCHINDUCTOR_CACHE_DIR": str(planted), "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    modules = [p for p in planted.rglob("*.py")]
    assert modules, "the attacker's compile left no Python module to plant"
    for p in modules:
        p.write_text(f"open({str(marker)!r}, 'w').close()\n" + p.read_text())
    before = sorted(str(p) for p in planted.rglob("*"))
    for p in planted.rglob("*"):
        os.lchown(p, OTHER_UID, OTHER_UID)
    r = _child(
        fn + "from normswap.compile_cache import compiled\nassert torch.equal(compiled(f)(x), f(x))\n",
        {"TMPDIR": str(shared), "NORMSWAP_CACHE_DIR": str(tmp_path / "nscache")},
    )
    assert r.returncode == 0, r.stderr
    assert not marker.exists(), "a module planted in the default Inductor cache ran"
    assert sorted(str(p) for p in planted.rglob("*")) == before
