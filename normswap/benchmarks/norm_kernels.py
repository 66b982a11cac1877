"""Kernel benchmark: torch LayerNorm vs torch's RMSNorm vs normswap's RMSNorm, through the public
API (`normswap.kernels.rms_norm`) and the module converted models call (`normswap.modules.RMSNorm`).

`normswap bench kernels` is the command-line entry point (normswap/cli/bench_command.py); this
module is the benchmark.

For each shape, dtype and mode (forward; forward+backward) and variant (plain; residual add
fused in), every implementation is timed on the same inputs and reported as median time,
achieved bandwidth over the bytes the operation must move at minimum (the same nominal bytes for
every implementation of a row, so GB/s compare directly), and its time ratio to LayerNorm.

Tiny shapes (1 and 4 rows, H from 64 to 1024) get their own table of per-call times, module
against module (nn.LayerNorm vs the converted model's RMSNorm) and function against function:
there the cost is the call itself (Python, dispatch, autograd), not memory traffic.

The result also lists what `auto` chose on this device for each kind of call, and the
measurements it chose by (normswap.kernels.autotune).

Timing method: normswap's one timing instrument, normswap/timing.py — every implementation of a
row against LayerNorm (the row's baseline) in interleaved pairs, order alternating, the median of
per-pair speed ratios with a bootstrap interval, and a null control (LayerNorm again, with its own
copy of γ and β) timed in the same rounds; pairs are added until every interval is within
``target`` or the row's ``budget`` seconds run out (the row records which). ``vs_layer_norm`` is
time ÷ LayerNorm's (1 / the paired speed ratio; below 1 is faster); ``speed`` holds the paired
speed ratio itself with its interval and verdict.
- CUDA: a block is CUDA-graph replays of a sweep over several distinct input sets whose total size
  exceeds 3× the L2 cache (so no input is served from L2), read by a CUDA-event clock; eager
  sweeps are timed the same way (``eager_ms``); the device copy bandwidth is measured in the same
  run so every kernel's share of it can be reported.
- CPU: time.perf_counter around a block of calls, each on the next input set.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from normswap import timing
from normswap.kernels import autotune, backend_for, rms_norm
from normswap.modules import RMSNorm
from normswap.publish import open_append

EPS = 1e-5

CPU_SHAPES = [(16384, 256), (8192, 768), (4096, 2048), (2048, 4096)]
CPU_DTYPES = ["float32", "bfloat16"]
CUDA_SHAPES = [(r, h) for r in (4096, 8192, 16384) for h in (768, 2048, 4096, 8192)]
CUDA_DTYPES = ["bfloat16"]
QUICK_SHAPES = [(1024, 256), (512, 1024)]

NULL = "null control"
BLOCK_S = 0.01  # seconds per timed block on the CPU: short, so the host barely changes within a pair
DEFAULT_BUDGET_S = {"cpu": 4.0, "cuda": 4.0, "quick": 0.5}  # seconds of pairs per row at most
TINY_ROWS = (1, 4)
TINY_HIDDEN = (64, 256, 1024)

IMPLS = ["layer_norm", "torch_rms_norm", "normswap", "normswap_weight"]
# RMSNorm_module: a converted layer norm (γ folded away); RMSNorm_affine: γ and β kept (a tied
# model's final norm), the like-for-like counterpart of nn.LayerNorm; torch_rms_norm: F.rms_norm.
TINY_IMPLS = ["LayerNorm_module", "RMSNorm_module", "RMSNorm_affine", "layer_norm", "normswap", "torch_rms_norm"]
RESIDUAL_IMPLS = ["add_layer_norm", "add_torch_rms_norm", "add_normswap", "normswap_fused"]


@dataclass
class Case:
    rows: int
    hidden: int
    dtype: torch.dtype
    variant: str  # "plain" | "residual"
    mode: str  # "fwd" | "fwd+bwd"

    def nominal_bytes(self) -> int:
        """Minimum traffic: forward reads x, writes y (residual: also reads r, writes x+r);
        backward reads dy and x, writes dx (residual: also reads the sum's own gradient)."""
        s = self.rows * self.hidden * torch.tensor([], dtype=self.dtype).element_size()
        fwd, bwd = (4 * s, 4 * s) if self.variant == "residual" else (2 * s, 3 * s)
        return fwd + (bwd if self.mode == "fwd+bwd" else 0)


def _make_inputs(case: Case, device, count: int, seed: int):
    # generated on the device itself: CPU randn of several 256 MB tensors would dominate a GPU run
    g = torch.Generator(device=device).manual_seed(seed)
    sets = []
    shape = (case.rows, case.hidden)

    def rnd():
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(case.dtype)

    for _ in range(count):
        x = rnd()
        r = rnd() if case.variant == "residual" else None
        dy = rnd() if case.mode == "fwd+bwd" else None
        ds = rnd() if (dy is not None and r is not None) else None
        if case.mode == "fwd+bwd":
            x.requires_grad_()
            if r is not None:
                r.requires_grad_()
        sets.append((x, r, dy, ds))
    return sets


def _params(case: Case, device):
    grad = case.mode == "fwd+bwd"
    w = torch.ones(case.hidden, device=device, dtype=case.dtype).add_(0.01).requires_grad_(grad)
    b = torch.zeros(case.hidden, device=device, dtype=case.dtype).requires_grad_(grad)
    return w, b


def _impl_fns(case: Case, w, b) -> dict[str, Callable]:
    """name -> fn(x, r) returning the output(s) a model would use."""
    h = (case.hidden,)
    if case.variant == "plain":
        return {
            "layer_norm": lambda x, r: F.layer_norm(x, h, w, b, EPS),
            "torch_rms_norm": lambda x, r: F.rms_norm(x, h, w, EPS),
            "normswap": lambda x, r: rms_norm(x, None, EPS),  # public API, weightless as exact convert emits
            "normswap_weight": lambda x, r: rms_norm(x, w, EPS),
        }

    def add_then(norm):
        def fn(x, r):
            s = x + r
            return norm(s), s

        return fn

    return {
        "add_layer_norm": add_then(lambda s: F.layer_norm(s, h, w, b, EPS)),
        "add_torch_rms_norm": add_then(lambda s: F.rms_norm(s, h, w, EPS)),
        "add_normswap": add_then(lambda s: rms_norm(s, w, EPS)),
        "normswap_fused": lambda x, r: rms_norm(x, w, EPS, residual=r),
    }


def _runner(case: Case, fn, leaves_of):
    if case.mode == "fwd":

        def run(inp):
            x, r, _, _ = inp
            with torch.no_grad():
                fn(x, r)

        return run

    def run(inp):
        x, r, dy, ds = inp
        out = fn(x, r)
        leaves = leaves_of(x, r)
        if isinstance(out, tuple):
            torch.autograd.grad(list(out), leaves, [dy, ds])
        else:
            torch.autograd.grad(out, leaves, dy)

    return run


def measure_copy_gbps(device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth (read + write) measured with CUDA events."""
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n * 2 / statistics.median(times) / 1e9


def _l2_bytes(device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 60 * 2**20)


def _cycling(run, sets):
    """A zero-argument call of ``run`` on the next input set, round and round."""
    it = itertools.cycle(sets)
    return lambda: run(next(it))


def _cuda_clock(device):
    """Seconds on the device's own timeline: each read records a CUDA event and waits for it."""
    origin = torch.cuda.Event(enable_timing=True)
    origin.record()
    origin.synchronize()

    def clock():
        now = torch.cuda.Event(enable_timing=True)
        now.record()
        now.synchronize()
        return origin.elapsed_time(now) / 1e3

    return clock


def _paired(fns, base, device, *, calls, budget, target, max_pairs, warmup=2):
    """normswap/timing.py on ``fns`` against ``fns[base]``, with ``fns[NULL]`` its second copy."""
    cuda = device.type == "cuda"
    clock = _cuda_clock(device) if cuda else time.perf_counter  # looked up now: tests plant a clock
    if calls is None:  # each its own: the composite, ~3-12x LayerNorm's time, would otherwise fill every round
        calls = {n: timing.calibrate_calls(f, BLOCK_S, clock=clock) for n, f in fns.items() if n != NULL}
        calls[NULL] = calls[base]  # the null control is the baseline's copy: the same blocks
    return timing.compare(
        fns, base, NULL, calls_per_sample=calls, target_halfwidth=target, budget_s=budget,
        min_pairs=min(20, max_pairs), max_pairs=max_pairs, warmup=warmup, clock=clock,
    )  # fmt: skip


def _timed(cmp, name) -> dict:
    """One implementation's numbers from a comparison: seconds per call (median, fastest block) and,
    against the baseline, the paired speed ratio with its interval and verdict."""
    out = {"median_s": cmp.seconds_per_call[name], "min_s": cmp.fastest_seconds_per_call[name]}
    out["speed"] = cmp[name].to_json() if name != cmp.baseline else None
    out["vs_base"] = 1.0 / cmp[name].ratio if name != cmp.baseline else 1.0
    return out


def time_case(case: Case, device, repeats: int, warmup: int = 2, seed: int = 0, *, budget: float, target: float):
    """(name -> timings per call (:func:`_timed`, plus ``eager_s`` and ``timing``), the comparison)."""
    per_set = case.rows * case.hidden * torch.tensor([], dtype=case.dtype).element_size()
    per_set *= 1 + (case.variant == "residual") + (case.mode == "fwd+bwd") * (1 + (case.variant == "residual"))
    cuda = device.type == "cuda"
    if cuda:
        count = max(2, math.ceil(3 * _l2_bytes(device) / per_set))
    else:
        count = max(1, min(4, math.ceil((64 << 20) / per_set)))
    sets = _make_inputs(case, device, min(count, 64), seed)
    base = "layer_norm" if case.variant == "plain" else "add_layer_norm"
    runs = _case_runs(case, device, base)
    for run in runs.values():  # warm up: compile kernels, build the CPU extension, fill allocators
        for i in range(warmup):
            run(sets[i % len(sets)])
    paired = dict(calls=None, budget=budget, target=target, max_pairs=repeats, warmup=0)
    if not cuda:
        cmp = _paired({n: _cycling(r, sets) for n, r in runs.items()}, base, device, **paired)
        return {n: _timed(cmp, n) | {"eager_s": None, "timing": "perf_counter"} for n in runs if n != NULL}, cmp
    torch.cuda.synchronize(device)
    # Kernel time without the host: each sweep is also captured in a CUDA graph and replayed.
    # Eager sweeps are timed too (what an eager training loop sees, launch overhead and all); on
    # small shapes the two differ because Python, not the GPU, is the bottleneck.
    eager_fns = {n: (lambda run=r: [run(inp) for inp in sets]) for n, r in runs.items()}
    graphs = {n: _capture(r, sets, device) for n, r in runs.items()}
    replays = {n: (g.replay if g is not None else eager_fns[n]) for n, g in graphs.items()}
    cmp = _paired(replays, base, device, **paired)
    eager = _paired(eager_fns, base, device, **paired)
    out = {}
    for n in runs:
        if n != NULL:
            t = {k: v / len(sets) for k, v in _timed(cmp, n).items() if k.endswith("_s")}
            out[n] = _timed(cmp, n) | t | {"eager_s": eager.seconds_per_call[n] / len(sets)}
            out[n]["timing"] = "cuda-graph" if graphs[n] is not None else "eager"
    return out, cmp


def _case_runs(case: Case, device, base: str) -> dict:
    """name -> run(input set) for every implementation of the row, and the null control: the
    baseline again. Every one gets its own copy of γ and β (another address, the same values): the
    null control had its own while the baseline shared its copy with the candidates, and on the
    forward+backward rows of one probe the null then read 0.959 and 0.945; with a copy each, 0.992 and
    1.005."""
    w0, b0 = _params(case, device)

    def own():
        return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in (w0, b0))

    def leaves_of(name, w, b):
        def f(x, r):
            out = [x] + ([r] if r is not None else [])
            if name != "normswap":  # the weightless variant has no γ to differentiate
                out.append(w)
            if name in ("layer_norm", "add_layer_norm"):
                out.append(b)
            return out

        return f

    runs = {}
    for name in [*_impl_fns(case, w0, b0), NULL]:
        w, b = own()
        impl = base if name == NULL else name
        runs[name] = _runner(case, _impl_fns(case, w, b)[impl], leaves_of(impl, w, b))
    return runs


def _event_time(fn) -> float:
    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    e.record()
    e.synchronize()
    return a.elapsed_time(e) / 1e3


def _capture(run, sets, device):
    """A CUDA graph of one sweep over all input sets, or None if this implementation cannot be
    captured (then its eager time is reported instead, and marked so)."""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # capture needs warm-up on a side stream
            for inp in sets:
                run(inp)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for inp in sets:
                run(inp)
        graph.replay()
        torch.cuda.synchronize(device)
        return graph
    except Exception:  # noqa: BLE001 - any capture failure just means "time it eagerly"
        torch.cuda.synchronize(device)
        return None


def time_tiny(device, rows: int, hidden: int, dtype, mode: str, repeats: int, *, budget: float, target: float):
    """Per-call µs of each TINY_IMPLS entry at rows × hidden, and the two null controls: modules
    against nn.LayerNorm and functions against F.layer_norm, each group in its own interleaved
    pairs (normswap/timing.py) with its baseline's second copy as the null control."""
    grad = mode == "fwd+bwd"
    ln_mod, ln_again = (torch.nn.LayerNorm(hidden, eps=EPS, device=device, dtype=dtype) for _ in range(2))
    rms_mod = RMSNorm(hidden, eps=EPS, elementwise_affine=False, device=device, dtype=dtype)
    rms_affine = RMSNorm(hidden, eps=EPS, bias=True, device=device, dtype=dtype)
    for m in (ln_mod, ln_again, rms_affine):
        m.requires_grad_(grad)
    w, w2 = (torch.ones(hidden, device=device, dtype=dtype, requires_grad=grad) for _ in range(2))
    b, b2 = (torch.zeros(hidden, device=device, dtype=dtype, requires_grad=grad) for _ in range(2))
    x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=grad)
    dy = torch.randn(rows, hidden, device=device, dtype=dtype)
    h = (hidden,)
    groups = {
        "LayerNorm_module": {
            "LayerNorm_module": (lambda: ln_mod(x), [x, ln_mod.weight, ln_mod.bias]),
            "RMSNorm_module": (lambda: rms_mod(x), [x]),
            "RMSNorm_affine": (lambda: rms_affine(x), [x, rms_affine.weight, rms_affine.bias]),
            NULL: (lambda: ln_again(x), [x, ln_again.weight, ln_again.bias]),
        },
        "layer_norm": {
            "layer_norm": (lambda: F.layer_norm(x, h, w, b, EPS), [x, w, b]),
            "normswap": (lambda: rms_norm(x, None, EPS), [x]),
            "torch_rms_norm": (lambda: F.rms_norm(x, h, None, EPS), [x]),
            NULL: (lambda: F.layer_norm(x, h, w2, b2, EPS), [x, w2, b2]),
        },
    }

    def runner(fn, leaves):
        if grad:
            return lambda: torch.autograd.grad(fn(), leaves, dy)

        def run():
            with torch.no_grad():
                fn()

        return run

    out, nulls = {}, {}
    for base, fns in groups.items():
        runs = {name: runner(fn, leaves) for name, (fn, leaves) in fns.items()}
        for run in runs.values():  # warm-up: autotune's first measurement, allocator, lazy init
            for _ in range(10):
                run()
        cmp = _paired(runs, base, device, calls=200 if not grad else 50, budget=budget, target=target,
                      max_pairs=repeats, warmup=0)  # fmt: skip
        for name in runs:
            if name != NULL:
                t = _timed(cmp, name)
                out[name] = {"median_us": t["median_s"] * 1e6, "min_us": t["min_s"] * 1e6}
                out[name] |= {"vs_layer_norm": t["vs_base"], "speed": t["speed"]}
        nulls[base] = _null_facts(cmp)
    return out, nulls


