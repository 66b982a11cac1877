"""The compiled CPU RMSNorm kernel (normswap.kernels.cpu) against a float64 reference.

Builds the extension once (cached under ~/.cache/normswap); every kernel test skips with the
reason when the kernel is unavailable, and test_builds_where_toolchain_exists fails instead of
skipping when a compiler and ninja are present, so a broken build cannot hide behind skips.
"""

from __future__ import annotations

import math
import os
import shutil
import sys

import pytest
import torch

from normswap.kernels import cpu
from normswap.testing import cpu_isa

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 1000 ends on the 8-lane loop, 1001 on the scalar tail, 4096 spans several parallel blocks.
HIDDEN = [1, 7, 64, 384, 1000, 1001, 4096]
# The baseline (SSE2) variant shares the source with the AVX2 one; a subset covers its tails.
HIDDEN_BASELINE = [7, 1001, 4096]
EPS = 1e-5
# Result tolerance per storage dtype: the kernel computes in fp32 and rounds once, so the error
# is about one rounding of the output type (fp32: the fp32 arithmetic itself).
RTOL = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _toolchain_present() -> bool:
    from torch.utils import cpp_extension

    return (
        sys.platform.startswith("linux")
        and cpp_extension.is_ninja_available()
        and shutil.which(os.environ.get("CXX", "c++")) is not None
    )


@pytest.fixture(scope="module")
def kern():
    if not cpu.available():
        pytest.skip(f"CPU kernel unavailable: {cpu.unavailable_reason()}")
    return cpu


def _isas():
    # The baseline (SSE2) variant is what CPUs without AVX2 run: test it here too.
    return ["baseline", "avx2"]


@pytest.fixture(params=_isas())
def isa(request, kern):
    if not cpu_isa(request.param):
        pytest.skip(f"ISA variant {request.param} not runnable on this CPU/build")
    yield request.param
    cpu_isa("best")


def _poison():
    # Freed NaN-filled memory is what the kernel's fresh outputs are likely to be carved from, so
    # an element the kernel forgets to write shows up as NaN instead of plausible old data.
    t = torch.full((1 << 20,), float("nan"))
    del t


def _inputs(n, h, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    res = torch.randn(n, h, generator=g).to(dtype)
    w = (1.0 + 0.5 * torch.randn(h, generator=g)).to(dtype)
    dy = torch.randn(n, h, generator=g).to(dtype)
    return x, res, w, dy


def _dx_scale(x, w, dy, eps):
    """Magnitude of dx's first term, rstd*dy*w: dx = rstd*g - x*c cancels (totally for H=1),
    so its error is bounded relative to the terms, not to dx itself."""
    rstd = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    g = dy.double() * (w.double() if w is not None else 1.0)
    return (rstd * g).abs().max().item()


def _reference(x, w, dy, eps):
    """float64 forward + backward of y = x * rsqrt(mean(x^2) + eps) * w, inputs as given."""
    xd = x.double().requires_grad_()
    wd = w.double().requires_grad_() if w is not None else None
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    y = xd * rstd
    if wd is not None:
        y = y * wd
    y.backward(dy.double())
    return y.detach(), rstd.detach().squeeze(-1), xd.grad, (wd.grad if wd is not None else None)


def _assert_close(out, ref, rtol, what, scale_atol=None, scale=None):
    """Every element within rtol*|ref| + atol, atol = scale_atol * scale, scale defaulting to the
    tensor's magnitude (pure relative error is meaningless near zero)."""
    assert out.shape == ref.shape, what
    o = out.double()
    assert not torch.isnan(o).any(), f"{what}: NaN (unwritten or broken element)"
    if scale is None:
        scale = ref.abs().max().item()
    atol = (scale_atol if scale_atol is not None else rtol) * max(scale, 1e-30)
    err = (o - ref).abs()
    bound = rtol * ref.abs() + atol
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements off; worst err {err.max().item():.3g} "
        f"at ref {ref.flatten()[err.argmax()].item():.3g}"
    )


# ---------------------------------------------------------------------------------------------
# availability


def test_builds_where_toolchain_exists():
    if os.environ.get("NORMSWAP_CPU_KERNEL", "") == "0":
        pytest.skip("kernel disabled by NORMSWAP_CPU_KERNEL=0 in this environment")
    if not _toolchain_present():
        pytest.skip("no ninja or C++ compiler here: the fallback is what users get")
    assert cpu.available(), f"compiler and ninja present but the CPU kernel did not build: {cpu.unavailable_reason()}"
    assert cpu.isa() in ("avx2", "baseline")
    assert cpu.supports(torch.float32) and cpu.supports(torch.bfloat16)
    assert not cpu.supports(torch.float64)


