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
from contextlib import contextmanager

import torch

from normswap.checkpoint.tensor_source import numel
from normswap.errors import NormswapError

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
    which costs about as much as the casts and element-wise arithmetic done in it. Each tag is one
    role in an op (the bytes read, the element-wise block, its float64 form for a reduction, the
    output block); a thread holds one block per tag, so memory stays at a few blocks per worker.
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


@contextmanager
def intra_op_threads(n: int):
    """torch's own intra-op thread count set to ``n`` meanwhile: where our threads each take a row
    block or a tensor, torch's parallel regions on top of them only wait for each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def source_keys(op: dict) -> list[str]:
    """The source tensors an op reads."""
    keys = [op.get(k) for k in ("src", "weight", "gamma", "beta", "scale_out")]
    return [k for k in keys if k]


def fusable(weight_op: dict, bias_op: dict, load_dtype: torch.dtype, out_dtype: torch.dtype, compute=None) -> bool:
    """Whether ``bias_op`` (W·β) can be summed from the row blocks ``weight_op`` reads anyway.

    Both must read the same matrix in the same layout, and a block in the arithmetic dtype must
    widen to float64 exactly (the load dtype is no wider than it), so that the fused sum sees the
    very float64 numbers ``_linear_bias`` reads on its own: the bits do not depend on the fusion.
    """
    calc = compute or compute_dtype(out_dtype)
    return (
        weight_op.get("op") == "linear_weight"
        and bias_op.get("op") == "linear_bias"
        and bool(bias_op.get("beta"))
        and weight_op.get("src") == bias_op.get("weight")
        and weight_op.get("layout") == bias_op.get("layout")
        and weight_op.get("layout") in ("linear", "conv1d")
        and not weight_op.get("scale_out")
        and torch.promote_types(load_dtype, calc) == calc
    )


def run(op: dict, shape, read, shape_of, emit, out_dtype, *, compute=None, device="cpu", bias=None, pool=None) -> None:
    """Evaluate one derivation of an output of ``shape``.

    ``read(key, start=None, stop=None, out=None)`` returns rows of a source tensor (its load dtype,
    on the CPU; a file source reads them into the uint8 buffer ``out`` when given), ``shape_of(key)``
    its shape; ``emit(tensor, row)`` receives the result's row blocks in
    ``out_dtype``. ``bias``: ``(op, emit, out_dtype)`` of a ``linear_bias`` that ``fusable`` allows:
    its W·β is summed from this op's row blocks as they pass, instead of reading W again.
    ``pool``: a thread pool that computes the row blocks side by side (``each``); sums over blocks
    are still added in block order, so the bits do not change.
    """
    calc = compute or compute_dtype(out_dtype)
    each = each_block(pool)
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

    def putter(emit, out_dtype):
        def put(t, row=0):
            if t.dtype == out_dtype and t.device.type == "cpu":
                emit(t, row)
            elif reuse:
                emit(SCRATCH.take("out", t.shape, out_dtype).copy_(t), row)
            else:
                emit(t.to(out_dtype).cpu(), row)

        return put

    put = putter(emit, out_dtype)

    def wide(x):
        """x's float64 form for a reduction (the same values: the cast is exact)."""
        return SCRATCH.take("wide", x.shape, F64).copy_(x) if reuse else x.to(F64)

    kind = op["op"]
    if kind == "ones":
        put(torch.ones(op["size"], dtype=out_dtype))
    elif kind == "copy":
        each(lambda ab: put(get(op["src"], *ab, dtype=out_dtype, tag="block"), ab[0]), row_blocks(shape))
    elif kind == "add_constant":  # a (1+γ)-parametrised norm's γ kept on the RMSNorm
        put(get(op["src"], dtype=F64) + op["add"])
    elif kind == "divide_by_gamma":  # β kept beside a folded γ: the readers see W·diag(γ)·(β/γ) = W·β
        put(_beta_over_gamma(op, get(op["src"], dtype=F64), get(op["gamma"], dtype=F64) + op.get("gamma_offset", 0.0)))
    elif kind == "center_rows":

        def center(ab):
            x = get(op["src"], *ab, tag="block")
            put(_subtract(x, wide(x).mean(dim=-1, keepdim=True)), ab[0])

        each(center, row_blocks(shape))
    elif kind == "linear_weight":
        total = _BiasSum(bias[0], get) if bias else None
        _linear_weight(op, shape, get, put, wide, calc, total, each)
        if total is not None:
            putter(*bias[1:])(total.result())
    elif kind == "linear_bias":
        put(_linear_bias(op, get, shape_of, each))
    else:
        raise ValueError(f"unknown conversion op {kind!r}")


def check_values(op: dict, read) -> None:
    """Refuse, before any tensor is computed, an op whose source values have no exact result (a β kept
    beside a γ that is 0 where β is not); ``read(key)`` returns a source tensor. Reads vectors only."""
    if op["op"] == "divide_by_gamma":
        _beta_over_gamma(op, read(op["src"]).to(F64), read(op["gamma"]).to(F64) + op.get("gamma_offset", 0.0))


def _beta_over_gamma(op, beta, gamma):
    """β/γ, and 0 where γ and β are both 0; a β_j ≠ 0 beside γ_j = 0 has no such form (its W_j·β_j
    reaches the readers through nothing the RMSNorm feeds them), so it is refused."""
    bad = (gamma == 0) & (beta != 0)
    if bool(bad.any()):
        j = int(bad.nonzero()[0])
        raise NormswapError(
            f"cannot keep {op['src']} beside a folded γ: γ is 0 at index {j} where β is {float(beta[j]):.3g}, so no "
            "bias on the RMSNorm reaches the readers there; convert with --gamma keep (or without --beta keep)"
        )
    return torch.where(gamma == 0, torch.zeros_like(beta), beta / torch.where(gamma == 0, 1.0, gamma))


