"""Issue #43: a converted model never slower than its LayerNorm original.

- the speed instrument's null control is a null: every timed model on memory of its own;
- the converted norm's eager call reaches its kernel with less host-side work than nn.LayerNorm's;
- the kernel a kind of call runs is decided once (NORMSWAP_KERNEL, `auto` at the call's own shape)
  and recorded; a planted slow candidate is never chosen;
- NORMSWAP_KERNEL=triton means CUDA tensors: CPU work keeps its CPU kernel.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import normswap.kernels as K
from normswap.kernels import autotune
from normswap.kernels import implementations as registry
from normswap.kernels.reference import rms_norm_reference
from normswap.modules import RMSNorm
from normswap.testing import kernel_backend, registered_impl


# ------------------------------------------------------------------------------ the null control
def _file_pages(model) -> set[str]:
    """The files whose memory-mapped pages hold any of ``model``'s CPU weights (/proc/self/maps)."""
    regions = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if len(parts) > 5 and parts[5].startswith("/"):
                regions.append((lo, hi, parts[5]))
    files = set()
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        files |= {path for lo, hi, path in regions if lo <= ptr < hi}
    return files


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_null_control_and_the_candidates_do_not_share_weight_memory():
    """The baseline and its null control are one checkpoint loaded twice: memory-mapped, both sit
    on the same physical pages and warm each other's caches, which the candidate (another file)
    cannot. Every timed model must be on memory of its own. Control: without own_memory (the
    planted shared-pages null), baseline and null control are found on the same file's pages."""
    from normswap.checkpoint.load import load_model
    from normswap.evaluate import throughput
    from normswap.evaluate.config import SpeedConfig

    cfg = SpeedConfig(batch_size=1, seq_len=8, kinds=("forward",))

    def benches():
        models = {
            "original": load_model("normswap:kjv-gpt2"),
            "candidate": load_model("normswap:kjv-neox"),
            "null control": load_model("normswap:kjv-gpt2"),
        }
        return {name: throughput.ModelBench(name, m.eval(), cfg) for name, m in models.items()}

    planted = pytest.MonkeyPatch()
    planted.setattr(throughput, "own_memory", lambda model: 0)
    try:
        shared = benches()
    finally:
        planted.undo()
    pages = {name: _file_pages(b.model) for name, b in shared.items()}
    assert pages["original"] & pages["null control"], pages  # the control: one file's pages, twice

    fixed = benches()
    assert all(not _file_pages(b.model) for b in fixed.values()), {n: _file_pages(b.model) for n, b in fixed.items()}
    ptrs = {name: {p.untyped_storage().data_ptr() for p in b.model.parameters()} for name, b in fixed.items()}
    assert not (ptrs["original"] & ptrs["null control"]) and not (ptrs["original"] & ptrs["candidate"])
    # the tie survives: the head still reads the (one) embedding matrix
    m = fixed["original"].model
    assert m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr()
    ids = torch.randint(0, 4000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, load_model("normswap:kjv-gpt2")(ids).logits, rtol=0, atol=0)


# ------------------------------------------------------------------------------ the hot path
def _python_calls(fn, x, stop) -> int:
    """Python-level calls (frames entered) between calling fn(x) and reaching the C function
    ``stop`` (deterministic host-side work: no clock involved)."""
    count, reached = 0, False

    def prof(frame, event, arg):
        nonlocal count, reached
        if reached:
            return
        if event == "call":
            count += 1
        elif event == "c_call" and arg is stop:
            reached = True

    sys.setprofile(prof)
    try:
        fn(x)
    finally:
        sys.setprofile(None)
    assert reached, f"{stop} was never called"
    return count


