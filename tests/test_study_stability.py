"""`normswap study --stability` and the kernel-accuracy section: the low-precision stability claim is
judged from training at rising learning rates, never from the kernel table.

Planted differences: a test hook makes one arm's loss non-finite from the ×2 rate on (an arm made
unstable); the sweep must find it and the verdict must go its way — RMSNorm "reproduced" when the
LayerNorm arm is the unstable one, "not reproduced" when RMSNorm is. Six seeds: the fewest whose
unanimous difference the exact sign-flip test can call (2/2⁶ = 0.031). Negative controls: the same
measured numbers in an fp32 study, from two seeds (a zero-width t-interval the old rule took for
certainty), one seed, norms recorded as computing in float32 → never "reproduced". Tiny GPT-2
configs on the embedded corpus, a few steps."""

from __future__ import annotations

import json
import math

import pytest
import torch

from normswap.report.claims import NOT_MEASURABLE, NOT_REPRODUCED, REPRODUCED
from normswap.stats.t_intervals import t_interval
from normswap.study.measuring import precision as ka
from normswap.study.training import stability as stab

TINY = dict(
    model_type="gpt2",
    n_layer=2,
    n_embd=32,
    n_head=2,
    n_positions=64,
    vocab_size=4096,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
SEEDS = 6
CLAIM = "better low-precision stability (RMS ≥ σ)"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _planted_study(root, unstable_arm: str, precision="bf16"):
    """layernorm and rmsnorm, 6 seeds, rates ×1, ×2, ×4 of a small --lr (nothing diverges on its own);
    ``unstable_arm``'s loss is made non-finite at step 3 of every run at ×2 or above."""
    from normswap.study.config import StudyConfig
    from normswap.study.runner import run_study
    from normswap.study.training.interleaved import Hooks

    cfg_file = root / "tiny.json"
    cfg_file.write_text(json.dumps(TINY))
    rate = {}

    def after_step(seed, m, t):
        rate["m"] = m

    def loss(arm, t, value):
        if arm == unstable_arm and rate.get("m", 1.0) >= 2 and t >= 2:
            return value * float("nan")
        return value

    cfg = StudyConfig(
        model=str(cfg_file),
        out=str(root / "study"),
        arms=["layernorm", "rmsnorm"],
        seq_len=16,
        batch_size=2,
        eval_tokens=128,
        warmup=1,
        steps=3,
        seeds=SEEDS,
        max_seeds=SEEDS,
        lm_eval_tasks=["none"],
        lr=1e-3,
        stability=True,
        stability_rates=3,
        precision=precision,
        progress=False,
        speed_seconds=0,
        workers=1,
        device="cpu",
    )
    return run_study(cfg, hooks=Hooks(loss=loss, after_step=after_step), echo=lambda m: None)


def _verdict(results, arm="rmsnorm"):
    return next(c for c in results["claims"] if c["claim"] == CLAIM and c["arm"] == arm)


@pytest.fixture(scope="module")
def ln_unstable_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ln-unstable")


@pytest.fixture(scope="module")
def layernorm_unstable(ln_unstable_root):
    return _planted_study(ln_unstable_root, "layernorm")


def test_a_planted_unstable_layernorm_makes_rmsnorm_more_stable_in_bf16(layernorm_unstable):
    r = layernorm_unstable
    st = r["stability"]
    assert st["layernorm"]["largest_stable_lr"] == pytest.approx(1e-3)  # diverged at ×2 in both seeds
    assert st["rmsnorm"]["largest_stable_lr"] == pytest.approx(4e-3)  # the top rate: a lower bound
    assert st["rmsnorm"]["censored_seeds"] == SEEDS and st["layernorm"]["censored_seeds"] == 0
    assert st["layernorm"]["diverged_runs"] == 2 * SEEDS and st["rmsnorm"]["diverged_runs"] == 0
    cmp = r["stability_sweep"]["comparisons"]["rmsnorm"]
    assert cmp["largest_stable_steps_difference"]["values"] == [2] * SEEDS
    assert cmp["largest_stable_steps_difference"]["p_sign_flip"] == pytest.approx(2 / 2**SEEDS)
    v = _verdict(r)
    assert v["verdict"] == REPRODUCED, v
    assert "bf16" in v["decided_by"] and "largest stable rate" in v["decided_by"]
    assert v["p_value"] == pytest.approx(2 / 2**SEEDS) and v["p_holm"] is not None  # in the Holm family


def test_the_same_numbers_from_an_fp32_study_or_one_seed_are_never_reproduced(layernorm_unstable):
    cmp = layernorm_unstable["stability_sweep"]["comparisons"]["rmsnorm"]
    assert stab.judge(cmp, "bf16")[0] == REPRODUCED
    verdict, text, _ = stab.judge(cmp, "fp32")
    assert verdict == NOT_MEASURABLE and "needs --precision bf16|fp16" in text
    assert stab.judge(cmp, "bf16", ["float32"])[0] == NOT_MEASURABLE  # norms that never ran in bf16
    for n, why in ((3, "more seeds (≥ 6)"), (2, "needs ≥ 3 seeds")):
        # the same unanimous difference from fewer seeds: a zero-width t-interval, sign-flip p = 2/2ⁿ
        few = json.loads(json.dumps(cmp))
        for k in ("largest_stable_steps_difference", "diverged_runs_difference", "heldout_spike_rate_difference"):
            few[k] = t_interval(few[k]["values"][:n], exact=True)
        few["seeds"] = few["seeds"][:n]
        assert few["largest_stable_steps_difference"]["low"] == few["largest_stable_steps_difference"]["high"] == 2
        verdict, text, p = stab.judge(few, "bf16")
        assert verdict == NOT_MEASURABLE and why in text and p is None, text
    one = json.loads(json.dumps(cmp))
    for k in ("largest_stable_steps_difference", "diverged_runs_difference", "heldout_spike_rate_difference"):
        one[k] = {"mean": one[k]["mean"], "low": None, "high": None, "n": 1, "values": one[k]["values"][:1]}
        one[k]["verdict"] = "no measurable difference"
    assert stab.judge(one, "bf16")[0] == NOT_MEASURABLE
    assert stab.judge(None, "bf16")[0] == NOT_MEASURABLE


def test_the_same_runs_with_the_roles_swapped_are_not_reproduced(layernorm_unstable, ln_unstable_root):
    """The opposite direction from the same measured runs: read back from DIR, RMSNorm's sweep taken as
    the baseline's and LayerNorm's as the arm's, the rule must say the arm is less stable."""
    from normswap.study.config import StudyConfig
    from normswap.study.persistence.study_dir import StudyDir

    out = ln_unstable_root / "study"
    study = StudyDir(out)
    seeds = list(range(SEEDS))
    units = {
        (a, seed, m): study.read_unit(stab.stability_key(a, seed, m))
        for a in ("layernorm", "rmsnorm")
        for seed in seeds
        for m in stab.multipliers(3)
    }
    units = {k: u for k, u in units.items() if u is not None}
    cfg = StudyConfig(model="x", out=str(out), stability_rates=3)
    assert stab.compare(units, "rmsnorm", "layernorm", seeds, cfg)["largest_stable_steps_difference"]["mean"] == 2
    swapped = stab.compare(units, "layernorm", "rmsnorm", seeds, cfg)
    verdict, text, p = stab.judge(swapped, "bf16")
    assert verdict == NOT_REPRODUCED and "less stable" in text and p == pytest.approx(2 / 2**SEEDS), text


def test_the_sweep_records_activations_per_layer_and_heldout_losses(layernorm_unstable):
    units = [u for u in layernorm_unstable["stability_sweep"]["comparisons"].values()]
    assert units  # the comparison exists; the per-arm summary carries the growth per rate
    st = layernorm_unstable["stability"]["rmsnorm"]
    assert st["activation_layers"] == ["h.0", "h.1"]
    for m in ("1", "2", "4"):
        assert len(st["activation_rms_growth"][m]) == 2
        assert all(g is not None and g > 0 for g in st["activation_kurtosis_growth"][m])
    assert st["heldout_intervals"] > 0 and st["heldout_spike_rate"] is not None


def test_the_claim_never_reads_the_kernel_table(layernorm_unstable):
    r = json.loads(json.dumps(layernorm_unstable))
    assert r["precision"]["compare"]["rms_worse"]  # the table finds RMSNorm keeping less on offset rows ...
    assert _verdict(r)["verdict"] == REPRODUCED  # ... and the training sweep decides the claim


# --- the pieces, each with its wrong answer ----------------------------------------------------------


def test_heldout_spikes_count_a_22_percent_jump_that_the_training_median_rule_misses():
    unit = {"eval": [{"step": s, "loss": v} for s, v in zip(range(5), (6.0, 5.0, 4.1, 5.0, 4.0))]}
    assert stab.heldout_spikes(unit) == (1, 4)  # 4.1 → 5.0 is +22 %
    flat = {"eval": [{"step": s, "loss": v} for s, v in zip(range(5), (6.0, 5.0, 4.1, 4.2, 4.0))]}
    assert stab.heldout_spikes(flat) == (0, 4)  # +2.4 % is below the 5 % rule


def test_divergence_rules():
    def unit(*losses, nonfinite=None):
        return {
            "eval": [{"step": i, "loss": v} for i, v in enumerate(losses)],
            "final_eval_loss": losses[-1],
            "nonfinite": nonfinite,
        }

    assert stab.diverged(unit(8.3, 6.0, 5.5)) is None
    assert "step 0" in stab.diverged(unit(8.3, 9.0, 8.4))  # never learned
    assert "lowest" in stab.diverged(unit(8.3, 5.0, 6.5))  # learned, then blew up (+30 %)
    assert "non-finite" in stab.diverged(unit(8.3, 5.0, None, nonfinite={"what": "loss", "step": 4}))


def test_activation_stats_read_the_residual_stream_after_each_block():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).train()
    probe = torch.randint(0, 4096, (2, 16))
    layers, rms, kurt = stab.activation_stats(model, probe, "fp32", torch.device("cpu"))
    assert layers == ["h.0", "h.1"] and len(rms) == 2
    assert model.training  # put back in train mode
    with torch.no_grad():
        model.transformer.wte.weight.mul_(10)  # the stream grows with the embeddings ...
        model.transformer.wpe.weight.mul_(10)
    _, rms10, _ = stab.activation_stats(model, probe, "fp32", torch.device("cpu"))
    assert rms10[0] > 5 * rms[0]
    with torch.no_grad():
        model.transformer.wte.weight[:, 3] += 50  # ... and an outlier feature raises the kurtosis
    _, _, kurt_out = stab.activation_stats(model, probe, "fp32", torch.device("cpu"))
    assert kurt_out[0] > 3 * kurt[0]


