"""Which implementation `auto` runs, chosen by measuring the candidates on this machine.

A choice is made per shape class (device, dtype, width bucket, few/many rows, with/without
gradient, with/without γ, with/without a fused residual add): the first call of a class times every
candidate at that call's own shape (rows × width, capped at a few million elements; blocks of
back-to-back calls long enough that a GPU's own time counts where it is the bound and host cost
where that is; interleaved repeats, median; a few milliseconds in all), checks each candidate's
output against the reference formula (a candidate that computes in lower precision is dropped,
however fast), and keeps the ranking: in memory for the process, and in a JSON file in the
normswap cache directory so the next process on the same machine, torch and kernel build starts
with it.

Candidates: the records of normswap.kernels.implementations's table marked ``ranked`` that run the kind
of call here (normswap.kernels.choose asks, and takes the first of the ranking that binds) —
normswap's C++ kernel on CPU, its Triton kernels on CUDA, torch's own ``F.rms_norm``, the
composite with a hand-written backward.

``NORMSWAP_AUTOTUNE=0`` skips the measurement and uses the static order cpu/triton, composite.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from normswap.errors import first_line
from normswap.host import load_average
from normswap.kernels import cpu
from normswap.kernels.implementations import FEW_ROWS, TABLE, cpu_ready

_lock = threading.Lock()
_memory: dict = {}  # key tuple -> ranking (list of impl names, best first)
_details: dict = {}  # key tuple -> what was measured (for `normswap bench kernels`)
_disk_loaded = False
FILE_VERSION = 2  # 2: shape classes have γ and residual (1 had neither)


def width_bucket(h: int) -> int:
    """Smallest power of two ≥ h, at least 64."""
    return max(64, 1 << max(0, int(h) - 1).bit_length())


def rows_bucket(rows: int) -> str:
    """'few' rows (decode, latency-bound) or 'many' (prefill and training, bandwidth-bound)."""
    return "few" if rows <= FEW_ROWS else "many"


def enabled() -> bool:
    return os.environ.get("NORMSWAP_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no", "off")


def ranking(
    device: torch.device,
    dtype: torch.dtype,
    h: int,
    rows: int,
    grad: bool,
    *,
    weight: bool = True,
    residual: bool = False,
    candidates: list,
) -> list:
    """``candidates`` (names of the table's records that run this kind here, in the table's order),
    fastest first, for a call of this kind: ``rows`` × ``h`` (the call's own shape, measured at it
    the first time its class is asked), with or without γ and a fused residual add, forward or
    forward+backward."""
    key = _key(device, dtype, h, rows, grad, weight, residual)
    found = _memory.get(key)
    if found is not None:
        return found
    with _lock:
        found = _memory.get(key)
        if found is not None:
            return found
        cands = list(candidates)
        if not enabled() or torch.compiler.is_compiling():
            order = [c for c in cands if c != "native"] + ["native"]
            _memory[key] = order
            _details[key] = {"ranking": order, "measured": False, "why": "NORMSWAP_AUTOTUNE=0: static order"}
            return order
        _load_disk()
        found = _memory.get(key)
        if found is None:
            # the first call of a kind may come from inside no_grad or inference_mode: the
            # measurement needs ordinary tensors and autograd either way
            with torch.inference_mode(False), torch.enable_grad():
                detail = measure(device, dtype, h, key[3], grad, cands, n_rows=rows, weight=weight, residual=residual)
            found = detail["ranking"]
            _memory[key] = found
            _details[key] = detail
            _save_disk()
        return found


def _key(device, dtype, h, rows, grad, weight=True, residual=False) -> tuple:
    """A shape class: device, dtype, width bucket, few/many rows, gradient, γ, fused residual."""
    return (
        _device_key(device),
        str(dtype).replace("torch.", ""),
        width_bucket(h),
        rows_bucket(rows),
        bool(grad),
        bool(weight),
        bool(residual),
    )


def choices() -> list:
    """Every choice made or loaded in this process, with its measurements (for reports)."""
    out = []
    for key, detail in sorted(_details.items(), key=lambda kv: str(kv[0])):
        out.append(dict(zip(KEY_FIELDS, key)) | detail)
    return out


KEY_FIELDS = ("device", "dtype", "width_bucket", "rows", "grad", "weight", "residual")


def forget() -> None:
    """Drop the in-memory rankings (the on-disk file is read again on the next ranking asked)."""
    global _disk_loaded
    with _lock:
        _memory.clear()
        _details.clear()
        _disk_loaded = False


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------


# the most elements a measurement's input holds: its candidates are timed at the call's own shape up
# to this (a CPU measurement stays within tens of milliseconds, a GPU one within a few)
_MAX_ELEMENTS = {"cuda": 1 << 26, "cpu": 1 << 21}
# how long one timed block of back-to-back calls lasts at least: long enough that a GPU's own time
# decides where it is the bound, and the host's (launches, Python) where that is, as in a model
# whose calls are queued one after another; synchronising after every call would let host cost decide
_BLOCK_S = {"cuda": 1e-3, "cpu": 2e-4}


def _shape(device: torch.device, width: int, rows: str, n_rows: int | None = None) -> tuple:
    if n_rows is None:  # no call to copy: a typical shape of the class
        n_rows = 4 if rows == "few" else max(32, (1 << (22 if device.type == "cuda" else 17)) // width)
    cap = _MAX_ELEMENTS.get(device.type, 1 << 21) // max(1, width)
    return max(1, min(int(n_rows), cap)), width


def measure(
    device, dtype, width, rows, grad, cands, repeats: int = 7, *, n_rows=None, weight=True, residual=False
) -> dict:
    """Time each candidate (forward, or forward+backward) on a call of this kind and rank the ones
    whose output agrees with the reference formula."""
    from normswap.kernels.reference import normalize

    def call_impl(name, x, weight, residual, eps):
        return TABLE[name].run(x, weight, None, residual, eps)

    n, h = _shape(device, width, rows, n_rows)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(n, h, generator=g) * 2).to(device=device, dtype=dtype)
    w = (torch.rand(h, generator=g) + 0.5).to(device=device, dtype=dtype) if weight else None
    r = torch.randn(n, h, generator=g).to(device=device, dtype=dtype) if residual else None
    dy = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    ref = normalize(x, w, 1e-5, r)[0].double()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-5)
    scale = ref.abs().max().item()
    usable, rejected = [], {}
    for c in cands:
        try:
            with torch.no_grad():
                y = call_impl(c, x, w, r, 1e-5)
            y = y[0] if residual else y
            err = (y.double() - ref).abs().max().item() / scale
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run is simply not chosen
            rejected[c] = f"failed: {type(e).__name__}: {first_line(e, 120)}"
            continue
        if not err <= tol:
            rejected[c] = f"output differs from the reference by {err:.2g} (> {tol:.2g} relative)"
            continue
        usable.append(c)
    xg = x.detach().requires_grad_()
    wg = w.detach().requires_grad_() if weight else None
    inputs = tuple(t for t in (xg, wg) if t is not None)

    def run(c):
        if grad:
            y = call_impl(c, xg, wg, r, 1e-5)
            torch.autograd.grad(y[0] if residual else y, inputs, dy)
        else:
            with torch.no_grad():
                call_impl(c, x, w, r, 1e-5)

    cuda = device.type == "cuda"

    def block(c, calls):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            run(c)
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    calls = {}
    for c in usable:  # warm-up (Triton compiles, caches fill), then calls enough for a block's length
        run(c)
        once = max(block(c, 1), 1e-7)
        calls[c] = max(3, min(1000, int(_BLOCK_S.get(device.type, 2e-4) / once) + 1))
    samples = {c: [] for c in usable}
    for rep in range(repeats):
        order = usable if rep % 2 == 0 else usable[::-1]
        for c in order:
            samples[c].append(block(c, calls[c]) / calls[c])
    medians = {c: statistics.median(v) * 1e6 for c, v in samples.items()}
    order = sorted(usable, key=lambda c: medians[c]) + [c for c in cands if c not in usable]
    best = order[0]
    others = ", ".join(f"{c} {medians[c]:.1f} µs" for c in order[1:] if c in medians)
    what = ("fwd+bwd" if grad else "fwd") + (", γ" if weight else "") + (", +residual" if residual else "")
    return {
        "ranking": order,
        "measured": True,
        "shape": [n, h],
        "calls_per_block": calls,
        "us": {c: round(v, 2) for c, v in medians.items()},
        "rejected": rejected,
        "why": f"{best} {medians[best]:.1f} µs a call at {n}×{h} ({what})"
        + (f" (vs {others})" if others else "")
        + "".join(f"; {c} {why}" for c, why in rejected.items()),
        "loadavg": load_average(ndigits=None),
    }


# ---------------------------------------------------------------------------------------------
# on-disk cache
# ---------------------------------------------------------------------------------------------


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index or 0}"
    return device.type


def _machine_id() -> str:
    """What a stored choice is only valid for: the processor(s), torch, triton and the CPU build."""
    parts = [torch.__version__]
    if torch.cuda.is_available():
        parts += [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        pass
    ext = cpu.extension() if cpu_ready() else None
    parts.append(ext.__name__ if ext is not None else "no cpu kernel")
    parts.append(f"{os.cpu_count()} cpus, {torch.get_num_threads()} threads")
    return " | ".join(parts)


def cache_file() -> Path:
    """Where the table lives (the configured cache root; loaded only when private, see _load_disk)."""
    from normswap.private_dirs import cache_root

    return cache_root() / "autotune.json"


def _load_disk() -> None:
    """Read the stored choices, only from a private cache (a table another user could write would
    choose which code runs): a directory or file that fails normswap.private_dirs' check is ignored."""
    from normswap.private_dirs import check_private_dir, read_private_text

    global _disk_loaded
    if _disk_loaded:
        return
    _disk_loaded = True
    path = cache_file()
    if check_private_dir(path.parent) is not None:
        return
    try:
        data = json.loads(read_private_text(path) or "null")
    except ValueError:
        return
    if not isinstance(data, dict) or data.get("version") != FILE_VERSION:
        return
    for entry in data.get("machines", {}).get(_machine_id(), []):
        try:
            key = (
                entry["device"],
                entry["dtype"],
                int(entry["width_bucket"]),
                entry["rows"],
                bool(entry["grad"]),
                bool(entry["weight"]),
                bool(entry["residual"]),
            )
        except (KeyError, TypeError, ValueError):
            continue
        detail = {k: v for k, v in entry.items() if k not in KEY_FIELDS}
        if isinstance(detail.get("ranking"), list) and detail["ranking"]:
            _memory.setdefault(key, detail["ranking"])
            _details.setdefault(key, {**detail, "why": "cached: " + str(detail.get("why", ""))})


def _save_disk() -> None:
    from normswap.private_dirs import (
        NotPrivate,
        ensure_private_dir,
        read_private_text,
        write_private_text,
    )

    path = cache_file()
    try:
        ensure_private_dir(path.parent)
        try:
            data = json.loads(read_private_text(path) or "{}")
            if not isinstance(data, dict) or data.get("version") != FILE_VERSION:
                data = {}
        except ValueError:
            data = {}
        machines = data.setdefault("machines", {})
        mine = {tuple(e.get(f) for f in KEY_FIELDS): e for e in machines.get(_machine_id(), []) if isinstance(e, dict)}
        for key, detail in _details.items():
            if detail.get("measured"):
                d = {k: v for k, v in detail.items() if k != "why" or not str(v).startswith("cached: ")}
                mine[key] = dict(zip(KEY_FIELDS, key)) | d
        machines[_machine_id()] = list(mine.values())
        data["version"] = FILE_VERSION
        write_private_text(path, json.dumps(data, indent=1))
    except (OSError, NotPrivate):
        pass  # a read-only or shared cache only costs a re-measurement in the next process
