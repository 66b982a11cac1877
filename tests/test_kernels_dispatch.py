"""How a call reaches a kernel: the lean eager path, the measured choice of `auto` (and its cache),
and torch.compile, where Inductor must be able to fuse the residual add with the norm."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from normswap.kernels import _ops, autotune, choose, rms_norm
from normswap.kernels import implementations as registry
from normswap.kernels.reference import rms_norm_reference
from normswap.testing import forget_kernel_choices, registered_impl


def test_no_grad_calls_skip_autograd_function_and_custom_op(monkeypatch):
    """On CPU with the compiled kernel, an inference call goes straight to the kernel and a
    training call through one C++ autograd node: neither touches the Python autograd.Function
    nor the custom-op dispatcher (each ~20 µs a call)."""
    if not registry.cpu_ready():
        pytest.skip("compiled CPU kernel not available here")

    def forbidden(*a, **k):
        raise AssertionError("slow path taken")

    monkeypatch.setattr(_ops._EagerRMSNorm, "apply", forbidden)
    monkeypatch.setattr(_ops, "forward_impl", forbidden)
    x = torch.randn(3, 5, 64)
    w = torch.rand(64) + 0.5
    with torch.no_grad():
        y = rms_norm(x, w, backend="cpu")
    torch.testing.assert_close(y, rms_norm_reference(x, w), rtol=1e-5, atol=1e-6)
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    y = rms_norm(xg, wg, backend="cpu")
    # the output's own node is the C++ one: no view back to x's shape in front of it
    assert "NormFunction" in y.grad_fn.name(), y.grad_fn.name()
    y.sum().backward()
    assert xg.grad is not None and wg.grad is not None and wg.grad.dtype == torch.float32
    # negative control: the composite backend does take the Python autograd.Function
    with pytest.raises(AssertionError, match="slow path"):
        rms_norm(xg, wg, backend="composite")


def test_module_call_is_one_cpp_call_with_bias_and_residual(fresh_autotune, monkeypatch):
    """`auto` on CPU, once it has chosen the compiled kernel, sends the converted module's call
    (γ, β, residual) to one C++ function: no Python backend dispatch, the bias added there, every
    gradient (x, residual, γ, β) as autograd gives for the plain formula; bad shapes are ValueErrors."""
    if not registry.cpu_ready():
        pytest.skip("compiled CPU kernel not available here")
    from normswap.modules import RMSNorm

    monkeypatch.setenv("NORMSWAP_AUTOTUNE", "0")  # static order: cpu first, no measurement
    m = RMSNorm(64, eps=1e-4, bias=True)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        m.bias.uniform_(-1, 1)
    x = torch.randn(2, 3, 64, requires_grad=True)
    r = torch.randn(2, 3, 64, requires_grad=True)
    dy = torch.randn(2, 3, 64)
    ds = torch.randn(2, 3, 64)
    # first calls of each kind: the choice is made (and memoised) here
    with torch.no_grad():
        m(x)
    m(x)
    m(x, residual=r)

    def forbidden(*a, **k):
        raise AssertionError("Python dispatch taken")

    with monkeypatch.context() as mp:  # the kinds above are decided: nothing below may decide again
        mp.setattr(choose, "ranked", forbidden)
        mp.setattr(choose, "bind", forbidden)
        mp.setattr(_ops, "apply", forbidden)
        y, s = m(x, residual=r)
        # the output's node is the C++ autograd node (no view in front), which adds the bias itself
        # (no AddBackward)
        assert "NormFunction" in y.grad_fn.name(), y.grad_fn.name()
        got = torch.autograd.grad((y, s), (x, r, m.weight, m.bias), (dy, ds))
        xr, rr = x.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()
        wr, br = m.weight.detach().clone().requires_grad_(), m.bias.detach().clone().requires_grad_()
        yr, sr = rms_norm_reference(xr, wr, 1e-4, rr)
        yr = yr + br
        torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, sr)
        want = torch.autograd.grad((yr, sr), (xr, rr, wr, br), (dy, ds))
        for name, a, b in zip(("x", "residual", "weight", "bias"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"d{name}")
        # negative control: without the bias the output is measurably different
        assert not torch.allclose(y, yr - br, atol=1e-3)
        with torch.no_grad():
            torch.testing.assert_close(m(x), rms_norm_reference(x, m.weight, 1e-4) + m.bias, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bias has shape"):
        rms_norm(x.detach(), m.weight, bias=torch.zeros(63))
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(x.detach(), torch.ones(2, 32))
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm(x.detach(), m.weight, residual=torch.zeros(3, 2, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_inside_the_kernel_is_bit_for_bit_a_separate_add(dtype):
    """The C++ kernel adds β in its store loop: y must equal `norm(x) + bias.to(y.dtype)` exactly
    (two roundings in bf16, as the separate add makes them), with and without a residual and a
    gradient, and β's gradient must be dy summed over the rows."""
    if not registry.cpu_ready():
        pytest.skip("compiled CPU kernel not available here")
    ext = registry.cpu_ext()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 72, generator=g).to(dtype)  # 72: the vector body, the 8-lane loop and a tail
    r = torch.randn(2, 7, 72, generator=g).to(dtype)
    w = torch.rand(72, generator=g) + 0.5
    b = torch.randn(72, generator=g) * 3  # float32 β on bf16 activations: rounded to bf16 first
    with torch.no_grad():
        y = ext.norm(x, w, b, 1e-5)
        assert torch.equal(y, ext.norm(x, w, None, 1e-5) + b.to(dtype))
        ys, s = ext.add_norm(x, r, w, b, 1e-5)
        y0, s0 = ext.add_norm(x, r, w, None, 1e-5)
        assert torch.equal(ys, y0 + b.to(dtype)) and torch.equal(s, s0)
        if dtype == torch.bfloat16:  # negative control: rounding once would be a different result
            once = (rms_norm_reference(x.float(), w) + b.to(dtype).float()).to(dtype)
            assert not torch.equal(y, once)
    dy = torch.randn(x.shape, generator=g).to(dtype)
    for weight in (w, None):  # the bias's place among the node's inputs moves with the weight
        xg, bg = x.clone().requires_grad_(), b.clone().requires_grad_()
        yg = ext.norm(xg, weight, bg, 1e-5)
        with torch.no_grad():
            assert torch.equal(yg.detach(), ext.norm(x, weight, None, 1e-5) + b.to(dtype))
        dx, db = torch.autograd.grad(yg, (xg, bg), dy)
        assert db.dtype == b.dtype
        torch.testing.assert_close(db, dy.reshape(-1, 72).sum(0).to(b.dtype))
        xr = x.clone().requires_grad_()
        torch.testing.assert_close(
            dx, torch.autograd.grad(ext.norm(xr, weight, None, 1e-5), xr, dy)[0]
        )  # β adds nothing to dx