# RMSNorm_module: γ and β folded away (exact conversion's norms); RMSNorm_weight: γ kept (a tied head's
# final norm, its β folded into the logits bias); RMSNorm_affine: γ and β kept (β is a second kernel on
# this path: nn.LayerNorm adds its β inside its one kernel)
HOST_IMPLS = ["LayerNorm_module", "RMSNorm_module", "RMSNorm_weight", "RMSNorm_affine"]


@contextmanager
def _user_setting(backend: str):
    """The block runs as a user's NORMSWAP_KERNEL=``backend`` makes it run (set through the kernels'
    chooser, which owns the setting), and the setting is put back after."""
    from normswap.kernels import choose

    before = choose.set_setting(backend)
    try:
        yield
    finally:
        choose.set_setting(before)


def _stub(x, *args):
    """What a device kernel costs the host when it is queued and not waited for: nothing here."""
    return x


def time_host_path(rows: int, hidden: int, dtype, repeats: int, *, budget: float, target: float):
    """The CUDA path's host-side work per call, measured on the CPU with the device kernel stubbed:
    nn.LayerNorm against the converted RMSNorm module bound the way `auto` binds it on CUDA where
    torch's fused rms_norm wins (every call in the H200 evidence), with ``torch.layer_norm`` and
    ``torch.rms_norm`` replaced by a function that returns its input. What is left is the Python and
    dispatch each module adds before its one kernel launch — what bounds a GPU decode step, whose
    kernels take less time than their launches. Interleaved pairs with nn.LayerNorm's second copy
    as the null control, forward only (no gradient: a stub has none)."""
    ln_mod, ln_again = (torch.nn.LayerNorm(hidden, eps=EPS, dtype=dtype) for _ in range(2))
    fns = {
        "LayerNorm_module": ln_mod,
        "RMSNorm_module": RMSNorm(hidden, eps=EPS, elementwise_affine=False, dtype=dtype),
        "RMSNorm_weight": RMSNorm(hidden, eps=EPS, dtype=dtype),
        "RMSNorm_affine": RMSNorm(hidden, eps=EPS, bias=True, dtype=dtype),
        NULL: ln_again,
    }
    x = torch.randn(rows, hidden, dtype=dtype)

    def run(m):
        def call():
            with torch.no_grad():
                m(x)

        return call

    real = torch.layer_norm, torch.rms_norm
    with _user_setting("native"):
        torch.layer_norm = torch.rms_norm = _stub
        try:
            runs = {name: run(m) for name, m in fns.items()}
            for r in runs.values():
                for _ in range(10):  # the modules bind on their first call (to the stub: it is torch.rms_norm now)
                    r()
            ran = {n: sorted(set(m.kernels_ran.values())) for n, m in fns.items() if hasattr(m, "kernels_ran")}
            cmp = _paired(
                runs, "LayerNorm_module", torch.device("cpu"), calls=500, budget=budget, target=target,
                max_pairs=repeats, warmup=0,
            )  # fmt: skip
        finally:
            torch.layer_norm, torch.rms_norm = real
    out = {}
    for name in runs:
        if name != NULL:
            t = _timed(cmp, name)
            out[name] = {"median_us": t["median_s"] * 1e6, "min_us": t["min_s"] * 1e6}
            out[name] |= {"vs_layer_norm": t["vs_base"], "speed": t["speed"]}
            out[name]["ran"] = ran.get(name, ["torch.layer_norm"])
    return out, _null_facts(cmp)


