"""The tensor arithmetic of a conversion: one function per derivation op, evaluated in row blocks.

Every output tensor is a function of *source* tensors only (never of another output), so tensors
can be computed in any order and on any thread. Each op reads its inputs in blocks of rows
(``block_rows``), so memory stays at a few blocks whatever the tensor's size, and the blocking
depends only on the tensor's shape: every source (files, state dict, .bin) gives the same bits.

Precision policy (measured: bench/convert_precision.py, docs/conversion-precision.md):
- float32/float64 outputs: all arithmetic in float64, cast once at the end;
- 16-bit outputs: element-wise arithmetic in float32 (a product of two 16-bit numbers is exact
  there), every reduction (row/column means, W·β) accumulated in float64, the float64 mean
  subtracted as two float32 terms (``_subtract``), cast once at the end. The result can differ
  from the all-float64 result only where a float32 rounding lands next to a 16-bit rounding
  boundary (double rounding): by one unit in the last place of the output dtype.
``compute`` overrides the choice (the precision benchmark passes float64 for its reference).
"""

from __future__ import annotations

import threading

import torch

from normswap.convert.source import numel

BLOCK_ELEMENTS = 1 << 20  # elements per row block: ~4 MB in float32, small enough to stay in cache levels
F64 = torch.float64


def compute_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The element-wise arithmetic dtype for an output dtype (reductions are always float64)."""
    return torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else F64


def block_rows(shape) -> int:
    row = 1
    for s in shape[1:]:
        row *= int(s)
    return max(1, BLOCK_ELEMENTS // max(1, row))


def row_blocks(shape):
    """[a, b) row ranges covering dimension 0 of ``shape``."""
    n = int(shape[0]) if shape else 1
    step = block_rows(shape)
    return [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]


class _Scratch(threading.local):
    """Per-thread buffers for row blocks, reused block after block and tensor after tensor.

    A fresh multi-megabyte buffer is fresh pages: the kernel zero-fills each one on first touch,
    which costs about as much as the casts and element-wise arithmetic done in it. Each tag is one role in an op (the bytes read, the
    element-wise block, its float64 form for a reduction, the output block); a thread holds one
    block per tag, so memory stays at a few blocks per worker.
    """

    def take(self, tag: str, shape, dtype: torch.dtype) -> torch.Tensor:
        n = numel(shape) * dtype.itemsize
        buf = self.__dict__.get(tag)
        if buf is None or buf.numel() < n:
            buf = self.__dict__[tag] = torch.empty(n, dtype=torch.uint8)
        return buf[:n].view(dtype).view(tuple(shape))


SCRATCH = _Scratch()


def read_buffer(shape, dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer for the raw bytes of one row block (``read(..., out=)``)."""
    return SCRATCH.take("read", (numel(shape) * dtype.itemsize,), torch.uint8)


def source_keys(op: dict) -> list[str]:
    """The source tensors an op reads."""
    keys = [op.get(k) for k in ("src", "weight", "gamma", "beta", "scale_out")]
    return [k for k in keys if k]


def run(op: dict, shape, read, shape_of, emit, out_dtype, *, compute=None, device="cpu") -> None:
    """Evaluate one derivation of an output of ``shape``.

    ``read(key, start=None, stop=None, out=None)`` returns rows of a source tensor (its load dtype,
    on the CPU; a file source reads them into the uint8 buffer ``out`` when given), ``shape_of(key)``
    its shape; ``emit(tensor, row)`` receives the result's row blocks in
    ``out_dtype``.
    """
    calc = compute or compute_dtype(out_dtype)
    dev = torch.device(device)
    reuse = dev.type == "cpu"  # blocks go to this thread's scratch buffers; another device allocates its own

    def get(key, a=None, b=None, dtype=None, tag=None):
        """A private copy of rows a:b of ``key`` in ``dtype`` (the ops below work in place);
        ``tag`` names the scratch buffer a row block lives in until this thread's next block."""
        dtype = dtype or calc
        if not (reuse and tag):
            return read(key, a, b).to(device=dev, dtype=dtype, copy=True)
        shape = (b - a, *shape_of(key)[1:])
        raw = read(key, a, b, out=read_buffer(shape, torch.float64))
        return SCRATCH.take(tag, shape, dtype).copy_(raw)  # copy_ casts exactly like .to()

    def put(t, row=0):
        if t.dtype == out_dtype and t.device.type == "cpu":
            emit(t, row)
        elif reuse:
            emit(SCRATCH.take("out", t.shape, out_dtype).copy_(t), row)
        else:
            emit(t.to(out_dtype).cpu(), row)

    def wide(x):
        """x's float64 form for a reduction (the same values: the cast is exact)."""
        return SCRATCH.take("wide", x.shape, F64).copy_(x) if reuse else x.to(F64)

    kind = op["op"]
    if kind == "ones":
        put(torch.ones(op["size"], dtype=out_dtype))
    elif kind == "copy":
        for a, b in row_blocks(shape):
            put(get(op["src"], a, b, dtype=out_dtype, tag="block"), a)
    elif kind == "add_constant":  # a (1+γ)-parametrised norm's γ kept on the RMSNorm
        put(get(op["src"], dtype=F64) + op["add"])
    elif kind == "center_rows":
        for a, b in row_blocks(shape):
            x = get(op["src"], a, b, tag="block")
            put(_subtract(x, wide(x).mean(dim=-1, keepdim=True)), a)
    elif kind == "linear_weight":
        _linear_weight(op, shape, get, put, wide, calc)
    elif kind == "linear_bias":
        put(_linear_bias(op, get, shape_of))
    else:
        raise ValueError(f"unknown conversion op {kind!r}")