def test_module_reads_a_parametrized_weight(monkeypatch):
    """The module reads its parameters from `_parameters` (fast); a weight moved out of it by
    torch.nn.utils.parametrize must still be used, through the ordinary lookup."""
    from torch.nn.utils import parametrize

    from normswap.modules import RMSNorm

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    m = RMSNorm(64, bias=True)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        m.bias.uniform_(-1, 1)
    x = torch.randn(3, 64)
    with torch.no_grad():
        plain = m(x)
        torch.testing.assert_close(plain, rms_norm_reference(x, m.weight) + m.bias, rtol=1e-5, atol=1e-5)
        parametrize.register_parametrization(m, "weight", Double())
        doubled = m(x)
    torch.testing.assert_close(
        doubled, rms_norm_reference(x, 2 * m.parametrizations.weight.original) + m.bias, rtol=1e-5, atol=1e-5
    )
    assert not torch.allclose(doubled, plain, atol=1e-3)  # control: the parametrization changed y


def test_auto_measures_once_then_reads_its_cache(fresh_autotune, monkeypatch):
    x = torch.randn(40, 96)
    with torch.inference_mode():  # the first call of a kind may come from inside inference mode
        y = rms_norm(x, None)
    torch.testing.assert_close(y, rms_norm_reference(x), rtol=1e-5, atol=1e-6)
    (choice,) = [c for c in autotune.choices() if c["width_bucket"] == 128 and not c["grad"] and c["rows"] == "many"]
    assert choice["measured"] and set(choice["us"]) >= {"native", "composite"}
    assert choice["ranking"][0] == min(choice["us"], key=choice["us"].get), "the fastest measured candidate wins"
    assert choice["ranking"][0] in choice["why"]
    stored = json.loads((fresh_autotune / "autotune.json").read_text())
    entries = [e for m in stored["machines"].values() for e in m]
    assert any(e["width_bucket"] == 128 and e["ranking"] == choice["ranking"] for e in entries)
    # a new process (simulated) takes the stored choice without measuring again
    forget_kernel_choices()
    monkeypatch.setattr(autotune, "measure", lambda *a, **k: pytest.fail("measured again despite the cache"))
    rms_norm(x, None)
    (again,) = [c for c in autotune.choices() if c["width_bucket"] == 128 and not c["grad"] and c["rows"] == "many"]
    assert again["ranking"] == choice["ranking"] and again["why"].startswith("cached")


