"""CPU fast path for (fused add +) RMSNorm, forward and backward.

Why this exists: on CPU, torch's ``F.rms_norm`` is a composite of several passes and runs
several times slower than ``F.layer_norm`` (a fused, vectorised ATen kernel), so a converted
model would get slower on CPU because of its norms. The kernel here is a small C++ extension
(``csrc/``) built with ``torch.utils.cpp_extension.load`` at first use and cached; every caller
must treat it as optional: :func:`available` returns False (and never raises) when there is no
compiler or ninja or when building fails, and the chooser then runs another implementation.
Whether it is asked at all is the ``cpu`` record's call (normswap.kernels.implementations: with
``NORMSWAP_CPU_KERNEL=0`` it is never built or run).

Build and cache:
* The cache directory is ``$NORMSWAP_CACHE_DIR`` or ``$XDG_CACHE_HOME/normswap`` (default
  ``~/.cache/normswap``), sub-directory ``cpu_kernel/<name>``, used only when it is private
  (``normswap.private_dirs.cache_dir``: created 0700; an existing one must be the user's and
  writable by nobody else, else ``$TMPDIR/normswap-<uid>`` under the same check, else a fresh
  ``mkdtemp`` directory, and the skip is said), because the ``.so`` found there is loaded and
  run. Private includes the way to it: no directory from ``/`` down can be renamed or replaced by
  another user (``private_dirs.why_replaceable``), so nobody can swap the tree during the build.
* The library is loaded through a handle on the build directory opened and checked before the
  build (``private_dirs.open_private_dir``): torch's own import of the library by path is
  replaced by ``dlopen`` of ``/proc/self/fd/N`` of the ``.so`` opened there with ``O_NOFOLLOW``
  and checked with ``fstat`` (ours, written by nobody else). If the path no longer names that
  directory when the build ends, nothing is loaded and the reason is kept.
* The build's name carries a hash of everything that changes the build: the C++ sources, the compile
  flags, the compiler, torch (its version and where it is installed), the interpreter (ABI tag,
  ``sys.prefix``) and the include paths. A changed source, a torch upgrade or a second virtualenv
  gets its own build instead of loading (or rebuilding over) another's library. Where the checkout
  lies is not part of it: the sources are copied into the build directory (``src/``) and built
  from there, so torch's build.ninja names the same paths for every checkout of the same sources,
  and a fresh clone (another worktree) reuses the library instead of building it again.
* Concurrent processes are safe, and a killed build blocks nobody: the build runs under an
  ``flock`` on ``cpu_kernel/<name>.lock``, which the kernel releases when its holder dies. Under
  that lock, a ``lock`` file that torch's loader left in the build directory (its FileBaton,
  which a killed process never removes and torch would wait on forever) is known to be stale and
  is removed. A first build says so in one line on stderr (it takes about a minute).
* No ``-march=native``: the library contains a baseline x86-64 variant and an AVX2/FMA/F16C
  variant and chooses at load time from the CPU flags, so the cached build is portable between
  machines (a shared home directory, a copied cache) and never executes an illegal instruction.
* Compiler output goes to a log in the build directory, never to the terminal; if the build
  fails the reason is kept (:func:`unavailable_reason`) and logged at DEBUG level.

Numerics (documented cast order): statistics in fp32; ``y = cast((x * rstd) * w)`` with ``w``
converted to fp32 — normalise in fp32, multiply by the weight in fp32, round once to x's dtype.
With a residual, ``summed = cast(x + residual)`` is rounded to x's dtype first and the rounded
tensor is what is normalised (it is also what the backward receives), matching an unfused
``h = x + residual; norm(h)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import logging
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch

from normswap.errors import first_line
from normswap.progress import announced

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("rms_norm_cpu.cpp", "rms_norm_cpu_kernel.h")
# -O3 for the inner loops; -fno-math-errno/-fno-trapping-math (as torch itself builds) let sqrt
# become one instruction; no -ffast-math, so NaN/inf propagate and the summation order is the one
# the source spells out; -ffp-contract=off because GCC would otherwise fuse `y * w + bias` into
# one FMA in the AVX2 variant, and the bias must round exactly as a separate `y + bias` does.
BUILD_MESSAGE = "building normswap's C++ norm kernel (first use, ~1 min; cached in {where})…"
_BASE_CFLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-Wno-unused-function"]

_lock = threading.Lock()
_fd_loads = itertools.count(1)  # see _import_at
_ext = None
_tried = False
_reason: str | None = None

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _flags() -> tuple[list[str], list[str]]:
    cflags = list(_BASE_CFLAGS)
    ldflags: list[str] = []
    # ATen's OpenMP backend implements at::parallel_for inline (`#pragma omp parallel` in a
    # header): without -fopenmp the kernel would silently run on one thread. Linking -fopenmp
    # records libgomp.so.1, which the loader resolves to the copy torch already loaded, so both
    # share one thread pool.
    if torch.backends.openmp.is_available():
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return cflags, ldflags


def _build_key() -> tuple:
    """Everything besides sources and flags that changes what the build produces."""
    import sysconfig

    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    # Not where the sources lie: they are built from their copy in the build directory (_stage_sources),
    # whose path the name already decides, so every checkout of the same sources shares one build.
    return (
        torch.__version__,
        str(Path(torch.__file__).resolve().parent),
        sys.implementation.cache_tag,
        sys.platform,
        sys.prefix,
        sysconfig.get_paths().get("include"),
        tuple(cpp_extension.include_paths()),
        cxx,
        shutil.which(cxx),
    )


def _source_bytes(csrc: Path | None = None) -> dict[str, bytes]:
    csrc = _CSRC if csrc is None else csrc
    return {name: (csrc / name).read_bytes() for name in _SOURCES}


def _build_name(cflags: list[str], ldflags: list[str], key: tuple | None = None, sources=None) -> str:
    h = hashlib.sha256()
    for name, data in (_source_bytes() if sources is None else sources).items():
        h.update(name.encode())
        h.update(data)
    h.update(repr((cflags, ldflags, _build_key() if key is None else key)).encode())
    return "normswap_cpu_" + h.hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold the build directory's lock (dies with its holder); clear torch's stale baton under it."""
    import fcntl

    from normswap.private_dirs import open_private

    with os.fdopen(open_private(build_dir.parent / f"{build_dir.name}.lock", os.O_RDWR | os.O_CREAT), "r+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"normswap: waiting for another process that is building the CPU kernel in {build_dir}", file=sys.stderr
            )
            fcntl.flock(f, fcntl.LOCK_EX)
        # only a normswap process under this lock builds here: a baton file now is a dead build's
        with contextlib.suppress(FileNotFoundError):
            (build_dir / "lock").unlink()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_dir(name: str) -> Path:
    """Where this build lives: a private directory (normswap.private_dirs), never one another user
    could have planted a library in."""
    from normswap.private_dirs import cache_dir

    return cache_dir("cpu_kernel", name)