def _null_facts(cmp) -> dict:
    """The null control and how the stop rule ended, for a row of the tables."""
    return cmp.null.to_json() | {"stop_reason": cmp.stop_reason, "elapsed_s": round(cmp.elapsed_s, 2)}


class _JsonLines:
    """Appends one JSON object a line and flushes it to disk at once, so a run that is killed
    keeps every case it finished."""

    def __init__(self, path):
        self.path = path
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            open_append(path, label="--jsonl").close()  # a planted link or FIFO: refused before any timing

    def write(self, obj: dict) -> None:
        if not self.path:
            return
        with open_append(self.path, label="--jsonl") as f:  # never through a link planted meanwhile
            f.write((json.dumps(obj) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())


def run_benchmark(
    device="cpu",
    dtypes=None,
    shapes=None,
    repeats=None,
    modes=("fwd", "fwd+bwd"),
    residual=True,
    quick=False,
    progress=None,
    tiny=True,
    jsonl=None,
    budget=None,
    target=0.01,
    deadline=None,
) -> dict:
    """Every table of the benchmark; `jsonl` (a path) also gets each case as one line the moment it
    is measured, `progress(kind, row)` is told too. `deadline`: seconds for the whole benchmark; a row
    that would end past it (judged by the longest row so far) is not started but listed in
    ``skipped``, and the tables of the rows done are still written (a GPU run's step limit)."""
    log = _JsonLines(jsonl)
    due = _Deadline(deadline)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        from normswap.errors import NormswapError

        raise NormswapError("--device cuda requested but no CUDA device is available")
    cuda = device.type == "cuda"
    if shapes is None:
        shapes = QUICK_SHAPES if quick else (CUDA_SHAPES if cuda else CPU_SHAPES)
    if dtypes is None:
        dtypes = ["float32"] if quick else (CUDA_DTYPES if cuda else CPU_DTYPES)
    if repeats is None:  # the most pairs per row
        repeats = 20 if quick else 400
    if budget is None:
        budget = DEFAULT_BUDGET_S["quick" if quick else device.type if cuda else "cpu"]
    result = _result_header(device, repeats, budget, target, deadline, log)
    _time_rows(result, device, shapes, dtypes, modes, residual, repeats, budget, target, due, log, progress)
    if tiny:
        _time_tiny_rows(result, device, dtypes, modes, quick, repeats, budget, target, due, log, progress)
    _tiny_goals(result)
    result["auto_choices"] = autotune.choices()
    log.write({"kind": "auto_choices", "choices": result["auto_choices"]})
    result["loadavg_after"] = _loadavg()
    result["backward"] = _derived_backward(result)
    if cuda:
        result["goals"] = evaluate_goals(result)
    return result


def _result_header(device, repeats, budget, target, deadline, log) -> dict:
    """The run's settings and machine, logged first; the rows are appended to its lists."""
    cuda = device.type == "cuda"
    result = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "normswap_backend": backend_for(device),
        "repeats": repeats,
        "budget_s": budget,
        "target_halfwidth": target,
        "timing": "normswap/timing.py interleaved pairs against LayerNorm with a null control; "
        + (
            "CUDA-graph replay of sweeps over L2-exceeding input rotation, CUDA-event clock (eager sweeps in eager_ms)"
            if cuda
            else "perf_counter"
        ),
        "copy_gbps": measure_copy_gbps(device) if cuda else None,
        # CPU timings on a shared machine mean little without the load they were taken under
        "loadavg_before": _loadavg(),
        "deadline_s": deadline,
        "rows": [],
        "tiny": [],
        "host_path": [],
        "skipped": [],
    }
    log.write(
        {"kind": "setup", **{k: v for k, v in result.items() if k not in ("rows", "tiny", "host_path", "skipped")}}
    )
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    return result


