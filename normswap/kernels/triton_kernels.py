"""Triton RMSNorm kernels: forward (optionally fused with a residual add) and backward.

Host functions follow the same contract as normswap.kernels.cpu / reference:
    forward(x[N,H], weight|None, residual[N,H]|None, eps) -> (y, rstd fp32 [N], summed|None)
    backward(dy[N,H], xin[N,H], rstd[N], weight|None)      -> (dx, dw fp32 [H] | None)
Inputs must have a unit stride along H; any row stride is handled in the kernel.

Design:
- forward: one pass over x; a program owns BLOCK_M whole rows held in registers (BLOCK_M > 1 only
  for small H, to give each program enough bytes in flight); fp32 statistics; rstd saved.
- backward: a persistent grid of a few programs per SM, each walking a contiguous slice of rows
  and keeping its dγ partial in fp32 registers, written once to a [P, H] buffer summed afterwards.
  For a fixed device and shape the reduction order is fixed, so results are bit-reproducible.
- H above MAX_FUSED_N: a row no longer fits in registers, so the "looped" kernels walk the row in
  BLOCK_N chunks, twice (statistics, then output); the second read mostly hits L2.
All arithmetic is upcast to fp32 first: that is what the reference does, and the interpreter
produces garbage for bf16 arithmetic.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

# Largest hidden size handled by the one-read kernels (a 16k-wide fp32 row is 64 KB of
# registers across 16 warps, the practical limit before spilling).
MAX_FUSED_N = 16384
LOOP_BLOCK_N = 4096
# Untuned starting points (no GPU was available when these were chosen; see docs/results.md):
# elements per forward program on CUDA, and backward programs per SM (a 4096-wide bf16 row
# block needs ~80 registers a thread, so only 2-3 such programs are resident per SM anyway).
FWD_TARGET_ELEMENTS = 2048
BWD_PROGRAMS_PER_SM = 2


def interpreter_active() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1 (kernels then run on CPU tensors)."""
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(std.sum, InterpretedFunction)


@triton.jit
def _cast(v, P, RNE_FIX: tl.constexpr):
    """v (fp32) in the element type of pointer P, rounded to nearest even.

    RNE_FIX is set only under TRITON_INTERPRET: the interpreter's fp32→bf16 cast truncates,
    while the GPU's cvt rounds to nearest even; rounding the bits by hand first makes the
    interpreter compute what the GPU does. Compiled kernels get RNE_FIX=False (no extra work)."""
    if RNE_FIX:
        if P.dtype.element_ty == tl.bfloat16:
            b = v.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            v = b.to(tl.float32, bitcast=True)
    return v.to(P.dtype.element_ty)