def test_auto_rejects_a_fast_candidate_that_computes_wrongly(fresh_autotune, monkeypatch):
    """A candidate is ranked only if its output agrees with the reference formula."""
    import dataclasses

    def broken_native(x, weight, bias, residual, eps):
        return x * 0  # fast and wrong

    with registered_impl(dataclasses.replace(registry.TABLE["native"], run=broken_native)):
        detail = autotune.measure(
            torch.device("cpu"), torch.float32, 64, "few", False, ["native", "composite"], repeats=1
        )
    assert detail["ranking"][0] == "composite" and "native" in detail["rejected"]
    assert "differs from the reference" in detail["rejected"]["native"]


def test_native_is_never_used_with_a_weight_of_another_dtype(fresh_autotune, monkeypatch):
    """F.rms_norm would round an fp32 γ to bf16 (and take a slow path): the API skips it then."""
    import dataclasses

    monkeypatch.setattr(autotune, "ranking", lambda *a, **k: ["native", "composite"])
    used = []

    def counted(record):
        return dataclasses.replace(record, run=lambda *a: used.append(record.name) or record.run(*a))

    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with registered_impl(counted(registry.TABLE["native"])), registered_impl(counted(registry.TABLE["composite"])):
        rms_norm(x, torch.rand(32) + 0.5)
        rms_norm(x, (torch.rand(32) + 0.5).bfloat16())
    assert used == ["composite", "native"]


@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="Inductor on CPU needs a C++ compiler"
)
def test_inductor_fuses_residual_add_and_norm_into_one_kernel():
    """Under torch.compile `auto` hands Inductor the plain formula: the add, the statistics and
    the scaling become one generated loop (no opaque normswap op, no separate add kernel)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    w = torch.rand(64) + 0.5

    def block(x, r):
        return rms_norm(x, w, 1e-5, residual=r)

    x, r = torch.randn(8, 64), torch.randn(8, 64)
    (y, s), codes = run_and_get_code(torch.compile(block, backend="inductor", fullgraph=True), x, r)
    code = "\n".join(codes)
    kernels = set(re.findall(r"cpp_fused_\w+", code))
    assert len(kernels) == 1 and "add" in next(iter(kernels)), kernels
    assert "normswap" not in code
    ye, se = block(x, r)
    torch.testing.assert_close(s, se)
    torch.testing.assert_close(y, ye, rtol=1e-5, atol=1e-6)