def _time_rows(result, device, shapes, dtypes, modes, residual, repeats, budget, target, due, log, progress):
    """The main table: each shape × dtype × variant (plain, residual) × mode against LayerNorm."""
    variants = ["plain"] + (["residual"] if residual else [])
    for rows, hidden in shapes:
        for dt in dtypes:
            dtype = getattr(torch, dt)
            for variant in variants:
                for mode in modes:
                    if not due.fits(result, "row", f"{rows}x{hidden} {dt} {variant} {mode}"):
                        continue
                    case = Case(rows, hidden, dtype, variant, mode)
                    times, cmp = time_case(case, device, repeats, budget=budget, target=target)
                    row = {"rows": rows, "hidden": hidden, "dtype": dt, "variant": variant, "mode": mode}
                    row |= {"nominal_bytes": case.nominal_bytes(), "impls": _impls(times, case, result)}
                    row["null"] = _null_facts(cmp)
                    result["rows"].append(row)
                    log.write({"kind": "row", **row})
                    if progress:
                        progress("row", row)


def _time_tiny_rows(result, device, dtypes, modes, quick, repeats, budget, target, due, log, progress):
    """Per-call time at tiny shapes (the module's overhead), and on CPU the CUDA path's host work."""
    cuda = device.type == "cuda"
    tiny_dtype = getattr(torch, dtypes[0])
    for mode in modes:
        for rows in TINY_ROWS:
            for hidden in TINY_HIDDEN if not quick else TINY_HIDDEN[:1]:
                if not due.fits(result, "tiny", f"tiny {rows}x{hidden} {mode}"):
                    continue
                impls, nulls = time_tiny(device, rows, hidden, tiny_dtype, mode, repeats, budget=budget, target=target)
                t = {"rows": rows, "hidden": hidden, "dtype": dtypes[0], "mode": mode}
                t |= {"impls": impls, "null": nulls}
                result["tiny"].append(t)
                log.write({"kind": "tiny", **t})
                if progress:
                    progress("tiny", t)
    if not cuda:  # the CUDA path's host work, its kernel stubbed (on a GPU the tiny rows above say it)
        for rows in TINY_ROWS:
            for hidden in TINY_HIDDEN if not quick else TINY_HIDDEN[:1]:
                if not due.fits(result, "host_path", f"host path {rows}x{hidden}"):
                    continue
                impls, null = time_host_path(rows, hidden, tiny_dtype, repeats, budget=budget, target=target)
                t = {"rows": rows, "hidden": hidden, "dtype": dtypes[0], "impls": impls, "null": null}
                result["host_path"].append(t)
                log.write({"kind": "host_path", **t})
                if progress:
                    progress("host_path", t)