def test_env_switch_disables_without_raising(monkeypatch):
    """NORMSWAP_CPU_KERNEL=0 is the `cpu` record's switch (normswap.kernels.implementations): the record is
    not ready, `auto` runs something else, and asking for it by name says why in one line."""
    from normswap.errors import NormswapError
    from normswap.kernels import implementations as registry
    from normswap.kernels import rms_norm
    from normswap.modules import RMSNorm
    from normswap.testing import forget_kernel_choices

    monkeypatch.setenv("NORMSWAP_AUTOTUNE", "0")  # static order, in memory only
    forget_kernel_choices()
    monkeypatch.setenv("NORMSWAP_CPU_KERNEL", "0")
    assert registry.cpu_ready() is False
    m = RMSNorm(32)
    with torch.no_grad():
        m(torch.randn(2, 32))
    assert "cpu" not in m.kernels_ran.values(), m.kernels_ran
    with pytest.raises(NormswapError, match="NORMSWAP_CPU_KERNEL=0"):
        rms_norm(torch.randn(2, 32), backend="cpu")
    monkeypatch.delenv("NORMSWAP_CPU_KERNEL")  # the control: switched on, the record is ready again
    forget_kernel_choices()
    if _toolchain_present():
        assert registry.cpu_ready() is True
        m = RMSNorm(32)
        with torch.no_grad():
            m(torch.randn(2, 32))
        assert set(m.kernels_ran.values()) == {"cpu"}, m.kernels_ran
    forget_kernel_choices()


def test_broken_compiler_falls_back_quietly(monkeypatch, tmp_path, capfd):
    # A fresh process state with a "compiler" that always fails, in an empty cache dir: available()
    # must say False with a reason, never raise, and print nothing (compiler output goes to a log).
    monkeypatch.setattr(cpu, "_ext", None)
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_reason", None)
    monkeypatch.setenv("NORMSWAP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")
    monkeypatch.delenv("NORMSWAP_CPU_KERNEL", raising=False)
    assert cpu.available() is False
    assert cpu.unavailable_reason()
    out, err = capfd.readouterr()
    # the one line announcing a first build is allowed; no compiler output reaches the terminal
    assert (
        out == ""
        and len(err.splitlines()) <= 1
        and all(line.startswith("normswap: building normswap's C++ norm kernel") for line in err.splitlines())
    ), err
    with pytest.raises(RuntimeError, match="not available"):
        cpu.forward(torch.ones(2, 4), None, None, EPS)


def test_missing_compiler_is_detected_before_building(monkeypatch):
    monkeypatch.setattr(cpu, "_ext", None)
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_reason", None)
    monkeypatch.setenv("CXX", "normswap-no-such-compiler")
    monkeypatch.delenv("NORMSWAP_CPU_KERNEL", raising=False)
    assert cpu.available() is False
    assert "compiler" in cpu.unavailable_reason()


# ---------------------------------------------------------------------------------------------
# numerics


