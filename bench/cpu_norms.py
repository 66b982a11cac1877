#!/usr/bin/env python3
"""CPU norm benchmark: nn.LayerNorm's kernel vs F.rms_norm vs normswap's compiled CPU RMSNorm.

The claim to prove: a converted model's norms are no slower on CPU than the nn.LayerNorm they
replaced, forward and forward+backward. Measured side by side, interleaved per repeat (every
candidate runs once per repeat, in rotating order, on the same inputs), medians over repeats;
ratios are candidate_median / layer_norm_median of the same configuration, so machine-wide
slowdowns (shared cores) hit both sides of a ratio alike.

Candidates (eps 1e-5):
  ln     F.layer_norm(x, (H,), weight, bias)       -- what nn.LayerNorm runs
  rms    F.rms_norm(x, (H,), weight)               -- torch's own RMSNorm (skip: --no-torch-rms)
  ns     normswap CPU kernel, no weight            -- the usual converted norm (convert folds gamma)
  nsw    normswap CPU kernel, with weight
  api    normswap.kernels.rms_norm(x) (opt-in: --api), the public dispatcher
forward: no autograd (inference). forward+backward: x, weight (and bias) require grad and
torch.autograd.grad(y, inputs, dy) computes every gradient; normswap goes through a minimal
autograd.Function here so it pays autograd's overhead like layer_norm does.

    python bench/cpu_norms.py                       # full grid, a few minutes on 2 cores
    python bench/cpu_norms.py --hidden 768 --rows 8192 --dtypes float32 --reps 21
    python bench/cpu_norms.py --out bench/results/cpu_norms.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from normswap.kernels import cpu  # noqa: E402

EPS = 1e-5
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _NSNorm(torch.autograd.Function):
    """The smallest honest autograd wrapper around the kernel (what a dispatcher does)."""

    @staticmethod
    def forward(ctx, x, weight):
        y, rstd, _ = cpu.forward(x, weight, None, EPS)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd, weight = ctx.saved_tensors
        need_w = weight is not None and ctx.needs_input_grad[1]
        dx, dw = cpu.backward(dy.contiguous(), x, rstd, weight, compute_dweight=need_w)
        return dx, (dw.to(weight.dtype) if dw is not None else None)


def _model_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _candidates(x, w, b, dy, mode, names):
    H = x.shape[-1]
    wr = w  # F.rms_norm with the same weight dtype as x (its fast-path requirement)
    out = {}
    if mode == "fwd":
        out["ln"] = lambda: F.layer_norm(x, (H,), w, b, EPS)
        if "rms" in names:
            out["rms"] = lambda: F.rms_norm(x, (H,), wr, EPS)
        out["ns"] = lambda: cpu.forward(x, None, None, EPS)
        out["nsw"] = lambda: cpu.forward(x, w, None, EPS)
        if "api" in names:
            from normswap.kernels import rms_norm

            out["api"] = lambda: rms_norm(x, None, EPS)
        return out
    xg = x.detach().requires_grad_()
    wg = w.detach().requires_grad_()
    bg = b.detach().requires_grad_()

    def ln():
        y = F.layer_norm(xg, (H,), wg, bg, EPS)
        return torch.autograd.grad(y, (xg, wg, bg), dy)

    def rms():
        y = F.rms_norm(xg, (H,), wg, EPS)
        return torch.autograd.grad(y, (xg, wg), dy)

    def ns():
        y = _NSNorm.apply(xg, None)
        return torch.autograd.grad(y, (xg,), dy)

    def nsw():
        y = _NSNorm.apply(xg, wg)
        return torch.autograd.grad(y, (xg, wg), dy)

    out["ln"] = ln
    if "rms" in names:
        out["rms"] = rms
    out["ns"] = ns
    out["nsw"] = nsw
    if "api" in names:
        from normswap.kernels import rms_norm

        def api():
            y = rms_norm(xg, None, EPS)
            return torch.autograd.grad(y, (xg,), dy)

        out["api"] = api
    return out


def _measure(fns, reps, min_sample_s, clock=time.perf_counter):
    """Interleaved medians: each repeat runs every candidate once (order rotated per repeat), a
    sample being `iters` back-to-back calls sized so that one sample lasts about min_sample_s."""
    names = list(fns)
    for f in fns.values():  # warm-up (allocator, thread pool, first-touch)
        f()
        f()
    iters = {}
    for k, f in fns.items():
        t = clock()
        f()
        dt = clock() - t
        iters[k] = max(1, min(200, int(min_sample_s / max(dt, 1e-7))))
    samples = {k: [] for k in names}
    for r in range(reps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for k in order:
            f, n = fns[k], iters[k]
            t = clock()
            for _ in range(n):
                f()
            samples[k].append((clock() - t) / n)
    return {k: statistics.median(v) for k, v in samples.items()}, {k: min(v) for k, v in samples.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", default="256,768,1024,2048,4096")
    ap.add_argument("--rows", default="1024,4096,16384")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="fwd,fwdbwd", help="fwd, fwdbwd or both")
    ap.add_argument("--reps", type=int, default=9, help="interleaved repeats per configuration")
    ap.add_argument("--min-sample-ms", type=float, default=10.0, help="minimum length of one timed sample")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument(
        "--timer",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: perf_counter (what a user waits; needs a quiet machine). cpu: this thread's CPU time "
        "(time.thread_time), immune to being descheduled on a shared machine; requires --threads 1",
    )
    ap.add_argument("--no-torch-rms", action="store_true", help="skip F.rms_norm (the slowest candidate)")
    ap.add_argument(
        "--torch-rms-max-elems",
        type=int,
        default=1 << 22,
        help="time F.rms_norm only up to this many elements (it is 3-15x slower than everything else "
        "and would dominate the run time); larger rows show '-'",
    )
    ap.add_argument("--api", action="store_true", help="also time normswap.kernels.rms_norm (weightless)")
    ap.add_argument("--isa", default="best", help="kernel variant: best, avx2, baseline")
    ap.add_argument(
        "--malloc",
        choices=["pinned", "default"],
        default="pinned",
        help="pinned (default): re-run under glibc settings that keep freed memory (MALLOC_MMAP_MAX_=0, "
        "no trimming), so no candidate pays fresh-page faults for its outputs; those faults are the "
        "same work for every candidate but land unevenly depending on heap state and were measured "
        "at up to 80%% of a large call. default: leave malloc alone.",
    )
    ap.add_argument("--out", default=None, help="write the markdown table here (atomically)")
    args = ap.parse_args(argv)
    if args.malloc == "pinned" and os.environ.get("MALLOC_MMAP_MAX_") != "0":
        env = dict(os.environ, MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 36))
        cli = list(argv) if argv is not None else sys.argv[1:]
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *cli], env)

    if not cpu.available():
        print(f"normswap CPU kernel unavailable: {cpu.unavailable_reason()}", file=sys.stderr)
        return 2
    if not cpu._set_isa(args.isa):
        print(f"ISA variant {args.isa!r} cannot run here", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.timer == "cpu" and torch.get_num_threads() != 1:
        print("--timer cpu measures one thread's CPU time: use it with --threads 1", file=sys.stderr)
        return 2
    clock = time.thread_time if args.timer == "cpu" else time.perf_counter
    hidden = [int(v) for v in args.hidden.split(",")]
    rows = [int(v) for v in args.rows.split(",")]
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    modes = args.modes.split(",")
    names = {"ln", "ns", "nsw"} | (set() if args.no_torch_rms else {"rms"}) | ({"api"} if args.api else set())

    started = time.time()
    load0 = os.getloadavg()
    head = (
        f"# CPU norms: LayerNorm vs RMSNorm kernels\n\n"
        f"- date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}\n"
        f"- cpu: {_model_name()} ({os.cpu_count()} logical CPUs), torch threads {torch.get_num_threads()}\n"
        f"- torch {torch.__version__}, python {platform.python_version()}, kernel variant `{cpu.isa()}`\n"
        f"- command: `python bench/cpu_norms.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n"
        f"- malloc: {args.malloc}"
        f"{' (MALLOC_MMAP_MAX_=0, no trim: outputs reuse warm memory, no page-fault noise)' if args.malloc == 'pinned' else ''}\n"
        f"- method: interleaved repeats ({args.reps}), median per candidate, samples ~"
        f"{args.min_sample_ms:g} ms, timer `{args.timer}`"
        f"{' (thread CPU time: immune to preemption by other jobs)' if args.timer == 'cpu' else ' (wall clock)'}; "
        f"ratio = median / median(ln) of the same row\n"
        f"- ln = F.layer_norm with weight+bias (nn.LayerNorm); rms = F.rms_norm with weight; "
        f"ns = normswap kernel without weight; nsw = with weight; fwd+bwd computes all input grads\n"
    )
    cols = ["ln", "rms", "ns", "nsw", "api"]
    cols = [c for c in cols if c in names]
    lines = []
    worst = []
    for mode in modes:
        lines.append(f"\n## {'forward' if mode == 'fwd' else 'forward + backward'}\n")
        lines.append(
            "| dtype | H | rows | "
            + " | ".join(f"{c} ms" for c in cols)
            + " | "
            + " | ".join(f"{c}/ln" for c in cols if c != "ln")
            + " |"
        )
        lines.append("|" + "---|" * (3 + len(cols) + len(cols) - 1))
        print(f"\n{mode}", flush=True)
        for dtype in dtypes:
            for H in hidden:
                for N in rows:
                    g = torch.Generator().manual_seed(H * 7 + N)
                    x = torch.randn(N, H, generator=g).to(dtype)
                    dy = torch.randn(N, H, generator=g).to(dtype)
                    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
                    b = (0.1 * torch.randn(H, generator=g)).to(dtype)
                    here = names if N * H <= args.torch_rms_max_elems else names - {"rms"}
                    fns = _candidates(x, w, b, dy, mode, here)
                    med, _best = _measure(fns, args.reps, args.min_sample_ms / 1e3, clock)
                    ratios = {c: med[c] / med["ln"] for c in cols if c != "ln" and c in med}
                    for c in ("ns", "nsw"):
                        worst.append((ratios[c], mode, str(dtype).split(".")[-1], H, N, c))
                    row = (
                        f"| {str(dtype).split('.')[-1]} | {H} | {N} | "
                        + " | ".join(f"{med[c] * 1e3:.3f}" if c in med else "-" for c in cols)
                        + " | "
                        + " | ".join(f"{ratios[c]:.2f}" if c in ratios else "-" for c in cols if c != "ln")
                        + " |"
                    )
                    lines.append(row)
                    print(row, flush=True)
                    del fns, x, dy
    elapsed = time.time() - started
    over = [w for w in worst if w[0] > 1.0]
    tail = [
        "\n## Summary\n",
        f"- configurations x kernels where normswap (ns/nsw) median > ln median: {len(over)} of {len(worst)}",
    ]
    if worst:
        top = max(worst)
        tail.append(f"- worst ratio: {top[0]:.2f} ({top[5]}, {top[1]}, {top[2]}, H={top[3]}, rows={top[4]})")
        ns_only = [w[0] for w in worst if w[5] == "ns"]
        tail.append(f"- median ratio ns/ln over all rows: {statistics.median(ns_only):.2f}")
    tail.append(
        f"- load average at start/end: {load0[0]:.1f} / {os.getloadavg()[0]:.1f} "
        f"(shared machine: other jobs were running), wall time {elapsed:.0f} s"
    )
    text = head + "\n".join(lines) + "\n" + "\n".join(tail) + "\n"
    print("\n".join(tail))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