def _tiny_goals(result):
    """The tiny-shape and host-path goals, decided from the rows measured."""
    if result["tiny"]:
        slower = [
            f"{t['rows']}x{t['hidden']} {t['mode']}"
            for t in result["tiny"]
            if max(t["impls"]["RMSNorm_module"]["median_us"], t["impls"]["RMSNorm_affine"]["median_us"])
            > t["impls"]["LayerNorm_module"]["median_us"]
        ]
        result["tiny_goal"] = {
            "goal": "converted RMSNorm module's per-call time (weightless and with γ, β) "
            "<= nn.LayerNorm's at tiny shapes",
            "value": slower,
            "passed": not slower,
        }
    if result["host_path"]:
        # decided, not by medians: slower only when the paired interval says so beyond the null control
        slower = [
            f"{t['rows']}x{t['hidden']} {name}"
            for t in result["host_path"]
            for name in ("RMSNorm_module", "RMSNorm_weight")
            if (t["impls"][name]["speed"] or {}).get("verdict") == "slower"
        ]
        result["host_goal"] = {
            "goal": "converted RMSNorm module's host work per call on the CUDA path (kernel stubbed; without β) "
            "<= nn.LayerNorm's, decided against the null control",
            "value": slower,
            "passed": not slower,
        }


class _Deadline:
    """Whether the next row of a kind ("row", "tiny") still fits the benchmark's ``deadline`` seconds:
    it would start now and take as long as the longest row of its kind so far."""

    def __init__(self, seconds):
        self.seconds, self.start = seconds, time.perf_counter()
        self.longest: dict[str, float] = {}
        self.running = None  # (kind, start) of the row the last True let start

    def fits(self, result: dict, kind: str, label: str) -> bool:
        now = time.perf_counter()
        if self.running is not None:
            ran, began = self.running
            self.longest[ran] = max(self.longest.get(ran, 0.0), now - began)
        self.running = None
        if self.seconds is None or now - self.start + self.longest.get(kind, 0.0) <= self.seconds:
            self.running = (kind, now)
            return True
        result["skipped"].append(label)
        return False


