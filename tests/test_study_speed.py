"""`normswap study`'s kernels, throughput and memory: labels detected from what ran (a composite op is
reported composite whatever its class says), norms computing in the training dtype, the Amdahl bound
and the noise gates deciding whether a throughput verdict is given at all (synthetic timings, never the
wall clock), a balanced arm order, and a steady-state memory peak that counts AdamW's moments once —
each with its negative control."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest
import torch
import torch.nn.functional as F

from normswap.modules import RMSNorm
from normswap.study import claim_judges, measure, norm_impl, speed
from normswap.study import results as res


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _observed(norm: torch.nn.Module, *, autocast: torch.dtype | None = None, width: int = 16) -> dict:
    """What norm_impl.observe reports for one forward of ``norm`` on a (8, width) input that needs a gradient."""
    holder = torch.nn.Sequential(norm)
    x = torch.randn(8, width, requires_grad=True) * 1.0
    with (
        norm_impl.observe(holder) as seen,
        torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)),
    ):
        holder(x)
    return seen.summary()


# --- labels: detected, not asserted ------------------------------------------------------------------


class HandWrittenLayerNorm(torch.nn.LayerNorm):
    """A LayerNorm by class, computed as separate ops: it must not be reported fused."""

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(var + self.eps) * self.weight + self.bias


def test_study_implementations_are_records_of_the_kernel_table():
    """The study chooses among records of normswap.kernels' one table; a module set to one runs
    that record (what it ran is recorded by the module itself, not asserted by the study)."""
    from normswap.kernels.implementations import TABLE

    assert all(record is None or record in TABLE for record in norm_impl.RMS_IMPLS.values())
    m = RMSNorm(16)
    norm_impl.use_rms_impl(torch.nn.Sequential(m), "torch")
    m(torch.randn(4, 16))
    assert set(m.kernels_ran.values()) == {"native"}
    # control: a record that does not run here is refused by the chooser, not silently replaced
    norm_impl.use_rms_impl(torch.nn.Sequential(m), "compile")
    with pytest.raises(Exception, match="compiled"):
        m(torch.randn(4, 16))


def test_kernel_labels_come_from_the_autograd_graph():
    fused = _observed(torch.nn.LayerNorm(16))
    assert fused["norm_kernel_fused"] is True
    assert fused["norm_kernel"].startswith("torch.nn.functional.layer_norm (fused")
    assert "NativeLayerNormBackward0" in fused["norm_kernel"]
    # negative control: the same class name computed as separate ops is reported composite
    hand = _observed(HandWrittenLayerNorm(16))
    assert hand["norm_kernel_fused"] is False and "composite" in hand["norm_kernel"]
    # PyTorch's F.rms_norm on CPU is a composite (grad_fn MulBackward0), whatever its name suggests
    torch_rms = RMSNorm(16)
    norm_impl.use_rms_impl(torch.nn.Sequential(torch_rms), "torch")
    rms = _observed(torch_rms)
    assert rms["norm_kernel_fused"] is False
    assert (
        rms["norm_kernel"].startswith("torch.nn.functional.rms_norm (composite")
        and "MulBackward0" in rms["norm_kernel"]
    )


def test_normswap_cpu_kernel_is_reported_fused():
    from normswap.kernels import cpu

    if not cpu.available():
        pytest.skip("normswap's compiled CPU kernel is not available here")
    seen = _observed(RMSNorm(16))
    assert seen["norm_kernel_fused"] is True and "normswap cpu fused kernel" in seen["norm_kernel"]


def test_norms_compute_in_the_training_dtype_not_only_under_autocast():
    # negative control: under autocast alone, a LayerNorm fed the fp32 residual stream returns fp32
    plain = torch.nn.Sequential(torch.nn.LayerNorm(16))
    assert _observed(plain[0], autocast=torch.bfloat16)["norm_compute_dtype"] == "float32"
    for precision, name in (("bf16", "bfloat16"), ("fp16", "float16")):
        holder = torch.nn.Sequential(torch.nn.LayerNorm(16))
        assert norm_impl.compute_in(holder, precision) == 1
        seen = _observed(holder[0], autocast=norm_impl.PRECISION_DTYPES[precision])
        assert seen["norm_compute_dtype"] == name and seen["norm_kernel_fused"] is True
        # the fp32 master weights stay fp32 and receive their gradient through the cast
        x = torch.randn(4, 16, requires_grad=True)
        holder(x).float().sum().backward()
        assert holder[0].weight.dtype == torch.float32 and holder[0].weight.grad is not None
        assert x.grad.dtype == torch.float32


def test_kernels_best_asks_the_kernels_chooser(monkeypatch, fresh_autotune):
    """``--kernels best`` on CPU is what normswap.kernels' chooser runs for the arm's kind of call: a
    ranking with torch's own F.rms_norm first gives ``torch``, one with normswap's kernel first
    ``normswap`` (each the other's control); the study keeps no ranking of its own. A candidate that
    fails is not timed, and the failure is kept."""
    from normswap.kernels import autotune
    from normswap.modules import RMSNorm

    like = RMSNorm(16)
    for ranking, expected in ((["native", "composite"], "torch"), (["composite", "native"], "normswap")):
        monkeypatch.setattr(autotune, "ranking", lambda *a, r=ranking, **k: list(r))
        chosen = norm_impl.choose_rms(like, 64, "cpu", "fp32")
        assert chosen["choice"] == chosen["chooser"] == expected, chosen
        assert set(chosen["seconds"]) == {"normswap", "torch"} and chosen["candidates"] == ["normswap", "torch"]

    def boom(*a, **k):
        raise RuntimeError("boom")

    from normswap.kernels import implementations

    native = implementations.TABLE["native"]
    monkeypatch.setitem(implementations.TABLE, "native", dataclasses.replace(native, bind=boom))
    chosen = norm_impl.choose_rms(like, 64, "cpu", "fp32")
    assert chosen["choice"] == "normswap" and "boom" in chosen["errors"]["torch"]


# --- throughput: bound, gates, interval (synthetic timings) ------------------------------------------


def _units(arm_speedup: float, control_noise: float, *, seeds: int = 3, steps: int = 60, seed: int = 0) -> dict:
    """Unit records with made-up step times: the arm is ``arm_speedup``× faster than layernorm, the
    identical control differs from layernorm by up to ±``control_noise`` per step."""
    rng = random.Random(seed)
    plan = measure.StepPlan(steps, ["layernorm", "rmsnorm", "layernorm-control"])
    units = {}
    for s in range(seeds):
        base = [0.1 * (1 + 0.002 * rng.uniform(-1, 1)) for _ in range(steps)]
        times = {
            "layernorm": base,
            "rmsnorm": [b / arm_speedup * (1 + 0.002 * rng.uniform(-1, 1)) for b in base],
            "layernorm-control": [b * (1 + control_noise * rng.uniform(-1, 1)) for b in base],
        }
        for arm, secs in times.items():
            units[(arm, s, 1.0)] = {
                "step_seconds": secs,
                "timed_steps": plan.timed_steps(),
                "final_eval_loss": 5.0,
                "memory": None,
                "nonfinite": None,
                "spikes": [],
                "skipped_steps": [],
                "norm_share": None,
            }
    return units


def _throughput_verdict(units, *, bound=None, loads=(0.3,), cpus=2) -> tuple[str, str]:
    cmps = {a: res.compare(units, a, "layernorm", 1.0) for a in ("rmsnorm", "layernorm-control")}
    for c in cmps.values():
        c["amdahl_bound"] = bound
    ctx = claim_judges.Context(margin=0.02, control=cmps["layernorm-control"], loads=tuple(loads), cpus=cpus)
    rows = claim_judges.judge(cmps, ctx, "layernorm-control")
    row = next(r for r in rows if r["arm"] == "rmsnorm" and "throughput" in r["claim"])
    return row["verdict"], row["decided_by"]


def test_throughput_verdict_comes_out_both_ways_on_a_quiet_machine():
    assert _throughput_verdict(_units(1.25, 0.005))[0] == "reproduced"
    assert _throughput_verdict(_units(1.00, 0.005))[0] == "not reproduced"
    assert _throughput_verdict(_units(1.10, 0.005))[0] == "not measurable here"  # straddles the threshold


def test_a_bound_below_the_claim_is_not_measurable_whatever_the_timings():
    units = _units(1.25, 0.005)
    verdict, why = _throughput_verdict(units, bound=1.05)
    assert verdict == "not measurable here" and "Amdahl bound ×1.050" in why and "cannot give ×1.10" in why
    # on a busy machine too, both reasons are named
    verdict, why = _throughput_verdict(units, bound=1.05, loads=[3.1], cpus=2)
    assert verdict == "not measurable here" and "cannot give ×1.10" in why and "too noisy to tell: load" in why
    # negative control: a bound above the threshold lets the same timings decide
    assert _throughput_verdict(units, bound=1.5)[0] == "reproduced"


def test_a_null_control_outside_its_band_gives_no_verdict():
    verdict, why = _throughput_verdict(_units(1.25, 0.25))
    assert verdict == "not measurable here" and why.startswith("too noisy to tell: the null control")
    verdict, why = _throughput_verdict(_units(1.00, 0.25))  # nor a refutation
    assert verdict == "not measurable here" and why.startswith("too noisy to tell")


def test_a_busy_machine_gives_no_throughput_verdict():
    """Two CPU burners on two cores put the load average near 3: no verdict, even from clean timings."""
    units = _units(1.25, 0.005)
    verdict, why = _throughput_verdict(units, loads=[1.2, 3.05, 2.9], cpus=2)
    assert verdict == "not measurable here" and why.startswith("too noisy to tell: load average 3.05 on 2 CPUs")
    assert _throughput_verdict(units, loads=[1.2, 1.9], cpus=2)[0] == "reproduced"  # negative control


def test_amdahl_bound_from_profiled_share_and_kernel_speedup():
    units = [
        {"norm_share": {"norm_seconds": [0.01, 0.03], "step_seconds": [1.0, 1.0]}},
        {"norm_share": {"norm_seconds": [0.02], "step_seconds": [1.0]}},
    ]
    share = speed.pooled_norm_share(units)
    assert share["share"] == pytest.approx(0.02) and share["steps"] == 3
    assert speed.amdahl_bound(share["share"], 2.0) == pytest.approx(1 / (0.98 + 0.01))
    assert speed.amdahl_bound(0.02, 1e9) < 1.03  # even free norms: under 1.10
    assert speed.amdahl_bound(0.5, 4.0) == pytest.approx(1 / 0.625) and speed.amdahl_bound(0.5, 4.0) > 1.10
    assert speed.amdahl_bound(0.02, 0.5) < 1  # a slower kernel: the bound is a slowdown


def test_bootstrap_is_blocked_by_seed():
    rng = random.Random(1)
    seeds = {s: [centre + rng.gauss(0, 0.01) for _ in range(40)] for s, centre in enumerate((1.0, 1.1, 1.2))}
    iv = speed.bootstrap_ratio(seeds)
    assert iv["low"] < 1.03 and iv["high"] > 1.17  # the seed-to-seed spread stays in the interval
    assert iv["seeds"] == 3 and iv["repeats"] == 120 and iv["median"] == pytest.approx(1.1, abs=0.02)
    # negative control: the same steps treated as one block (steps as if independent) look far surer
    pooled = speed.bootstrap_ratio({0: [q for qs in seeds.values() for q in qs]})
    assert pooled["high"] - pooled["low"] < 0.25 * (iv["high"] - iv["low"])
    # unequal numbers of steps per seed (a diverged arm stops early) are handled
    assert speed.bootstrap_ratio({0: [1.0] * 5, 1: [1.2] * 50})["repeats"] == 55


# --- arm order ---------------------------------------------------------------------------------------


def _balance(rows: list[list[int]], n: int) -> tuple[set, set]:
    first = {sum(1 for r in rows if r[0] == a) for a in range(n)}
    pairs = {
        sum(1 for r in rows for i in range(n - 1) if (r[i], r[i + 1]) == (a, b))
        for a, b in itertools.permutations(range(n), 2)
    }
    return first, pairs


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_williams_rows_balance_first_place_and_who_follows_whom(n):
    rows = measure.williams_rows(n)
    assert all(sorted(r) == list(range(n)) for r in rows)
    first, pairs = _balance(rows, n)
    assert len(first) == 1 and len(pairs) == 1  # every arm first equally often, every ordered pair equally often


def test_rotation_is_not_balanced_and_the_plan_walks_williams_rows_over_timed_steps():
    rotation = [[(k + i) % 3 for i in range(3)] for k in range(3)]  # the first edition's order
    assert len(_balance(rotation, 3)[1]) > 1  # negative control: some arm never directly follows another
    arms = ["layernorm", "rmsnorm", "layernorm-control"]
    plan = measure.StepPlan(200, arms)
    follows = {p: 0 for p in itertools.permutations(arms, 2)}
    timed = plan.timed_steps()[: len(plan.rows) * 20]
    for t in timed:
        order = [a.name for a in plan.order(t, [type("A", (), {"name": a}) for a in arms])]
        for a, b in zip(order, order[1:]):
            follows[(a, b)] += 1
    assert len(set(follows.values())) == 1


def test_step_plan_keeps_measurement_out_of_timed_steps():
    plan = measure.StepPlan(40, ["a", "b"])
    timed = set(plan.timed_steps())
    assert 1 not in timed and measure.MEMORY_STEP not in timed
    profiled = [t for t in range(1, 41) if plan.role(t) == measure.PROFILE]
    assert len(profiled) >= 7 and not timed & set(profiled)


# --- instrumentation and memory ----------------------------------------------------------------------


def test_norm_input_gradients_are_taken_only_on_profiled_steps():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    norms = [("1", model[1])]
    grads = measure.NormInputGrads(norms)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    assert grads.sq is None  # inactive (a timed step): no hook, no work, no sync
    grads.active = True
    model(x).sum().backward()
    assert grads.sq is not None and grads.sq.shape == (1,) and float(grads.sq[0]) > 0
    grads.remove()


def _adamw_step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_steady_state_peak_counts_adams_moments_once():
    if measure.memory_method("cpu") is None:
        pytest.skip("no CPU allocator statistics on this machine")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 512)
    moments = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    with measure.PeakMemory("cpu") as first:  # AdamW allocates its moments in this step
        _adamw_step(model, opt, x)
    with measure.PeakMemory("cpu") as steady:
        _adamw_step(model, opt, x)
    # negative control: the first step's rise holds the moments, which static_bytes also counts
    assert first.transient_bytes - steady.transient_bytes >= 0.9 * moments
    assert measure.param_bytes(model, opt) >= moments  # where the moments are counted, once


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_steady_state_peak_counts_adams_moments_once():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 1024, device="cuda")
    moments = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    with measure.PeakMemory("cuda") as first:
        _adamw_step(model, opt, x)
    with measure.PeakMemory("cuda") as steady:
        _adamw_step(model, opt, x)
    assert first.method.startswith("cuda: max_memory_allocated")
    assert first.transient_bytes - steady.transient_bytes >= 0.9 * moments  # negative control: step 1


def test_peak_sees_what_a_composite_norm_keeps_for_backward():
    if measure.memory_method("cpu") is None:
        pytest.skip("no CPU allocator statistics on this machine")
    w = torch.ones(1024, requires_grad=True)
    peaks = {}
    for name, fn in (
        ("layer_norm", lambda x: F.layer_norm(x, (1024,), w)),
        ("rms_norm", lambda x: F.rms_norm(x, (1024,), w)),
    ):
        x = torch.randn(2048, 1024, requires_grad=True)
        fn(x).sum().backward()  # warm
        with measure.PeakMemory("cpu") as pm:
            fn(x).sum().backward()
        peaks[name] = pm.transient_bytes
    # F.rms_norm's composite keeps several full-size intermediates; layer_norm only its mean and rstd
    assert peaks["rms_norm"] > peaks["layer_norm"] + 8 * 2**20


# --- a real study in bf16 ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
    ],
)
def test_a_bf16_study_records_bfloat16_for_every_arm_and_what_ran(tmp_path, device):
    from normswap.study.config import StudyConfig
    from normswap.study.runner import run_study

    cfg_file = tmp_path / "tiny.json"
    cfg_file.write_text(
        json.dumps(dict(model_type="gpt2", n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=4096))
    )
    cfg = StudyConfig(
        model=str(cfg_file),
        out=str(tmp_path / "study"),
        precision="bf16",
        arms=["layernorm", "rmsnorm", "layernorm-control"],
        steps=4,
        seeds=1,
        max_seeds=1,
        lm_eval_tasks=["none"],
        seq_len=16,
        batch_size=2,
        eval_tokens=128,
        eval_every=0,
        warmup=1,
        progress=False,
        speed_seconds=0,
        workers=1,
        device=device,
    )
    results = run_study(cfg, echo=lambda m: None)
    units = results["units"]
    assert {u["arm"] for u in units} == {"layernorm", "rmsnorm", "layernorm-control"}
    assert all(u["norm_compute_dtype"] == "bfloat16" for u in units)
    for u in units:
        assert isinstance(u["norm_kernel_fused"], bool) and u["norm_kernel"]
        expected = "torch.nn.functional.layer_norm" if u["arm"] != "rmsnorm" else None
        if expected:
            assert u["norm_kernel"].startswith(expected) and u["norm_kernel_fused"] is True
    chosen = results["setup"]["kernels"]
    assert chosen["option"] == "best" and chosen["rms_impl"] in chosen["best"]["candidates"]
    assert set(results["setup"]["kernels"]["speedup"]) == {"rmsnorm", "layernorm-control"}
    assert "amdahl_bound" in results["comparisons"]["rmsnorm"]
    assert results["setup"]["memory_method"].startswith(device)
    assert all(u["memory"]["peak_bytes"] > u["memory"]["static_bytes"] > 0 for u in units)
    gates = results["comparisons"]["rmsnorm"]["throughput_gates"]
    assert set(gates) == {"amdahl_below_claim", "busy_load", "cpus", "control_within"} and gates["cpus"] >= 1