def each_block(pool):
    """``each(fn, blocks)``: fn of every block, results in block order; on ``pool``'s threads when given."""
    if pool is None:
        return lambda fn, blocks: [fn(ab) for ab in blocks]
    return lambda fn, blocks: list(pool.map(fn, blocks))


_EACH_SERIAL = each_block(None)  # the default ``each``: every block in turn, on the calling thread


def _linear_weight(op, shape, get, put, wide, calc, bias_sum=None, each=_EACH_SERIAL):
    """W·diag(γ) (γ scales the input axis), then optionally centred over the output axis; W's row
    blocks also go to ``bias_sum`` (a fused W·β, see ``run``) before γ touches them."""
    gamma64 = get(op["gamma"], dtype=F64) + op.get("gamma_offset", 0.0) if op.get("gamma") else None
    # a layer scale λ applied to this writer's output (λ⊙(Wx)) folds into its rows: diag(λ)·W
    # (``fusable`` keeps a W·β away from such a weight: the bias reads the unscaled W)
    scale64 = get(op["scale_out"], dtype=F64) if op.get("scale_out") else None
    blocks = row_blocks(shape)

    def add_parts(parts):  # the fused W·β's block contributions, in block order
        for (a, b), part in zip(blocks, parts):
            if part is not None:
                bias_sum.add(part, a, b)

    if op["layout"] == "linear":  # [out, in]: γ scales columns; centring averages each column
        gamma = gamma64.to(calc) if gamma64 is not None else None
        mean = None
        if op.get("center"):

            def column_sums(ab):
                x = get(op["src"], *ab, dtype=F64, tag="wide")
                if scale64 is not None:
                    x = x * scale64[ab[0] : ab[1]].to(x.device).unsqueeze(1)
                return x.sum(dim=0), bias_sum.part(x, *ab) if bias_sum is not None else None

            sums = each(column_sums, blocks)
            colsum = torch.zeros(shape[1], dtype=F64, device=gamma64.device if gamma64 is not None else None)
            for total, _ in sums:  # in block order: the same sum whatever computed the blocks
                colsum = colsum.to(total.device) + total
            add_parts([part for _, part in sums])
            mean = colsum / shape[0]
            mean = mean * gamma64 if gamma64 is not None else mean

        def finish(ab):
            x = get(op["src"], *ab, tag="block")
            part = bias_sum.part(wide(x), *ab) if bias_sum is not None and mean is None else None
            if gamma is not None:
                x.mul_(gamma)
            if scale64 is not None:
                x.mul_(scale64[ab[0] : ab[1]].to(device=x.device, dtype=x.dtype).unsqueeze(1))
            put(_subtract(x, mean) if mean is not None else x, ab[0])
            return part

        add_parts(each(finish, blocks))
        return
    if scale64 is not None:
        raise ValueError("scale_out folds into a Linear's rows only")

    # conv1d [in, out] (and embeddings): γ scales rows; centring averages each row
    def finish_rows(ab):
        a, b = ab
        x = get(op["src"], a, b, tag="block")
        g = gamma64[a:b].unsqueeze(1) if gamma64 is not None else None
        x64 = wide(x) if op.get("center") or bias_sum is not None else None
        part = bias_sum.part(x64, a, b) if bias_sum is not None else None
        mean = x64.mean(dim=1, keepdim=True) if op.get("center") else None
        if mean is not None and g is not None:
            mean = mean * g
        if g is not None:
            x.mul_(g.to(calc))
        put(_subtract(x, mean) if mean is not None else x, a)
        return part

    add_parts(each(finish_rows, blocks))


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


def _linear_bias(op, get, shape_of, each=_EACH_SERIAL):
    """c' = c + W·β with the *original* W (y = W(γ⊙n + β) + c), optionally centred; float64 throughout."""
    total = _BiasSum(op, get)
    if op.get("beta"):
        blocks = row_blocks(shape_of(op["weight"]))
        parts = each(lambda ab: total.part(get(op["weight"], *ab, dtype=F64, tag="wide"), *ab), blocks)
        for (r0, r1), part in zip(blocks, parts):  # in block order
            total.add(part, r0, r1)
    return total.result()


class _BiasSum:
    """c + W·β accumulated over W's row blocks (float64), then optionally centred: ``_linear_bias``,
    whether it reads W itself or is handed the blocks another op reads (``run``'s ``bias``).
    ``part`` (any thread) is one block's contribution, ``add`` (in block order) sums it in."""

    def part(self, w64, r0, r1):
        if self.op["layout"] == "linear":  # [out, in] @ β[in]: rows r0:r1 of the result
            return w64 @ self.beta
        return self.beta[r0:r1] @ w64  # β[in] @ [in, out]: the row blocks are slices of the sum

    def add(self, part, r0, r1):
        if self.op["layout"] == "linear":
            self.b[r0:r1] += part
        else:
            self.b += part

    def __init__(self, op, get):
        self.op = op
        self.b = get(op["src"], dtype=F64) if op.get("src") else torch.zeros(op["size"], dtype=F64)
        self.beta = get(op["beta"], dtype=F64) if op.get("beta") else None
        if self.beta is not None:
            self.b = self.b.to(self.beta.device)
        self.scale = get(op["scale_out"], dtype=F64) if op.get("scale_out") else None

    def result(self):
        b = self.b * self.scale.to(self.b.device) if self.scale is not None else self.b
        return b - b.mean() if self.op.get("center") else b