@pytest.mark.parametrize(
    "isa,h", [("avx2", h) for h in HIDDEN] + [("baseline", h) for h in HIDDEN_BASELINE], indirect=["isa"]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_forward_backward_match_float64(kern, isa, dtype, h):
    if not kern.supports(dtype):
        pytest.skip(f"{dtype} not supported by this build")
    n = 37  # not a multiple of any block size; for h=4096 spans several parallel blocks
    x, res, w_same, dy = _inputs(n, h, dtype, seed=h)
    rtol = RTOL[dtype]
    for wname, w in (("none", None), ("same", w_same), ("fp32", w_same.float())):
        for use_res in (False, True):
            what = f"{isa} {dtype} H={h} weight={wname} residual={use_res}"
            _poison()
            y, rstd, summed = kern.forward(x, w, res if use_res else None, EPS)
            assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (n,)
            if use_res:
                # summed is x + residual rounded to the storage type, bit for bit like torch.
                assert summed.dtype == dtype
                assert torch.equal(summed, x + res), what
                xn = summed
            else:
                assert summed is None
                xn = x
            y_ref, rstd_ref, dx_ref, dw_ref = _reference(xn, w, dy, EPS)
            _assert_close(rstd, rstd_ref, 1e-5, what + " rstd")
            _assert_close(y, y_ref, rtol, what + " y", scale_atol=rtol * 1e-2)
            # Documented cast order, checked bit-exactly: normalise in fp32, x weight in fp32, cast once.
            y_doc = xn.float() * rstd[:, None]
            if w is not None:
                y_doc = y_doc * w.float()
            assert torch.equal(y, y_doc.to(dtype)), what + " cast order"

            _poison()
            dx, dw = kern.backward(dy, xn, rstd, w)
            assert dx.dtype == dtype
            _assert_close(
                dx, dx_ref, rtol, what + " dx", scale_atol=max(rtol * 0.1, 1e-5), scale=_dx_scale(xn, w, dy, EPS)
            )
            if w is None:
                assert dw is None
            else:
                assert dw.dtype == torch.float32 and dw.shape == (h,)
                # fp32 accumulation over rows: error relative to the sum of |terms| per column.
                terms = (dy.double() * xn.double() * rstd_ref[:, None]).abs().sum(0)
                err = (dw.double() - dw_ref).abs()
                assert (err <= 1e-5 * terms + 1e-30).all(), what + f" dweight err {err.max().item():.3g}"


def test_cast_order_check_is_discriminating():
    # Negative control for the bit-exact cast-order assertion above: the other convention
    # (cast to bf16, then multiply by the weight) differs on random data, so that check can fail.
    x, _, w, _ = _inputs(64, 384, torch.bfloat16, seed=1)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + EPS)
    ours = ((x.float() * rstd[:, None]) * w.float()).to(torch.bfloat16)
    other = (x.float() * rstd[:, None]).to(torch.bfloat16) * w
    assert not torch.equal(ours, other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("h", [7, 384, 4096])
def test_special_rows(kern, isa, dtype, h):
    # constant, all-zero (eps decides rstd), tiny (1e-6: eps dominates), huge (1e4) rows
    g = torch.Generator().manual_seed(7)
    x = torch.stack(
        [
            torch.full((h,), 3.0),
            torch.zeros(h),
            1e-6 * torch.randn(h, generator=g),
            1e4 * torch.randn(h, generator=g),
            torch.randn(h, generator=g),
        ]
    ).to(dtype)
    w = (1.0 + 0.5 * torch.randn(h, generator=g)).to(dtype)
    dy = torch.randn(x.shape, generator=g).to(dtype)
    rtol = RTOL[dtype]
    for weight in (None, w):
        y, rstd, _ = kern.forward(x, weight, None, EPS)
        y_ref, rstd_ref, dx_ref, dw_ref = _reference(x, weight, dy, EPS)
        assert rstd[1].item() == pytest.approx(1 / math.sqrt(EPS), rel=1e-6)  # zero row: eps only
        assert torch.all(y[1] == 0)
        assert rstd[2].item() == pytest.approx(rstd_ref[2].item(), rel=1e-5)  # tiny row ~ 1/sqrt(eps)
        dx, dw = kern.backward(dy, x, rstd, weight)
        for i in range(x.shape[0]):  # per row: scales differ by 1e10 between rows
            _assert_close(rstd[i : i + 1], rstd_ref[i : i + 1], 1e-5, f"row {i} rstd")
            _assert_close(y[i], y_ref[i], rtol, f"row {i} y", scale_atol=rtol * 1e-2)
            _assert_close(
                dx[i],
                dx_ref[i],
                rtol,
                f"row {i} dx",
                scale_atol=max(rtol * 0.1, 1e-5),
                scale=_dx_scale(x[i : i + 1], weight, dy[i : i + 1], EPS),
            )
        # zero row: dx = rstd * dy * w exactly in math
        expect0 = rstd_ref[1] * dy[1].double() * (weight.double() if weight is not None else 1.0)
        _assert_close(dx[1], expect0, rtol, "zero row dx", scale_atol=1e-6)
        if weight is not None:
            terms = (dy.double() * x.double() * rstd_ref[:, None]).abs().sum(0)
            assert ((dw.double() - dw_ref).abs() <= 1e-5 * terms + 1e-30).all()


def test_many_rows_and_thread_count_independence(kern):
    # Enough rows for several uneven parallel blocks; rows must not depend on the thread count,
    # dweight only through the fp32 summation order.
    n, h = 773, 64
    x, res, w, dy = _inputs(n, h, torch.float32, seed=3)
    prev = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            y, rstd, s = kern.forward(x, w, res, EPS)
            dx, dw = kern.backward(dy, s, rstd, w)
            outs.append((y, rstd, dx, dw))
    finally:
        torch.set_num_threads(prev)
    for y, rstd, dx, dw in outs[1:]:
        assert torch.equal(y, outs[0][0]) and torch.equal(rstd, outs[0][1]) and torch.equal(dx, outs[0][2])
        torch.testing.assert_close(dw, outs[0][3], rtol=1e-5, atol=1e-5)
    y_ref, _, dx_ref, dw_ref = _reference(x + res, w, dy, EPS)
    _assert_close(outs[0][0], y_ref, 2e-5, "y", scale_atol=1e-7)
    torch.testing.assert_close(outs[-1][3].double(), dw_ref, rtol=1e-5, atol=1e-4)


def test_dweight_can_be_skipped_and_empty_batch(kern):
    x, _, w, dy = _inputs(5, 16, torch.float32, seed=4)
    y, rstd, _ = kern.forward(x, w, None, EPS)
    dx_a, dw_a = kern.backward(dy, x, rstd, w)
    dx_b, dw_b = kern.backward(dy, x, rstd, w, compute_dweight=False)
    assert dw_b is None and dw_a is not None and torch.equal(dx_a, dx_b)
    e = torch.empty(0, 16)
    y, rstd, _ = kern.forward(e, w, None, EPS)
    assert y.shape == (0, 16) and rstd.shape == (0,)
    dx, dw = kern.backward(e, e, rstd, w)
    assert dx.shape == (0, 16) and torch.equal(dw, torch.zeros(16))


def test_rejects_what_it_cannot_read(kern):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="contiguous"):
        kern.forward(x.t().contiguous().t(), None, None, EPS)
    with pytest.raises(RuntimeError, match="2-D"):
        kern.forward(x.reshape(2, 2, 8), None, None, EPS)
    with pytest.raises(RuntimeError, match="weight"):
        kern.forward(x, torch.ones(7), None, EPS)