def _impls(times: dict, case: Case, result: dict) -> dict:
    """A row's per-implementation numbers: ms per call, GB/s, time ÷ LayerNorm's, the paired speed ratio."""
    impls = {}
    for name, t in times.items():
        gbps = case.nominal_bytes() / t["median_s"] / 1e9
        impls[name] = {
            "median_ms": t["median_s"] * 1e3,
            "min_ms": t["min_s"] * 1e3,
            "timing": t["timing"],
            "eager_ms": t["eager_s"] * 1e3 if t["eager_s"] is not None else None,
            "gbps": gbps,
            "vs_layer_norm": t["vs_base"],
            "speed": t["speed"],  # speed ÷ LayerNorm's (> 1 faster), interval and verdict; None for LayerNorm
            "copy_share": gbps / result["copy_gbps"] if result["copy_gbps"] else None,
        }
    return impls


def _derived_backward(result) -> list[dict]:
    """Backward-only time = (fwd+bwd) − fwd for normswap's weighted norm, and its bandwidth."""
    out = []
    by_key = {(r["rows"], r["hidden"], r["dtype"], r["variant"], r["mode"]): r for r in result["rows"]}
    for (rows, hidden, dt, variant, mode), r in by_key.items():
        if variant != "plain" or mode != "fwd+bwd" or (rows, hidden, dt, variant, "fwd") not in by_key:
            continue
        f = by_key[(rows, hidden, dt, variant, "fwd")]["impls"]["normswap_weight"]["median_ms"]
        fb = r["impls"]["normswap_weight"]["median_ms"]
        if fb <= f:  # noise larger than the backward itself: say so rather than print nonsense
            out.append({"rows": rows, "hidden": hidden, "dtype": dt, "bwd_ms": None, "gbps": None, "copy_share": None})
            continue
        t = (fb - f) / 1e3
        nbytes = 3 * rows * hidden * torch.tensor([], dtype=getattr(torch, dt)).element_size()
        gbps = nbytes / t / 1e9
        out.append(
            {
                "rows": rows,
                "hidden": hidden,
                "dtype": dt,
                "bwd_ms": t * 1e3,
                "gbps": gbps,
                "copy_share": gbps / result["copy_gbps"] if result.get("copy_gbps") else None,
            }
        )
    return out