# --- kernel accuracy --------------------------------------------------------------------------------


def test_kernel_accuracy_is_judged_on_the_information_kept_not_each_function_own_scale():
    ln = ka.check_case("offset mean 1e3", "bf16", 64, ka.LAYERNORM)
    rms = ka.check_case("offset mean 1e3", "bf16", 64, ka.RMSNORM_TORCH)
    # wrong yardstick: each against its own function's output, RMSNorm looks as good as LayerNorm
    assert rms["forward"] < 2 * max(ln["forward"], 1.0)
    # right yardstick: how much of the centred input survives (float64 LayerNorm of the same input)
    assert rms["correlation"] < 0.999 < ln["correlation"]
    assert rms["information_error"] > 10 * ln["information_error"]
    normal = ka.check_case("normal", "bf16", 64, ka.RMSNORM_TORCH)
    assert normal["correlation"] > 0.999  # centred rows: nothing lost
    cmp = ka.compare([ln, rms, ka.check_case("normal", "bf16", 64, ka.LAYERNORM), normal])
    assert cmp["rms_worse"] == ["offset mean 1e3 / bf16 / 64"] and cmp["rms_better"] == []
    assert math.isfinite(cmp["lost"]["offset mean 1e3 / bf16 / 64"]["rms_lost"])


def test_kernels_normswap_judges_normswap_kernel():
    kinds = {a: ka.arm_kind(a) for a in ("layernorm", "rmsnorm", "dyt")}
    assert ka.kernels_for([], "normswap", kinds) == {"layernorm": ka.LAYERNORM, "rmsnorm": ka.RMSNORM_NORMSWAP}
    assert ka.kernels_for([], "torch", kinds)["rmsnorm"] == ka.RMSNORM_TORCH
    labelled = [{"arm": "rmsnorm", "norm_kernel": "normswap rms_norm (cpu extension)"}]
    assert ka.kernels_for(labelled, "best", kinds)["rmsnorm"] == ka.RMSNORM_NORMSWAP
    labelled = [{"arm": "rmsnorm", "norm_kernel": "torch F.rms_norm"}]
    assert ka.kernels_for(labelled, "best", kinds)["rmsnorm"] == ka.RMSNORM_TORCH
    row = ka.check_case("normal", "fp16", 64, ka.RMSNORM_NORMSWAP)
    assert row["impl"] == ka.RMSNORM_NORMSWAP and row["correlation"] > 0.999