def _compiler_missing() -> str | None:
    from torch.utils import cpp_extension

    if not sys.platform.startswith("linux"):
        # The sources use GCC vector extensions and pragmas and have only been built with GCC on
        # Linux; elsewhere the torch path is used rather than risking a half-working build.
        return f"CPU kernel is only built on Linux (this is {sys.platform})"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found on PATH)"
    return None


def _load():
    from normswap.private_dirs import NotPrivate, is_same_dir, open_private_dir

    cflags, ldflags = _flags()
    sources = _source_bytes()  # read once: the bytes hashed into the name are the bytes built
    name = _build_name(cflags, ldflags, sources=sources)
    build_dir = _build_dir(name)
    dir_fd = open_private_dir(build_dir)  # checked once; the library is loaded through this handle
    try:
        with _build_lock(build_dir):
            first = not (build_dir / f"{name}.so").exists()
            # said as what it is (through the running command's progress, normswap/progress.py): a
            # minute of "still: verifying" read as a hang
            with announced(BUILD_MESSAGE.format(where=build_dir)) if first else contextlib.nullcontext():
                module_name = _build(
                    name, build_dir, cflags, ldflags, dir_fd, _stage_sources(dir_fd, build_dir, sources)
                )
            if not is_same_dir(dir_fd, build_dir):
                raise NotPrivate(
                    f"{build_dir} was replaced while the kernel was built (a directory on its way renamed?); "
                    "the library is not loaded"
                )
            return _import_at(dir_fd, module_name, build_dir)
    finally:
        os.close(dir_fd)