def evaluate_goals(result) -> list[dict]:
    """The targets in docs/results.md, checked against this run's numbers."""
    goals = []
    for r in result["rows"]:
        if (r["rows"], r["hidden"], r["dtype"], r["variant"], r["mode"]) == (8192, 4096, "bfloat16", "plain", "fwd"):
            share = r["impls"]["normswap_weight"]["copy_share"]
            goals.append(
                {"goal": "forward >= 85% of copy bandwidth at 8192x4096 bf16", "value": share, "passed": share >= 0.85}
            )
    for b in result.get("backward", []):
        if (b["rows"], b["hidden"], b["dtype"]) == (8192, 4096, "bfloat16"):
            goals.append(
                {
                    "goal": "backward >= 75% of copy bandwidth at 8192x4096 bf16",
                    "value": b["copy_share"],
                    "passed": b["copy_share"] is not None and b["copy_share"] >= 0.75,
                }
            )
    slower = []
    fused_slower = []
    for r in result["rows"]:
        im = r["impls"]
        tag = f"{r['rows']}x{r['hidden']} {r['dtype']} {r['mode']}"
        if r["variant"] == "plain":
            for ours in ("normswap", "normswap_weight"):
                worst = min(im["layer_norm"]["median_ms"], im["torch_rms_norm"]["median_ms"])
                if im[ours]["median_ms"] > worst:
                    slower.append(f"{ours} {tag}")
        else:
            if im["normswap_fused"]["median_ms"] >= im["add_normswap"]["median_ms"]:
                fused_slower.append(tag)
    goals.append({"goal": "never slower than torch LayerNorm or native RMSNorm", "value": slower, "passed": not slower})
    goals.append(
        {"goal": "fused residual add faster than add + norm", "value": fused_slower, "passed": not fused_slower}
    )
    return goals


def _loadavg():
    try:
        import os

        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def _null_cells(null: dict | None) -> list[str]:
    """The null control's speed ratio with its interval and verdict, and how the row's pairs ended."""
    if not null:
        return ["—", "—"]
    text = f"{null['ratio']:.3f} [{null['low']:.3f}–{null['high']:.3f}] {null['verdict']}"
    return [text, f"{null['pairs']}, {null['stop_reason']}"]