def test_float64_falls_back_to_torch_under_the_same_contract(kern):
    # supports(float64) is False; forward/backward still honour the contract so a dispatcher that
    # does not check per dtype gets correct results, not an exception.
    x, res, w, dy = _inputs(9, 33, torch.float64, seed=5)
    y, rstd, summed = kern.forward(x, w, res, EPS)
    assert y.dtype == torch.float64 and rstd.dtype == torch.float32 and torch.equal(summed, x + res)
    y_ref, rstd_ref, dx_ref, dw_ref = _reference(x + res, w, dy, EPS)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    dx, dw = kern.backward(dy, summed, rstd, w)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-6)  # rstd travels as fp32
    torch.testing.assert_close(dw.double(), dw_ref, rtol=1e-6, atol=1e-6)


_SHAPE_OPS = ("aten::reshape", "aten::view", "aten::_reshape_alias", "aten::empty_like", "ViewBackward0")


def _shape_ops(step) -> dict:
    """ATen calls that only reshape or allocate-alike, counted by torch.profiler over ``step()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {e.key: e.count for e in prof.key_averages() if e.key in _SHAPE_OPS}


def test_the_training_node_reads_any_leading_shape_without_reshapes_or_views(kern):
    """A training step's norm (3-D activations, weight, bias, fused residual; forward and backward)
    issues no reshape, view or empty_like and builds no ViewBackward0 node: the kernels read rows of
    any leading shape from the data pointer, and allocate with empty. Control (last lines): the same
    node fed the 2-D rows and viewed back, as it was called before, shows those ops to the same profiler."""
    ext = kern.extension()
    x = torch.randn(2, 5, 32, requires_grad=True)
    res = torch.randn(2, 5, 32, requires_grad=True)
    w = (torch.rand(32) + 0.5).requires_grad_()
    b = torch.randn(32, requires_grad=True)
    ONE = torch.tensor(1.0)

    def step():
        y, summed = ext.add_norm(x, res, w, b, EPS)
        (y * 1.5 + summed).sum().backward(ONE)  # ONE: backward() alone makes its seed with ones_like

    step()
    grads = [t.grad.clone() for t in (x, res, w, b)]
    for t in (x, res, w, b):
        t.grad = None
    assert _shape_ops(step) == {}
    # the gradients equal those through the 2-D rows (the kernel as it was called before) ...
    for t in (x, res, w, b):
        t.grad = None

    def rows_step():
        y, summed = ext.add_norm(x.reshape(-1, 32), res.reshape(-1, 32), w, b, EPS)
        (y.view(2, 5, 32) * 1.5 + summed.view(2, 5, 32)).sum().backward(ONE)

    seen = _shape_ops(rows_step)
    for got, want in zip((x.grad, res.grad, w.grad, b.grad), grads):
        assert torch.equal(got, want)
    # ... and that way the profiler sees the reshapes, views and their backward nodes (the control)
    assert seen.get("aten::reshape", 0) >= 2 and seen.get("ViewBackward0", 0) >= 2, seen