def _linear_weight(op, shape, get, put, wide, calc):
    """W·diag(γ) (γ scales the input axis), then optionally centred over the output axis."""
    gamma64 = get(op["gamma"], dtype=F64) + op.get("gamma_offset", 0.0) if op.get("gamma") else None
    # a layer scale λ applied to this writer's output (λ⊙(Wx)) folds into its rows: diag(λ)·W
    scale64 = get(op["scale_out"], dtype=F64) if op.get("scale_out") else None
    blocks = row_blocks(shape)
    if op["layout"] == "linear":  # [out, in]: γ scales columns; centring averages each column
        gamma = gamma64.to(calc) if gamma64 is not None else None
        mean = None
        if op.get("center"):
            colsum = torch.zeros(shape[1], dtype=F64, device=gamma64.device if gamma64 is not None else None)
            for a, b in blocks:
                x = get(op["src"], a, b, dtype=F64, tag="wide")
                if scale64 is not None:
                    x = x * scale64[a:b].to(x.device).unsqueeze(1)
                colsum = colsum.to(x.device) + x.sum(dim=0)
            mean = colsum / shape[0]
            mean = mean * gamma64 if gamma64 is not None else mean
        for a, b in blocks:
            x = get(op["src"], a, b, tag="block")
            if gamma is not None:
                x.mul_(gamma)
            if scale64 is not None:
                x.mul_(scale64[a:b].to(device=x.device, dtype=x.dtype).unsqueeze(1))
            put(_subtract(x, mean) if mean is not None else x, a)
        return
    if scale64 is not None:
        raise ValueError("scale_out folds into a Linear's rows only")
    # conv1d [in, out] (and embeddings): γ scales rows; centring averages each row
    for a, b in blocks:
        x = get(op["src"], a, b, tag="block")
        g = gamma64[a:b].unsqueeze(1) if gamma64 is not None else None
        mean = wide(x).mean(dim=1, keepdim=True) if op.get("center") else None
        if mean is not None and g is not None:
            mean = mean * g
        if g is not None:
            x.mul_(g.to(calc))
        put(_subtract(x, mean) if mean is not None else x, a)


def _subtract(x, mean64):
    """x - mean, in place in x's dtype, with the float64 mean split into two float32 terms.

    Where x is close to the mean (a centred value near zero) ``x - hi`` is exact, so the result
    is the correctly rounded difference rather than one polluted by the mean's own float32
    rounding (which, relative to a near-zero result, is many 16-bit ulps).
    """
    hi = mean64.to(x.dtype)
    x.sub_(hi)
    if x.dtype != F64:
        x.sub_((mean64 - hi.to(F64)).to(x.dtype))
    return x


def _linear_bias(op, get, shape_of):
    """c' = c + W·β with the *original* W (y = W(γ⊙n + β) + c), optionally centred; float64 throughout."""
    b = get(op["src"], dtype=F64) if op.get("src") else torch.zeros(op["size"], dtype=F64)
    if op.get("beta"):
        beta = get(op["beta"], dtype=F64)
        b = b.to(beta.device)
        for r0, r1 in row_blocks(shape_of(op["weight"])):
            w = get(op["weight"], r0, r1, dtype=F64, tag="wide")
            if op["layout"] == "linear":  # [out, in] @ β[in], row block by row block
                b[r0:r1] += w @ beta
            else:  # β[in] @ [in, out]: the row blocks are slices of the sum
                b += beta[r0:r1] @ w
    if op.get("scale_out"):
        b = b * get(op["scale_out"], dtype=F64).to(b.device)
    if op.get("center"):
        b = b - b.mean()
    return b