def format_markdown(result) -> str:
    """One table per variant: rows = shape/dtype/mode, columns = implementations (ms and ×LN)."""
    lines = [
        f"device: {result['device_name']} ({result['device']}, {result['threads']} threads), torch {result['torch']}, "
        f"triton {result.get('triton')}, normswap backend: {result['normswap_backend']}, timing: {result['timing']}, "
        f"repeats: {result['repeats']}",
    ]
    if result.get("copy_gbps"):
        lines.append(f"measured device copy bandwidth: {result['copy_gbps']:.0f} GB/s")
    if result.get("loadavg_before") and not result.get("copy_gbps"):
        lines.append(
            f"load average (1/5/15 min) before: {result['loadavg_before']}, after: {result.get('loadavg_after')} "
            f"on {os.cpu_count()} CPUs"
        )
    for variant, impls in (("plain", IMPLS), ("residual", RESIDUAL_IMPLS)):
        rows = [r for r in result["rows"] if r["variant"] == variant]
        if not rows:
            continue
        lines.append("")
        lines.append(
            f"**{variant}** — median ms (GB/s{', share of copy' if result.get('copy_gbps') else ''}; "
            "time ÷ LayerNorm's)"
        )
        lines.append("")
        lines.append("| rows × H | dtype | mode | " + " | ".join(impls) + " | null control | pairs, stop |")
        lines.append("|---|---|---|" + "---|" * (len(impls) + 2))
        for r in rows:
            cells = []
            for name in impls:
                m = r["impls"][name]
                share = f", {m['copy_share'] * 100:.0f}%" if m.get("copy_share") else ""
                flag = " †" if m.get("timing") == "eager" else ""
                word = f"; {m['speed']['verdict']}" if m.get("speed") else ""
                cells.append(
                    f"{m['median_ms']:.3g}{flag} ({m['gbps']:.3g} GB/s{share}; {m['vs_layer_norm']:.2f}×{word})"
                )
            cells += _null_cells(r.get("null"))
            lines.append(f"| {r['rows']}×{r['hidden']} | {r['dtype']} | {r['mode']} | " + " | ".join(cells) + " |")
    if any(m.get("timing") == "eager" for r in result["rows"] for m in r["impls"].values()):
        lines.append("")
        lines.append("† CUDA-graph capture failed for this implementation: eager time (includes host launch overhead).")
    if result.get("backward"):
        lines.append("")
        lines.append(
            "normswap (weighted) backward alone, (fwd+bwd) − fwd: "
            + "; ".join(
                (
                    f"{b['rows']}×{b['hidden']} {b['dtype']}: {b['bwd_ms']:.3g} ms, {b['gbps']:.3g} GB/s"
                    + (f" ({b['copy_share'] * 100:.0f}% of copy)" if b.get("copy_share") else "")
                )
                if b["bwd_ms"] is not None
                else f"{b['rows']}×{b['hidden']} {b['dtype']}: below timing noise"
                for b in result["backward"]
            )
        )
    lines += _small_tables(result)
    if result.get("skipped"):
        lines.append("")
        lines.append(
            f"not measured (they would have ended past the {result['deadline_s']:g} s deadline): "
            + ", ".join(result["skipped"])
        )
    goals = list(result.get("goals") or []) + [result[k] for k in ("tiny_goal", "host_goal") if result.get(k)]
    if goals:
        lines.append("")
        lines.append("| goal | value | met |")
        lines.append("|---|---|---|")
        for g in goals:
            v = g["value"]
            v = f"{v * 100:.1f}%" if isinstance(v, float) else (", ".join(v) if isinstance(v, list) and v else "—")
            lines.append(f"| {g['goal']} | {v} | {'yes' if g['passed'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _small_tables(result) -> list[str]:
    """The tiny-shape, host-path and `auto` tables of the markdown, each present when measured."""
    lines = []
    if result.get("tiny"):
        lines.append("")
        lines.append(
            "**tiny shapes** — per-call µs, median (× the LayerNorm counterpart: module vs nn.LayerNorm, "
            "functions vs F.layer_norm)"
        )
        lines.append("")
        lines.append("| rows × H | dtype | mode | " + " | ".join(TINY_IMPLS) + " | null: modules | null: functions |")
        lines.append("|---|---|---|" + "---|" * (len(TINY_IMPLS) + 2))
        for t in result["tiny"]:
            cells = [f"{t['impls'][n]['median_us']:.1f} ({t['impls'][n]['vs_layer_norm']:.2f}×)" for n in TINY_IMPLS]
            nulls = t.get("null") or {}
            cells += [_null_cells(nulls.get(b))[0] for b in ("LayerNorm_module", "layer_norm")]
            lines.append(f"| {t['rows']}×{t['hidden']} | {t['dtype']} | {t['mode']} | " + " | ".join(cells) + " |")
    if result.get("host_path"):
        lines.append("")
        lines.append(
            "**host path of a CUDA call, kernel stubbed** — per-call µs on the CPU with torch.layer_norm / "
            "torch.rms_norm returning their input, the RMSNorm modules bound as `auto` binds them where torch's "
            "fused rms_norm wins (× nn.LayerNorm's time; paired speed ratio [95 %] and verdict)"
        )
        lines.append("")
        lines.append("| rows × H | dtype | " + " | ".join(HOST_IMPLS) + " | null control |")
        lines.append("|---|---|" + "---|" * (len(HOST_IMPLS) + 1))
        for t in result["host_path"]:
            cells = []
            for n in HOST_IMPLS:
                i = t["impls"][n]
                sp = i.get("speed")
                tail = f"; ×{sp['ratio']:.2f} [{sp['low']:.2f}–{sp['high']:.2f}] {sp['verdict']}" if sp else ""
                cells.append(f"{i['median_us']:.2f} ({i['vs_layer_norm']:.2f}×{tail})")
            cells.append(_null_cells(t.get("null"))[0])
            lines.append(f"| {t['rows']}×{t['hidden']} | {t['dtype']} | " + " | ".join(cells) + " |")
    if result.get("auto_choices"):
        lines.append("")
        lines.append(
            "**what `auto` chose** (normswap.kernels.autotune; per device, dtype, width bucket, rows, gradient, "
            "γ, fused residual; measured at the first call's own shape)"
        )
        lines.append("")
        lines.append("| device | dtype | width ≤ | rows | grad | γ | residual | order | why |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        yes = {True: "yes", False: "no", None: "—"}
        for c in result["auto_choices"]:
            lines.append(
                f"| {c['device']} | {c['dtype']} | {c['width_bucket']} | {c['rows']} | "
                f"{yes[c['grad']]} | {yes[c.get('weight')]} | {yes[c.get('residual')]} | "
                f"{' > '.join(c['ranking'])} | {c.get('why', '')} |"
            )
    return lines