def _stage_sources(dir_fd: int, build_dir: Path, sources: dict[str, bytes]) -> Path:
    """The sources copied into ``build_dir/src`` (a directory of ours inside the private build
    directory, reached through its handle, never through a link); a copy already there with these
    bytes is left as it is, so ninja finds the build up to date."""
    from normswap.private_dirs import NotPrivate

    with contextlib.suppress(FileExistsError):
        os.mkdir("src", 0o700, dir_fd=dir_fd)
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    src_fd = os.open("src", flags, dir_fd=dir_fd)
    try:
        st = os.fstat(src_fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise NotPrivate(f"{build_dir / 'src'} is not ours alone; the kernel is not built from it")
        for name, data in sources.items():
            try:
                with os.fdopen(os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=src_fd), "rb") as f:
                    if f.read() == data:
                        continue
            except FileNotFoundError:
                pass
            tmp = f".{name}.{os.getpid()}"
            wflags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
            with os.fdopen(os.open(tmp, wflags, 0o600, dir_fd=src_fd), "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=src_fd, dst_dir_fd=src_fd)
    finally:
        os.close(src_fd)
    return build_dir / "src"


def _build(name: str, build_dir: Path, cflags, ldflags, dir_fd: int, csrc: Path) -> str:
    """Compile the library with torch's cpp_extension (or find it up to date) without letting torch
    import it by path; returns the module name torch would have imported (``name``, or
    ``name_vN`` when torch re-versions a rebuild within one process)."""
    from unittest import mock

    from torch.utils import cpp_extension

    if not hasattr(cpp_extension, "_import_module_from_library"):
        raise RuntimeError(
            "this torch's cpp_extension has no _import_module_from_library: normswap cannot build the kernel "
            "without torch loading it by path"
        )
    built = []
    sink = io.StringIO()
    # torch prints nothing with verbose=False, but compiler-compatibility notes arrive as
    # warnings and a failing build writes to stdout/stderr: keep all of it off the terminal.
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(sink),
        contextlib.redirect_stderr(sink),
        mock.patch.object(
            cpp_extension, "_import_module_from_library", lambda module_name, *a, **k: built.append(module_name)
        ),
    ):
        warnings.simplefilter("ignore")
        try:
            cpp_extension.load(
                name=name,
                sources=[str(csrc / "rms_norm_cpu.cpp")],
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                extra_include_paths=[str(csrc)],
                build_directory=str(build_dir),
                verbose=False,
            )
        finally:
            _keep_log(dir_fd, sink.getvalue())
    return built[-1] if built else name


def _keep_log(dir_fd: int, text: str) -> None:
    if not text:
        return
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    with contextlib.suppress(OSError):
        with os.fdopen(os.open("build.log", flags, 0o600, dir_fd=dir_fd), "w") as f:
            f.write(text)


def _import_at(dir_fd: int, module_name: str, build_dir: Path):
    """Import the extension ``module_name`` from the directory handle ``dir_fd``: the ``.so`` is
    opened there without following a link, checked open, and loaded as ``/proc/self/fd/N``."""
    from normswap.private_dirs import open_private_file

    fd = open_private_file(dir_fd, f"{module_name}.so", where=build_dir, made_here=True)
    try:
        # glibc's dlopen hands back an already-loaded library whose name matches before it looks at
        # the file, and Python keeps extension modules by path: fd numbers are reused, so each load
        # gets a spelling of /proc/self/fd/N never used before in this process
        return _exec_extension(module_name, "/proc/self/" + "./" * next(_fd_loads) + f"fd/{fd}")
    finally:
        os.close(fd)  # the library stays mapped