@triton.jit
def _fwd_fused(
    X,
    R,
    W,
    Y,
    S,
    RSTD,
    n_rows,
    n_cols,
    sx,
    sr,
    sy,
    ss,
    eps,
    HAS_W: tl.constexpr,
    HAS_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RNE_FIX: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    cmask = cols < n_cols
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(X + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        r = tl.load(R + rows[:, None] * sr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # round the sum to the input dtype, exactly as `x + residual` in the model would
        s = _cast(x + r, S, RNE_FIX)
        tl.store(S + rows[:, None] * ss + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=rmask)
    y = x * rstd[:, None]
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    tl.store(Y + rows[:, None] * sy + cols[None, :], _cast(y, Y, RNE_FIX), mask=mask)


@triton.jit
def _fwd_looped(
    X,
    R,
    W,
    Y,
    S,
    RSTD,
    n_rows,
    n_cols,
    sx,
    sr,
    sy,
    ss,
    eps,
    HAS_W: tl.constexpr,
    HAS_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RNE_FIX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        cmask = cols < n_cols
        x = tl.load(X + row * sx + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_R:
            r = tl.load(R + row * sr + cols, mask=cmask, other=0.0).to(tl.float32)
            s = _cast(x + r, S, RNE_FIX)
            tl.store(S + row * ss + cols, s, mask=cmask)
            x = s.to(tl.float32)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        cmask = cols < n_cols
        # recompute x + r rather than re-read S: no reliance on seeing this program's own stores
        x = tl.load(X + row * sx + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_R:
            r = tl.load(R + row * sr + cols, mask=cmask, other=0.0).to(tl.float32)
            x = _cast(x + r, S, RNE_FIX).to(tl.float32)
        y = x * rstd
        if HAS_W:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
            y = y * w
        tl.store(Y + row * sy + cols, _cast(y, Y, RNE_FIX), mask=cmask)


@triton.jit
def _bwd_fused(
    DY,
    X,
    W,
    RSTD,
    DX,
    DWP,
    n_rows,
    n_cols,
    sdy,
    sx,
    sdx,
    rows_per_prog,
    HAS_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RNE_FIX: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY + rows[:, None] * sdy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        if HAS_W:
            g = dy * w[None, :]
            dw_acc += dy * xhat
        else:
            g = dy
        c = tl.sum(g * xhat, axis=1) / n_cols
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * sdx + cols[None, :], _cast(dx, DX, RNE_FIX), mask=mask)
    if HAS_W:
        tl.store(DWP + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=cmask)


@triton.jit
def _bwd_looped(
    DY,
    X,
    W,
    RSTD,
    DX,
    DWP,
    n_rows,
    n_cols,
    sdy,
    sx,
    sdx,
    rows_per_prog,
    HAS_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RNE_FIX: tl.constexpr,
):
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    for row32 in range(row_start, row_end):
        row = tl.cast(row32, tl.int64)
        rstd = tl.load(RSTD + row)
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for c0 in range(0, n_cols, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            cmask = cols < n_cols
            dy = tl.load(DY + row * sdy + cols, mask=cmask, other=0.0).to(tl.float32)
            x = tl.load(X + row * sx + cols, mask=cmask, other=0.0).to(tl.float32)
            if HAS_W:
                dy = dy * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
            acc += dy * x
        c = tl.sum(acc, axis=0) * rstd / n_cols
        for c0 in range(0, n_cols, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            cmask = cols < n_cols
            dy = tl.load(DY + row * sdy + cols, mask=cmask, other=0.0).to(tl.float32)
            xhat = tl.load(X + row * sx + cols, mask=cmask, other=0.0).to(tl.float32) * rstd
            if HAS_W:
                g = dy * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
                # this program owns row `pid` of the partial buffer: no other writer, no atomics
                p = DWP + pid * n_cols + cols
                tl.store(p, tl.load(p, mask=cmask, other=0.0) + dy * xhat, mask=cmask)
            else:
                g = dy
            dx = (g - xhat * c) * rstd
            tl.store(DX + row * sdx + cols, _cast(dx, DX, RNE_FIX), mask=cmask)


# ---------------------------------------------------------------------------------------------
# Launch heuristics
# ---------------------------------------------------------------------------------------------


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Warps are chosen from the register counts ptxas reports for sm_90 (compiled here without a GPU,
# `cuobjdump --dump-resource-usage`): ~16 fp32 elements a thread in the forward (bf16,
# H=4096 at 8 warps: 64 registers; H=8192 at 16 warps: 60) and ~8 in the backward, which holds
# dy, x, γ and the dγ accumulator at once (H=4096 at 8 warps needed 147 registers — one resident
# program per SM — and H=8192 at 8 warps 248; at 16/32 warps: 58/55, no spills). A fused
# backward row of 16384 spills even at 32 warps, so backward rows above 8192 use the looped kernel.
MAX_FUSED_N_BWD = 8192


def _fwd_warps(elements: int) -> int:
    return max(1, min(16, elements // 512))


def _bwd_warps(elements: int) -> int:
    return max(1, min(32, elements // 256))


def _settings(n_cols: int, device: torch.device, max_fused_n: int, backward: bool = False):
    """(looped, BLOCK_M, BLOCK_N, num_warps) for a row width (memoised: asked on every call)."""
    return _settings_of(n_cols, device.type, max_fused_n, backward)


@functools.cache
def _settings_of(n_cols: int, device_type: str, max_fused_n: int, backward: bool):
    warps = _bwd_warps if backward else _fwd_warps
    if backward:
        max_fused_n = min(max_fused_n, MAX_FUSED_N_BWD)
    if n_cols > max_fused_n:
        block_n = min(LOOP_BLOCK_N, triton.next_power_of_2(max_fused_n))
        return True, 1, block_n, min(16, warps(block_n))
    block_n = triton.next_power_of_2(n_cols)
    # GPU: ≥ ~2k elements per program so small rows still move enough bytes per launch slot.
    # Interpreter: far more per program, because every program instance costs Python time.
    target = FWD_TARGET_ELEMENTS if device_type == "cuda" else 16384
    block_m = max(1, min(64, target // block_n))
    return False, block_m, block_n, warps(block_m * block_n)


_NO_CONTEXT = contextlib.nullcontext()


def _on(device: torch.device):
    """Triton launches on the *current* CUDA device: make that the tensor's own (entering
    torch.cuda.device costs microseconds a call, so only where it is another device)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return _NO_CONTEXT


_interpreting: bool | None = None


def _check(x: torch.Tensor):
    global _interpreting
    if x.is_cuda:
        return
    if _interpreting is None:
        _interpreting = interpreter_active()
    if not _interpreting:
        from normswap.errors import NormswapError

        raise NormswapError(
            "the Triton backend needs a CUDA tensor, or TRITON_INTERPRET=1 set before triton is imported "
            "(use NORMSWAP_KERNEL=auto on CPU)"
        )


def forward(x, weight, residual, eps, *, max_fused_n: int = MAX_FUSED_N):
    _check(x)
    n, h = x.shape
    y = torch.empty((n, h), dtype=x.dtype, device=x.device)
    rstd = torch.empty((n,), dtype=torch.float32, device=x.device)
    summed = torch.empty((n, h), dtype=x.dtype, device=x.device) if residual is not None else None
    if n == 0:
        return y, rstd, summed
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    if residual is not None and residual.dtype != x.dtype:
        residual = residual.to(x.dtype)
    w = weight.contiguous() if weight is not None else None
    looped, block_m, block_n, warps = _settings(h, x.device, max_fused_n)
    fix = x.device.type != "cuda"
    # unused pointer arguments get a real tensor so the signature stays typed
    r_arg = residual if residual is not None else x
    s_arg = summed if summed is not None else y
    w_arg = w if w is not None else x
    common = (
        x,
        r_arg,
        w_arg,
        y,
        s_arg,
        rstd,
        n,
        h,
        x.stride(0),
        r_arg.stride(0),
        y.stride(0),
        s_arg.stride(0),
        float(eps),
    )
    with _on(x.device):
        if looped:
            _fwd_looped[(n,)](
                *common, HAS_W=w is not None, HAS_R=residual is not None, BLOCK_N=block_n, RNE_FIX=fix, num_warps=warps
            )
        else:
            grid = (triton.cdiv(n, block_m),)
            _fwd_fused[grid](
                *common,
                HAS_W=w is not None,
                HAS_R=residual is not None,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                RNE_FIX=fix,
                num_warps=warps,
            )
    return y, rstd, summed


def backward(dy, xin, rstd, weight, *, max_fused_n: int = MAX_FUSED_N):
    _check(xin)
    n, h = xin.shape
    dx = torch.empty((n, h), dtype=xin.dtype, device=xin.device)
    has_w = weight is not None
    if n == 0:
        return dx, (torch.zeros((h,), dtype=torch.float32, device=xin.device) if has_w else None)
    assert dy.stride(-1) == 1 and xin.stride(-1) == 1
    looped, block_m, block_n, warps = _settings(h, xin.device, max_fused_n, backward=True)
    fix = xin.device.type != "cuda"
    row_blocks = triton.cdiv(n, block_m)
    if has_w:
        # persistent: a few programs per SM, so the [P, H] partial buffer stays small
        p_max = BWD_PROGRAMS_PER_SM * _sm_count(xin.device.index or 0) if xin.device.type == "cuda" else 3
        programs = max(1, min(p_max, row_blocks))
    else:
        programs = row_blocks
    # whole row blocks per program, so no program's slice straddles a block boundary
    rows_per_prog = triton.cdiv(triton.cdiv(n, programs), block_m) * block_m
    programs = triton.cdiv(n, rows_per_prog)
    alloc = torch.zeros if looped else torch.empty  # the looped kernel accumulates into it
    dwp = alloc((programs, h), dtype=torch.float32, device=xin.device) if has_w else rstd
    w_arg = weight.contiguous() if has_w else xin
    args = (dy, xin, w_arg, rstd, dx, dwp, n, h, dy.stride(0), xin.stride(0), dx.stride(0), rows_per_prog)
    with _on(xin.device):
        if looped:
            _bwd_looped[(programs,)](*args, HAS_W=has_w, BLOCK_N=block_n, RNE_FIX=fix, num_warps=warps)
        else:
            _bwd_fused[(programs,)](*args, HAS_W=has_w, BLOCK_M=block_m, BLOCK_N=block_n, RNE_FIX=fix, num_warps=warps)
    dw = dwp.sum(0) if has_w else None
    return dx, dw
