"""Kernel benchmark: torch LayerNorm vs torch's RMSNorm vs normswap's RMSNorm.

For each shape, dtype and mode (forward; forward+backward) and variant (plain; residual add
fused in), every implementation is timed on the same inputs and reported as median time,
achieved bandwidth over the bytes the operation must move at minimum (the same nominal bytes for
every implementation of a row, so GB/s compare directly), and its time ratio to LayerNorm.

Timing method:
- CUDA: CUDA events around a sweep over several distinct input sets whose total size exceeds
  3× the L2 cache (so no input is served from L2), divided by the sweep length; the device copy
  bandwidth is measured in the same run so every kernel's share of it can be reported.
- CPU: time.perf_counter around one call per implementation, implementations interleaved within
  each repeat so machine noise (other processes, frequency changes) hits all of them equally.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from normswap.kernels import backend_for, rms_norm

EPS = 1e-5

CPU_SHAPES = [(16384, 256), (8192, 768), (4096, 2048), (2048, 4096)]
CPU_DTYPES = ["float32", "bfloat16"]
CUDA_SHAPES = [(r, h) for r in (4096, 8192, 16384) for h in (768, 2048, 4096, 8192)]
CUDA_DTYPES = ["bfloat16"]
QUICK_SHAPES = [(1024, 256), (512, 1024)]

IMPLS = ["layer_norm", "torch_rms_norm", "normswap", "normswap_weight"]
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
            "normswap": lambda x, r: rms_norm(x, None, EPS),  # weightless, as exact convert emits
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


def time_case(case: Case, device, repeats: int, warmup: int = 2, seed: int = 0) -> dict[str, tuple]:
    """name -> (median s, min s, eager median s or None, timing mode) per call."""
    w, b = _params(case, device)
    fns = _impl_fns(case, w, b)
    per_set = case.rows * case.hidden * torch.tensor([], dtype=case.dtype).element_size()
    per_set *= 1 + (case.variant == "residual") + (case.mode == "fwd+bwd") * (1 + (case.variant == "residual"))
    if device.type == "cuda":
        count = max(2, math.ceil(3 * _l2_bytes(device) / per_set))
    else:
        count = max(1, min(4, math.ceil((64 << 20) / per_set)))
    count = min(count, 64)
    sets = _make_inputs(case, device, count, seed)

    def leaves_of(name):
        def f(x, r):
            out = [x] + ([r] if r is not None else [])
            if name != "normswap":  # the weightless variant has no γ to differentiate
                out.append(w)
            if name in ("layer_norm", "add_layer_norm"):
                out.append(b)
            return out

        return f

    runs = {name: _runner(case, fn, leaves_of(name)) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in runs}
    eager: dict[str, list[float]] = {name: [] for name in runs}
    cuda = device.type == "cuda"
    for name, run in runs.items():  # warm up: compile kernels, build the CPU extension, fill allocators
        for i in range(warmup):
            run(sets[i % count])
    graphs = {}
    if cuda:
        torch.cuda.synchronize(device)
        # Kernel time without the host: each sweep is also captured in a CUDA graph and replayed.
        # Eager sweeps are still timed (what an eager training loop sees, launch overhead and
        # all); on small shapes the two differ because Python, not the GPU, is the bottleneck.
        for name, run in runs.items():
            graphs[name] = _capture(run, sets, device)
    for rep in range(repeats):
        order = list(runs) if rep % 2 == 0 else list(reversed(runs))  # no impl always goes first
        for name in order:
            run = runs[name]
            if cuda:
                eager[name].append(_event_time(lambda: [run(inp) for inp in sets]) / count)
                if graphs[name] is not None:
                    samples[name].append(_event_time(graphs[name].replay) / count)
            else:
                inp = sets[rep % count]
                t0 = time.perf_counter()
                run(inp)
                samples[name].append(time.perf_counter() - t0)
    out = {}
    for name in runs:
        v = samples[name] or eager[name]  # a failed capture falls back to the eager sweep
        out[name] = (statistics.median(v), min(v), statistics.median(eager[name]) if eager[name] else None,
                     "cuda-graph" if samples[name] else ("eager" if cuda else "perf_counter"))
    return out


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


def run_benchmark(device="cpu", dtypes=None, shapes=None, repeats=None, modes=("fwd", "fwd+bwd"),
                  residual=True, quick=False, progress=None) -> dict:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        from normswap.errors import NormswapError

        raise NormswapError("--device cuda requested but no CUDA device is available")
    cuda = device.type == "cuda"
    if shapes is None:
        shapes = QUICK_SHAPES if quick else (CUDA_SHAPES if cuda else CPU_SHAPES)
    if dtypes is None:
        dtypes = ["float32"] if quick else (CUDA_DTYPES if cuda else CPU_DTYPES)
    if repeats is None:
        repeats = 3 if quick else (20 if cuda else 5)
    result = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "normswap_backend": backend_for(device),
        "repeats": repeats,
        "timing": ("CUDA-graph replay of sweeps over L2-exceeding input rotation, timed by CUDA events "
                   "(eager sweeps in eager_ms)") if cuda else "perf_counter, implementations interleaved",
        "copy_gbps": measure_copy_gbps(device) if cuda else None,
        # CPU timings on a shared machine mean little without the load they were taken under
        "loadavg_before": _loadavg(),
        "rows": [],
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    variants = ["plain"] + (["residual"] if residual else [])
    for rows, hidden in shapes:
        for dt in dtypes:
            dtype = getattr(torch, dt)
            for variant in variants:
                for mode in modes:
                    case = Case(rows, hidden, dtype, variant, mode)
                    times = time_case(case, device, repeats)
                    base = times["layer_norm" if variant == "plain" else "add_layer_norm"][0]
                    nbytes = case.nominal_bytes()
                    impls = {}
                    for name, (t, tmin, teager, how) in times.items():
                        gbps = nbytes / t / 1e9
                        impls[name] = {
                            "median_ms": t * 1e3,
                            "min_ms": tmin * 1e3,
                            "timing": how,
                            "eager_ms": teager * 1e3 if teager is not None else None,
                            "gbps": gbps,
                            "vs_layer_norm": t / base,
                            "copy_share": gbps / result["copy_gbps"] if result["copy_gbps"] else None,
                        }
                    row = {"rows": rows, "hidden": hidden, "dtype": dt, "variant": variant, "mode": mode,
                           "nominal_bytes": nbytes, "impls": impls}
                    result["rows"].append(row)
                    if progress:
                        progress(row)
    result["loadavg_after"] = _loadavg()
    result["backward"] = _derived_backward(result)
    if cuda:
        result["goals"] = evaluate_goals(result)
    return result


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
        out.append({"rows": rows, "hidden": hidden, "dtype": dt, "bwd_ms": t * 1e3, "gbps": gbps,
                    "copy_share": gbps / result["copy_gbps"] if result.get("copy_gbps") else None})
    return out


def evaluate_goals(result) -> list[dict]:
    """The targets in bench/README.md, checked against this run's numbers."""
    goals = []
    for r in result["rows"]:
        if (r["rows"], r["hidden"], r["dtype"], r["variant"], r["mode"]) == (8192, 4096, "bfloat16", "plain", "fwd"):
            share = r["impls"]["normswap_weight"]["copy_share"]
            goals.append({"goal": "forward >= 85% of copy bandwidth at 8192x4096 bf16", "value": share, "passed": share >= 0.85})
    for b in result.get("backward", []):
        if (b["rows"], b["hidden"], b["dtype"]) == (8192, 4096, "bfloat16"):
            goals.append({"goal": "backward >= 75% of copy bandwidth at 8192x4096 bf16", "value": b["copy_share"],
                          "passed": b["copy_share"] is not None and b["copy_share"] >= 0.75})
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
    goals.append({"goal": "fused residual add faster than add + norm", "value": fused_slower, "passed": not fused_slower})
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
        lines.append(f"load average (1/5/15 min) before: {result['loadavg_before']}, after: {result.get('loadavg_after')} "
                     f"on {os.cpu_count()} CPUs")
    for variant, impls in (("plain", IMPLS), ("residual", RESIDUAL_IMPLS)):
        rows = [r for r in result["rows"] if r["variant"] == variant]
        if not rows:
            continue
        lines.append("")
        lines.append(f"**{variant}** — median ms (GB/s{', share of copy' if result.get('copy_gbps') else ''}; time ÷ LayerNorm's)")
        lines.append("")
        lines.append("| rows × H | dtype | mode | " + " | ".join(impls) + " |")
        lines.append("|---|---|---|" + "---|" * len(impls))
        for r in rows:
            cells = []
            for name in impls:
                m = r["impls"][name]
                share = f", {m['copy_share'] * 100:.0f}%" if m.get("copy_share") else ""
                flag = " †" if m.get("timing") == "eager" else ""
                cells.append(f"{m['median_ms']:.3g}{flag} ({m['gbps']:.3g} GB/s{share}; {m['vs_layer_norm']:.2f}×)")
            lines.append(f"| {r['rows']}×{r['hidden']} | {r['dtype']} | {r['mode']} | " + " | ".join(cells) + " |")
    if any(m.get("timing") == "eager" for r in result["rows"] for m in r["impls"].values()):
        lines.append("")
        lines.append("† CUDA-graph capture failed for this implementation: eager time (includes host launch overhead).")
    if result.get("backward"):
        lines.append("")
        lines.append("normswap (weighted) backward alone, (fwd+bwd) − fwd: " + "; ".join(
            (f"{b['rows']}×{b['hidden']} {b['dtype']}: {b['bwd_ms']:.3g} ms, {b['gbps']:.3g} GB/s"
             + (f" ({b['copy_share'] * 100:.0f}% of copy)" if b.get("copy_share") else ""))
            if b["bwd_ms"] is not None else f"{b['rows']}×{b['hidden']} {b['dtype']}: below timing noise"
            for b in result["backward"]))
    if result.get("goals"):
        lines.append("")
        lines.append("| goal | value | met |")
        lines.append("|---|---|---|")
        for g in result["goals"]:
            v = g["value"]
            v = f"{v * 100:.1f}%" if isinstance(v, float) else (", ".join(v) if isinstance(v, list) and v else "—")
            lines.append(f"| {g['goal']} | {v} | {'yes' if g['passed'] else 'NO'} |")
    return "\n".join(lines) + "\n"