def test_a_converted_norm_reaches_its_kernel_with_less_python_than_layer_norm(fresh_autotune):
    """On CUDA, `auto` resolves to torch's fused rms_norm wherever it wins (the GPU evidence: every
    call): the module's bound call must reach that one ATen op through fewer Python frames than
    nn.LayerNorm reaches torch.layer_norm (the host cost a decode step pays 97 times on GPT-2-XL).
    Measured here with the same binding on CPU tensors. Control: the general functional entry
    point (every check, the decision looked up per call) takes more frames than LayerNorm."""
    h = 96
    x = torch.randn(1, 1, h)
    ln = torch.nn.LayerNorm(h)
    with kernel_backend("native"), torch.no_grad():
        for m in (RMSNorm(h, elementwise_affine=False), RMSNorm(h), RMSNorm(h, bias=True)):
            m(x)  # the first call decides (and records what it decided)
            assert set(m.kernels_ran.values()) == {"native"}, m.kernels_ran
            ours = _python_calls(m, x, torch.rms_norm)
            theirs = _python_calls(ln, x, torch.layer_norm)
            assert ours < theirs, (m.extra_repr(), ours, theirs)
        general = _python_calls(lambda t: K.rms_norm(t, None, 1e-5), x, torch.rms_norm)
        assert general > theirs - 2  # the control is of the same order as LayerNorm's, not below it


def test_a_module_decides_once_per_kind_and_again_after_a_move_or_a_new_setting(fresh_autotune, monkeypatch):
    """The decision is the module's, per (dtype, CUDA or not, few/many rows, gradient mode): taken on
    the first call of a kind, never again for that kind; ``.to()`` and a re-read NORMSWAP_KERNEL drop it."""
    monkeypatch.setenv("NORMSWAP_AUTOTUNE", "0")
    import normswap.modules as modules

    decided = []
    real = modules.bind
    monkeypatch.setattr(modules, "bind", lambda *a, **k: decided.append(1) or real(*a, **k))
    m = RMSNorm(64)
    few, many = torch.randn(1, 64), torch.randn(64, 64)
    with torch.no_grad():
        for _ in range(3):
            m(few), m(many), m(few.double())
    assert len(decided) == 3, decided  # few rows, many rows, float64: once each
    with torch.no_grad():
        m(few.bfloat16())  # a new dtype is a new kind
    assert len(decided) == 4
    m.to(torch.float32)  # _apply: parameters may have moved
    with torch.no_grad():
        m(few)
    assert len(decided) == 5
    with kernel_backend("composite"), torch.no_grad():
        y = m(few)
    assert len(decided) == 6 and "composite" in m.kernels_ran.values()
    torch.testing.assert_close(y, rms_norm_reference(few, m.weight), rtol=1e-5, atol=1e-6)


def test_auto_records_a_choice_per_shape_class_and_never_chooses_a_planted_slow_candidate(fresh_autotune):
    """`auto` times its candidates at the call's own shape, with γ or not and a residual or not, and
    keeps one ranking per class; the candidate that wins here (normswap's CPU kernel), made slow
    (correct, but 2 ms a call), ranks last in every class and no module runs it. Control: not
    slowed, it wins."""
    import dataclasses
    import time

    real = registry.TABLE["cpu"]

    def slow(*a, **k):
        time.sleep(2e-3)
        return real.run(*a, **k)

    def run(planted):
        (fresh_autotune / "autotune.json").unlink(missing_ok=True)  # measured afresh, not read back
        record = dataclasses.replace(real, run=slow) if planted == "cpu" else real
        with registered_impl(record):
            mods = [RMSNorm(96), RMSNorm(96, elementwise_affine=False)]
            with torch.no_grad():
                for m in mods:
                    m(torch.randn(2, 96))  # few rows
                    m(torch.randn(300, 96))  # many rows
                    K.rms_norm(torch.randn(300, 96), m.weight, residual=torch.randn(300, 96))
            classes = autotune.choices()
        ran = {name for m in mods for name in m.kernels_ran.values()}
        return classes, ran

    if not registry.cpu_ready():
        pytest.skip("compiled CPU kernel not available here")
    classes, ran = run("cpu")
    keys = {(c["rows"], c["weight"], c["residual"]) for c in classes}
    assert {("few", True, False), ("many", True, False), ("few", False, False), ("many", True, True)} <= keys
    for c in classes:
        assert c["measured"] and c["ranking"][-1] == "cpu", c["why"]
        assert c["shape"][1] == 96 and c["shape"][0] in (2, 300), c["shape"]  # the call's own shape
    assert ran and "cpu" not in ran, ran
    classes, ran = run("nothing")  # the control
    assert any(c["ranking"][0] == "cpu" for c in classes) and "cpu" in ran, [c["why"] for c in classes]