def _exec_extension(module_name: str, path: str):
    """Load a Python extension module from ``path`` (dlopen, then its ``PyInit_<module_name>``)."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(module_name, path)
    spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _ensure():
    """Return the extension module or None; builds at most once per process."""
    global _ext, _tried, _reason
    if _ext is not None:
        return _ext
    if _tried:
        return None
    with _lock:
        if _tried:
            return _ext
        try:
            _reason = _compiler_missing()
            if _reason is None:
                _ext = _load()
        except Exception as exc:  # never raise: the caller falls back to torch
            _ext = None
            _reason = f"CPU kernel build failed: {first_line(exc)}"
            log.debug("normswap CPU kernel unavailable", exc_info=True)
        _tried = True
        return _ext


def available() -> bool:
    """True when the compiled CPU kernel is built and loaded (builds it on the first call)."""
    if _ext is not None:
        return True
    try:
        return _ensure() is not None
    except Exception:  # pragma: no cover - _ensure already guards; belt and braces for "never raises"
        return False


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True or has not been asked yet)."""
    return None if _ext is not None else _reason


def supports(dtype: torch.dtype) -> bool:
    """Whether the compiled kernel handles this dtype (float32, bfloat16, float16 with GCC)."""
    name = _DTYPE_NAMES.get(dtype)
    return name is not None and available() and bool(_ext.supports(name))


def isa() -> str | None:
    """The instruction-set variant in use ('avx2' or 'baseline'), None when unavailable."""
    return _ext.isa() if available() else None


_COMPILED_DTYPES: frozenset = frozenset()  # filled once the extension has loaded


def _compiled_dtypes(ext) -> frozenset:
    global _COMPILED_DTYPES
    if not _COMPILED_DTYPES:
        _COMPILED_DTYPES = frozenset(d for d, n in _DTYPE_NAMES.items() if ext.supports(n))
    return _COMPILED_DTYPES


def _torch_forward(x, weight, residual, eps):
    # Dtypes the compiled kernel does not cover (float64; float16 without compiler support):
    # the same contract through the one plain-torch formula.
    from normswap.kernels.reference import normalize

    y, rstd, summed = normalize(x, weight, eps, residual)
    return y, rstd.float(), summed


def _torch_backward(dy, x, rstd, weight, compute_dweight):
    from normswap.kernels.reference import backward as reference_backward

    dx, dw = reference_backward(dy, x, rstd, weight)
    return dx, (dw.float() if dw is not None and compute_dweight else None)


def forward(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float):
    """RMSNorm over the last dim of a contiguous [N, H] CPU tensor.

    Returns ``(y, rstd, summed)``: y in x's dtype, rstd float32 [N], summed = x + residual in
    x's dtype (None without residual). Not differentiable by itself; see :func:`backward`.
    A dtype the compiled kernel does not cover (:func:`supports` is False, e.g. float64) is
    computed with plain torch under the same contract, so callers need not check per dtype.
    """
    ext = _ext if _ext is not None else _ensure()
    if ext is None:
        raise RuntimeError(f"normswap CPU kernel is not available: {unavailable_reason()}")
    if x.dtype not in _compiled_dtypes(ext):
        return _torch_forward(x, weight, residual, float(eps))
    return ext.forward(x, weight, residual, float(eps))


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    compute_dweight: bool = True,
):
    """Gradients of :func:`forward`. ``x`` is the tensor that was normalised (x + residual when
    a residual was fused). Returns ``(dx, dweight)``: dx in x's dtype, dweight float32 [H], or
    None when there is no weight or ``compute_dweight`` is False."""
    ext = _ext if _ext is not None else _ensure()
    if ext is None:
        raise RuntimeError(f"normswap CPU kernel is not available: {unavailable_reason()}")
    if x.dtype not in _compiled_dtypes(ext):
        return _torch_backward(dy, x, rstd, weight, bool(compute_dweight))
    return ext.backward(dy, x, rstd, weight, bool(compute_dweight))


def extension():
    """The loaded C++ extension module (None until available() has built or loaded it)."""
    return _ext


def force_isa(name: str) -> bool:
    """Force the compiled kernel's instruction set: 'baseline', 'avx2' or 'best' (a testing and
    benchmark hook, offered as normswap.testing.cpu_isa). False if not possible here."""
    return bool(available() and _ext.set_isa(name))