def test_triton_setting_leaves_cpu_work_on_the_cpu_kernel(fresh_autotune):
    """NORMSWAP_KERNEL=triton means CUDA tensors (the GPU run set it for its fine-tune, and convert's
    CPU verification then refused): a CPU call runs what `auto` runs there, with one warning for
    the process; only an explicit backend="triton" refuses a CPU tensor."""
    from normswap.errors import NormswapError
    from normswap.kernels import triton_kernels

    if triton_kernels.interpreter_active():
        pytest.skip("interpreter active: CPU tensors are valid Triton inputs here")
    x = torch.randn(4, 64)
    w = torch.rand(64) + 0.5
    with kernel_backend("triton"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m = RMSNorm(64)
        with torch.no_grad():
            m.weight.copy_(w)
            y1, y2 = m(x), K.rms_norm(x, w)
            m(torch.randn(100, 64))
        assert "triton" not in m.kernels_ran.values(), m.kernels_ran
        torch.testing.assert_close(y1, rms_norm_reference(x, w), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(y2, y1)
        assert K.backend_for("cpu") != "triton"
        with pytest.raises(NormswapError, match="TRITON_INTERPRET"):
            K.rms_norm(x, w, backend="triton")
    said = [str(w.message) for w in seen if "NORMSWAP_KERNEL=triton" in str(w.message)]
    assert len(said) == 1, said


def test_convert_verifies_on_the_cpu_under_the_triton_setting(tmp_path):
    """The GPU run's user path died here: `convert` verifies on the CPU, and NORMSWAP_KERNEL=triton
    refused its calls. Now it converts, verified and published."""
    import subprocess

    from test_evaluate_fixtures import tiny_gpt2

    src = tmp_path / "src"
    tiny_gpt2(seed=1).save_pretrained(src)
    env = {**__import__("os").environ, "NORMSWAP_KERNEL": "triton"}
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "normswap", "convert", str(src), str(out), "--mode", "exact"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "config.json").is_file()
    assert "Triton backend needs a CUDA tensor" not in proc.stderr


# ------------------------------------------------------------------------------ Triton through the module
def _triton_interpreting() -> bool:
    try:
        from normswap.kernels import triton_kernels
    except ImportError:
        return False
    return torch.cuda.is_available() or triton_kernels.interpreter_active()


def test_triton_weighted_backward_and_fused_residual_through_the_module(monkeypatch):
    """The paths the GPU run never reached: the module's γ-weighted Triton backward (persistent,
    fp32 dγ partials) and the fused add+norm kernel, each run through normswap.modules.RMSNorm and
    checked against float64. Runs where Triton runs (CUDA, or this file under TRITON_INTERPRET=1,
    see test_kernels.py's interpreter rerun, which picks up every test named *triton*)."""
    if not _triton_interpreting():
        pytest.skip("triton not usable in this process (rerun under TRITON_INTERPRET=1 by test_kernels.py)")
    from normswap.kernels import triton_kernels as tk

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    launched = {"forward": 0, "backward": 0}
    real_fwd, real_bwd = tk.forward, tk.backward

    def fwd(*a, **k):
        launched["forward"] += 1
        return real_fwd(*a, **k)

    def bwd(*a, **k):
        launched["backward"] += 1
        return real_bwd(*a, **k)

    monkeypatch.setattr(tk, "forward", fwd)
    monkeypatch.setattr(tk, "backward", bwd)
    g = torch.Generator().manual_seed(5)
    h = 72
    x64 = torch.randn(3, 5, h, generator=g, dtype=torch.float64)
    r64 = torch.randn(3, 5, h, generator=g, dtype=torch.float64)
    w64 = torch.rand(h, generator=g, dtype=torch.float64) + 0.5
    b64 = torch.randn(h, generator=g, dtype=torch.float64)
    dy = torch.randn(3, 5, h, generator=g, dtype=torch.float64)
    with kernel_backend("triton"):
        m = RMSNorm(h, eps=1e-5, bias=True, device=device)
        with torch.no_grad():
            m.weight.copy_(w64)
            m.bias.copy_(b64)
        x = x64.float().to(device).requires_grad_()
        y = m(x)
        dx, dw, db = torch.autograd.grad(y, (x, m.weight, m.bias), dy.float().to(device))
        assert launched == {"forward": 1, "backward": 1}, launched
        assert m.kernels_ran and set(m.kernels_ran.values()) == {"triton"}, m.kernels_ran
        r = r64.float().to(device)
        with torch.no_grad():
            yf, s = m(x.detach(), residual=r)
        assert launched["forward"] == 2
    xr, wr, br = x64.clone().requires_grad_(), w64.clone().requires_grad_(), b64.clone().requires_grad_()
    yr = rms_norm_reference(xr, wr) + br
    want = torch.autograd.grad(yr, (xr, wr, br), dy)
    torch.testing.assert_close(y.double().cpu(), yr.detach(), rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("x", "weight", "bias"), (dx, dw, db), want):
        torch.testing.assert_close(a.double().cpu(), b, rtol=1e-4, atol=1e-4, msg=f"d{name}")
    summed = x64 + r64
    torch.testing.assert_close(s.double().cpu(), summed, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(yf.double().cpu(), rms_norm_reference(summed, w64) + b64, rtol=1e-5, atol=1e-5)
    # control: a wrong weight would be seen at these tolerances
    assert not torch.allclose(y.double().cpu(), rms_norm_reference(x64, w64 * 1.01) + b64, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ serving: compiled the same way
def test_eval_speed_compiles_every_model_the_same_way_in_the_mode_asked(monkeypatch, run_cli):
    """`eval speed --compile --compile-mode reduce-overhead` (CUDA graphs on a GPU: how models are
    served) hands every model, the null control included, to torch.compile in that mode; a mode
    torch does not know is click's usage error (exit 2) before anything loads."""
    from test_evaluate_fixtures import tiny_gpt2

    from normswap.evaluate import throughput
    from normswap.evaluate.config import SpeedConfig

    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw) or model)
    cfg = SpeedConfig(compile=True, compile_mode="reduce-overhead", kinds=("forward",))
    for name in ("original", "converted", "null control"):
        throughput.ModelBench(name, tiny_gpt2(seed=0), cfg)
    assert seen == [{"mode": "reduce-overhead"}] * 3
    throughput.ModelBench("eager", tiny_gpt2(seed=0), SpeedConfig(kinds=("forward",)))
    assert len(seen) == 3  # control: without --compile nothing is compiled
    code, _, err = run_cli("eval", "speed", "normswap:kjv-gpt2", "--compile", "--compile-mode", "fastest")
    assert code == 2 and "Invalid value for '--compile-mode': 'fastest'" in err, err


def test_the_report_says_which_kernel_each_models_norms_ran():
    """results.json's norm_time.implementations (what each kind of norm call ran) reaches the report's
    table notes (the committed demo names normswap's C++ kernel); results from before it (the demo of
    2026-12-03) render without the note, and with planted implementations, with it."""
    import json
    from pathlib import Path

    from normswap.report.render import table_notes

    data = Path(__file__).resolve().parent / "data"
    (note,) = [n for n in table_notes(json.loads((data / "demo-results.json").read_text())) if "Norm kernels" in n]
    assert "original: LayerNorm ×9" in note and "exact: cpu ×" in note  # the committed demo, after #43
    demo = json.loads((data / "demo-results-2026-12-03.json").read_text())
    assert not any("Norm kernels that ran" in n for n in table_notes(demo))  # the control: nothing recorded
    for m in demo["models"]:
        if m.get("norm_time"):
            m["norm_time"]["implementations"] = (
                {"own forward": {"LayerNorm": 9}}
                if m["name"] == demo["baseline"]
                else {"cpu float32 ×128, many rows, inference": {"cpu": 9}}
            )
    (note,) = [n for n in table_notes(demo) if "Norm kernels that ran" in n]
    assert f"{demo['baseline']}: LayerNorm ×9" in note and "cpu ×9 (cpu float32 ×128, many rows, inference)" in note
