"""`normswap study`: the statistics can fail (a worse learning rate is found worse, identical arms are
not), interleaved throughput null control structure, two processes = one, kill + resume = uninterrupted,
and bad input (one clear line, nothing lost) — each with its negative control. Tiny GPT-2 configs
(random initialisation) on the embedded corpus, a few steps."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from normswap.timing import NULL_BAND

REPO = Path(__file__).resolve().parents[1]
PLANTED = "layernorm-planted-lr0.5"  # the larger planted handicap: visible on a tiny model in a few steps
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
COMMON = dict(seq_len=32, batch_size=4, eval_tokens=512, eval_every=5, warmup=2, progress=False, device="cpu")
COMMON.update(workers=1, speed_seconds=0)  # one process, no timing phase, unless a test asks


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: one thread per process, and the subprocesses match it
    yield
    torch.set_num_threads(old)


def _config(tmp_path, name="tiny.json", **overrides) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(dict(TINY, **overrides)))
    return str(path)


def _study(model, out, hooks=None, echo=None, **opts):
    """A study with exactly --seeds seeds (no sequential seeds, no time budget) and no lm-eval unless asked."""
    from normswap.study.config import StudyConfig
    from normswap.study.runner import run_study

    opts.setdefault("max_seeds", opts.get("seeds", 3))
    opts.setdefault("budget", 0)
    opts.setdefault("lm_eval_tasks", ["none"])
    cfg = StudyConfig(model=str(model), out=str(out), **{**COMMON, **opts})
    return run_study(cfg, hooks=hooks, echo=echo or (lambda m: None))


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CI", None)
    return env


def _tree(path: Path) -> dict:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def _untimed(results: dict) -> dict:
    """results.json without what depends on the clock (throughput, norm share, kernel timings, wall time,
    load) or on the allocator's state (the CPU peak counts every allocation of the process)."""
    r = json.loads(json.dumps(results))
    r.pop("timing")
    r.pop("null_control")
    r.pop("multiplicity")  # counts the claims' tests, which include the throughput verdict
    r.pop("baseline_norm_share", None)
    r["setup"].pop("kernels", None)
    for u in r["units"]:
        u.pop("timing")
        u.pop("memory", None)
    for c in r["comparisons"].values():
        for k in ("throughput_ratio", "cost_at_equal_tokens", "norm_share_difference", "throughput_ratio_bootstrap"):
            c.pop(k)
        for k in (
            "amdahl_bound",
            "amdahl_inputs",
            "throughput_gates",
            "peak_memory_ratio",
            "peak_memory_difference_bytes",
        ):
            c.pop(k, None)
    r.pop("claims")  # the throughput claim's wording quotes timings
    return r


# --- the statistics can fail ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep_study(tmp_path_factory):
    """layernorm beside its control (same init, own data order and dropout), at a good rate (×1) and a
    deliberately poor one (×0.02), 3 seeds; dropout on, so the control's own dropout stream matters."""
    root = tmp_path_factory.mktemp("sweep")
    cfg = _config(root, resid_pdrop=0.1, embd_pdrop=0.1)
    results = _study(
        cfg, root / "study", arms=["layernorm", "layernorm-control"], lr=3e-3, lr_sweep=["1", "0.02"], steps=12, seeds=3
    )
    return results, root / "study"


def test_a_worse_learning_rate_is_reported_worse_with_an_interval_excluding_zero(sweep_study):
    results, _ = sweep_study
    sw = results["lr_sweep"]
    assert sw["best_multiplier"]["layernorm"] == 1.0
    worse = sw["vs_best"]["layernorm"]["0.02"]
    assert worse["n"] == 3 and worse["verdict"] == "higher"
    assert worse["low"] > 0  # the whole interval says the poor rate ends with a higher loss


def test_the_null_control_shares_the_start_but_not_the_data(sweep_study):
    """The control starts from layernorm's weights (same held-out loss at step 0, every seed) but
    reads its own data order and dropout, so its curve differs: its difference is noise, not zero."""
    results, _ = sweep_study
    units = {(u["arm"], u["seed"], u["lr_multiplier"]): u for u in results["units"]}
    for seed in range(3):
        ln, ctl = units[("layernorm", seed, 1.0)], units[("layernorm-control", seed, 1.0)]
        assert ctl["eval"][0] == ln["eval"][0]  # the same initialisation
        assert ctl["data_seed"] != ln["data_seed"] and ctl["loss"][0] != ln["loss"][0]  # its own batches
    diff = results["comparisons"]["layernorm-control"]["final_eval_loss_difference"]
    assert diff["n"] == 3 and all(v != 0.0 for v in diff["values"])
    assert results["null_control"]["loss"]["noise_floor_nats"] > 0
    # negative control: the seeds differ from each other (own init and data order)
    assert units[("layernorm", 0, 1.0)]["loss"] != units[("layernorm", 1, 1.0)]["loss"]


def test_interval_logic_negative_controls():
    """The same machinery on crafted values: consistent positive differences exclude 0; noisy ones do not."""
    from normswap.stats.t_intervals import paired_t_interval, t_interval

    assert paired_t_interval({0: 1.2, 1: 1.3, 2: 1.25}, {0: 1.0, 1: 1.1, 2: 1.02})["verdict"] == "higher"
    assert (
        paired_t_interval({0: 1.2, 1: 0.9, 2: 1.05}, {0: 1.0, 1: 1.1, 2: 1.02})["verdict"] == "no measurable difference"
    )
    assert t_interval([1.0])["verdict"] == "no measurable difference"  # one seed: no interval, no verdict


def test_throughput_null_control_structure(sweep_study):
    """The interleaved null control is reported per seed with its interval (its ±3 % goal is a
    benchmark: results/study-20261201T1642Z/, not a wall-clock threshold here)."""
    from normswap.study.measure import StepPlan

    results, out = sweep_study
    nc = results["null_control"]
    assert len(nc["per_seed"]) == 3 and all(v > 0 for v in nc["per_seed"])
    assert nc["band"] == NULL_BAND and isinstance(nc["per_seed_within"], bool)
    timed = len(StepPlan(12, ["layernorm", "layernorm-control"]).timed_steps())
    for u in results["units"]:
        assert u["timing"]["timed_steps"] == timed and u["timing"]["tokens_per_second"] > 0
        assert u["memory"]["peak_bytes"] > u["memory"]["static_bytes"] > 0
    report = (out / "report.md").read_text()
    assert "null control" in report and "## Claims" in report and "## Kernel accuracy" in report
    assert report.index("## Bottom line") < report.index("## Claims")
    assert (out / "curves.png").stat().st_size > 0 and (out / "report.html").read_text().startswith("<!doctype html>")


def test_rmsnorm_arm_is_gamma_one_and_every_other_weight_identical(tmp_path):
    from normswap.modules import RMSNorm
    from normswap.study.arms import build_arm, open_source

    src = open_source(_config(tmp_path), from_scratch=True)
    ln, rms = build_arm(src, "layernorm", 3, "torch"), build_arm(src, "rmsnorm", 3, "torch")
    a, b = ln.state_dict(), rms.state_dict()
    norms = [n for n, m in rms.named_modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 2 + 1 and all(rms.get_submodule(n).backend == "native" for n in norms)
    for k, v in b.items():
        if any(k.startswith(n + ".") for n in norms):
            assert torch.equal(v, torch.ones_like(v))
        else:
            assert torch.equal(v, a[k]), k
    assert set(a) - set(b) == {n + ".bias" for n in norms}  # β dropped
    # negative control: another seed is another initialisation
    assert not torch.equal(
        build_arm(src, "layernorm", 4, "torch").state_dict()["transformer.h.0.attn.c_attn.weight"],
        a["transformer.h.0.attn.c_attn.weight"],
    )


def test_migration_rule_and_claims_are_evaluated_with_a_sweep(tmp_path):
    results = _study(
        _config(tmp_path),
        tmp_path / "s",
        arms=["layernorm", "rmsnorm"],
        lr=3e-3,
        lr_sweep=["0.5", "1"],
        steps=6,
        seeds=2,
    )
    rule = results["migration_rule"]["rmsnorm"]
    assert rule["grad_scale_ratio"] > 0 and len(rule["grad_scale_ratio_per_seed"]) == 2
    verdicts = {c["claim"]: c for c in results["claims"]}
    assert all(c["verdict"] in ("reproduced", "not reproduced", "not measurable here") for c in verdicts.values())
    # two rates cannot bracket an optimum: the rule is not judged (tests/test_study_migration.py: ≥ 5 rates)
    migration = next(c for k, c in verdicts.items() if k.startswith("migration"))
    assert migration["verdict"] == "not measurable here" and "≥ 5 swept rates" in migration["decided_by"]


# --- two processes = one -------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_two_processes_reproduce_one_process(tmp_path):
    cfg = _config(tmp_path)
    args = [
        "study",
        cfg,
        "--arms",
        "layernorm,rmsnorm",
        "--steps",
        "4",
        "--seeds",
        "1",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--eval-tokens",
        "512",
        "--eval-every",
        "2",
        "--warmup",
        "2",
        "--device",
        "cpu",
        "--no-progress",
        "--max-seeds",
        "1",
        "--lm-eval-tasks",
        "none",
        "--speed-seconds",
        "0",
    ]
    two = tmp_path / "two"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "normswap"]
        + args
        + ["--out", str(two)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res2 = json.loads((two / "results.json").read_text())
    res1 = _study(cfg, tmp_path / "one", arms=["layernorm", "rmsnorm"], steps=4, seeds=1, eval_every=2)
    assert res2["setup"]["world_size"] == 2 and res1["setup"]["world_size"] == 1
    for u2, u1 in zip(res2["units"], res1["units"]):
        assert (u2["arm"], u2["seed"]) == (u1["arm"], u1["seed"])
        assert u2["loss"] == pytest.approx(u1["loss"], abs=1e-5)
        assert u2["grad_norm"] == pytest.approx(u1["grad_norm"], rel=1e-5)
        assert [e["loss"] for e in u2["eval"]] == pytest.approx([e["loss"] for e in u1["eval"]], abs=1e-5)
        for name, g in u1["norm_input_grad_norm"].items():
            assert u2["norm_input_grad_norm"][name]["mean"] == pytest.approx(g["mean"], rel=1e-5)
    # negative control: the curves are not all alike (a run that ignored the data would pass the above)
    assert res1["units"][0]["loss"][0] != res1["units"][0]["loss"][-1]


# --- kill + resume -------------------------------------------------------------------------------


def test_killed_study_resumed_ends_with_the_same_results(tmp_path):
    from normswap.testing import StudyHooks as Hooks

    cfg = _config(tmp_path)
    opts = dict(arms=["layernorm", "rmsnorm"], steps=6, seeds=2, eval_every=3)
    whole = _study(cfg, tmp_path / "whole", **opts)

    class Killed(Exception):
        pass

    def stop(seed, mult, step):
        if seed == 1 and step == 4:  # mid-unit: seed 0's units are finished, seed 1's are not
            raise Killed

    out = tmp_path / "cut"
    with pytest.raises(Killed):
        _study(cfg, out, hooks=Hooks(after_step=stop), **opts)
    kept = sorted(p.name for p in (out / "units").iterdir())
    assert kept == ["seed0-x1-layernorm.json", "seed0-x1-rmsnorm.json"] and not (out / "results.json").exists()
    before = {n: (out / "units" / n).read_bytes() for n in kept}
    resumed = _study(cfg, out, resume=True, **opts)
    assert {n: (out / "units" / n).read_bytes() for n in kept} == before  # finished units were kept, not re-run
    assert _untimed(resumed) == _untimed(whole)
    # negative control: a different study (another learning rate) does not compare equal
    other = _study(cfg, tmp_path / "other", lr=5e-3, **opts)
    assert _untimed(other) != _untimed(whole)


def test_resume_refuses_other_options(tmp_path):
    from normswap.errors import NormswapError
    from normswap.study.config import StudyConfig
    from normswap.study.runner import run_study

    cfg = _config(tmp_path)
    _study(cfg, tmp_path / "s", arms=["layernorm"], steps=2, seeds=1)
    with pytest.raises(NormswapError, match="--steps is 3 but the study used 2"):
        run_study(
            StudyConfig(model=cfg, out=str(tmp_path / "s"), resume=True, **{**COMMON, "steps": 3}),
            given={"steps"},
            echo=lambda m: None,
        )
    with pytest.raises(NormswapError, match="holds a study: pass --resume"):
        _study(cfg, tmp_path / "s", arms=["layernorm"], steps=2, seeds=1)


# --- bad input: one clear line, nothing lost -----------------------------------------------------


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "normswap", "study", *args], env=_env(), capture_output=True, text=True, timeout=600
    )


def test_bad_input_gets_one_line_and_nothing_is_touched(tmp_path):
    from normswap.errors import NormswapError

    gpt2 = _config(tmp_path)
    llama = _config(
        tmp_path,
        "llama.json",
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        vocab_size=4096,
    )
    # no LayerNorm to replace
    with pytest.raises(NormswapError, match="no LayerNorm to replace"):
        _study(llama, tmp_path / "a", steps=2, seeds=1)
    assert not (tmp_path / "a").exists()
    # an arm that does not exist
    with pytest.raises(NormswapError, match="no arm 'rmsnrom'"):
        _study(gpt2, tmp_path / "b", arms=["layernorm", "rmsnrom"], steps=2, seeds=1)
    assert not (tmp_path / "b").exists()
    # a trained-only arm from random weights
    with pytest.raises(NormswapError, match="converts a trained checkpoint"):
        _study(gpt2, tmp_path / "b", arms=["layernorm", "rmsnorm-exact"], steps=2, seeds=1)
    # DIR that is a model, or inside the model it reads: refused even with --force, every file as it was
    from normswap.assets.models import model_path

    model = tmp_path / "model"
    import shutil

    shutil.copytree(model_path("kjv-gpt2"), model)
    before = _tree(model)
    with pytest.raises(NormswapError, match="overlaps"):
        _study(str(model), model / "study", steps=2, seeds=1, force=True)
    with pytest.raises(NormswapError, match="is not a normswap study .*a model"):
        _study(gpt2, model, steps=2, seeds=1, force=True)
    assert _tree(model) == before
    # DIR that holds the study's own data
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "text.txt").write_text("In the beginning was the word. " * 400)
    with pytest.raises(NormswapError, match="overlaps the data"):
        _study(gpt2, corpus, data=str(corpus / "text.txt"), steps=2, seeds=1, force=True)
    assert (corpus / "text.txt").read_text().startswith("In the beginning")
    # the command line: one line, exit 2, no traceback
    r = _cli(gpt2, "--out", str(tmp_path / "c"), "--arms", "layernorm,nope", "--steps", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.strip()] == [r.stderr.strip().splitlines()[-1]]
    assert "nope" in r.stderr
    # negative control: the same inputs, put right, run
    res = _study(gpt2, tmp_path / "ok", arms=["layernorm", "rmsnorm"], steps=2, seeds=1)
    assert [u["status"] for u in res["units"]] == ["finished", "finished"]


def test_a_diverging_arm_is_recorded_and_stops_while_the_others_finish(tmp_path):
    from normswap.testing import StudyHooks as Hooks

    def blow_up(arm, step, loss):
        return loss * float("inf") if arm == "rmsnorm" and step == 3 else loss

    res = _study(
        _config(tmp_path),
        tmp_path / "s",
        hooks=Hooks(loss=blow_up),
        arms=["layernorm", "rmsnorm", "layernorm-control"],
        steps=6,
        seeds=2,
    )
    units = {(u["arm"], u["seed"]): u for u in res["units"]}
    for seed in range(2):
        bad = units[("rmsnorm", seed)]
        assert bad["status"] == "diverged" and bad["nonfinite"]["step"] == 3 and bad["nonfinite"]["what"] == "loss"
        assert bad["steps_done"] == 3 and bad["final_eval_loss"] is None
        for arm in ("layernorm", "layernorm-control"):  # negative control: the others trained to the end
            assert units[(arm, seed)]["status"] == "finished" and units[(arm, seed)]["steps_done"] == 6
    equal = next(c for c in res["claims"] if c["claim"].startswith("equal loss") and c["arm"] == "rmsnorm")
    assert equal["verdict"] != "reproduced" and "diverged in 2 (arm)" in equal["decided_by"]
    cmp = res["comparisons"]["rmsnorm"]
    assert cmp["diverged"] == {"arm": 2, "baseline": 0}
    # the diverged seeds stay outcomes (scored ln V), not dropped from the interval
    assert cmp["final_eval_loss_difference"]["n"] == 2 and "missing" not in cmp["final_eval_loss_difference"]
    assert all(v > 0 for v in cmp["final_eval_loss_difference"]["values"])
    assert res["comparisons"]["layernorm-control"]["diverged"] == {"arm": 0, "baseline": 0}


# --- from a trained checkpoint, and as a recipe step ---------------------------------------------


@pytest.mark.slow
def test_trained_checkpoint_arms_exact_starts_at_the_same_loss_and_recipe_step_runs(tmp_path):
    """From the shipped trained kjv-gpt2 (recipe `study:` step): rmsnorm-exact is the same function
    at step 0 (same held-out loss), rmsnorm (γ = 1, β dropped) and rmsnorm-approx are not."""
    import yaml

    from normswap.cli.main import main
    from normswap.recipes.loader import load_recipe
    from normswap.recipes.steps import EvalStep, StudyStep, plan_steps

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "s",
                "source": "normswap:kjv-gpt2",
                "device": "cpu",
                "variants": {"exact": {"convert": {"mode": "exact"}}},
                "eval": {"seq_len": 32, "stride": 32, "max_tokens": 256, "speed": False, "diagnostics": False},
                "study": {
                    "steps": 2,
                    "seeds": 1,
                    "max_seeds": 1,
                    "seq_len": 32,
                    "batch_size": 2,
                    "eval_tokens": 256,
                    "warmup": 1,
                    "lm_eval_tasks": "none",
                    "speed_seconds": 0,
                    "workers": 1,
                },
            }
        )
    )
    steps = plan_steps(load_recipe(str(recipe)).recipe)
    assert [type(s) for s in steps[-2:]] == [StudyStep, EvalStep]
    try:
        main(["run", str(recipe), "--out", str(tmp_path / "run")])
    except SystemExit as e:
        assert e.code in (0, None)
    res = json.loads((tmp_path / "run" / "study" / "results.json").read_text())
    assert res["from_scratch"] is False
    assert res["setup"]["arms"] == [
        "layernorm",
        "rmsnorm",
        "layernorm-control",
        "layernorm-planted-lr0.7",  # the default planted arm
        "rmsnorm-exact",
        "rmsnorm-approx",
    ]
    start = {u["arm"]: u["eval"][0]["loss"] for u in res["units"]}
    assert start["rmsnorm-exact"] == pytest.approx(start["layernorm"], abs=1e-4)
    assert (
        abs(start["rmsnorm"] - start["layernorm"]) > 1e-3
    )  # negative control: γ = 1 and β dropped change the function
    assert json.loads((tmp_path / "run" / "run.json").read_text())["steps"]["study"]["status"] == "done"


def test_recipe_study_section_is_validated():
    from normswap.recipes.schema import RecipeError, validate

    base = {"name": "s", "source": "normswap:kjv-gpt2", "variants": {"exact": {"convert": {"mode": "exact"}}}}
    assert validate(dict(base), "r")["study"] is None
    assert validate(dict(base, study={"seeds": 2, "lr_sweep": "0.5,1"}), "r")["study"]["lr_sweep"] == ["0.5", "1"]
    with pytest.raises(RecipeError, match="study.arms"):
        validate(dict(base, study={"arms": ["layernorm", "rmsnrom"]}), "r")
    with pytest.raises(RecipeError, match="study.seeds"):
        validate(dict(base, study={"seeds": 0}), "r")


def test_post_ln_checkpoint_exact_arm_refused_before_dir_or_left_out_by_default(tmp_path):
    """A trained post-LN causal LM (OPT with do_layer_norm_before=False) has no exact RMSNorm form:
    asked for, rmsnorm-exact is one line and DIR is never made; by default it is left out, with a note."""
    import shutil

    from transformers import OPTConfig, OPTForCausalLM

    from normswap.assets.models import model_path
    from normswap.errors import NormswapError

    torch.manual_seed(0)
    model = OPTForCausalLM(
        OPTConfig(
            vocab_size=4096,
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=2,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            do_layer_norm_before=False,
        )
    )
    src = tmp_path / "opt"
    model.save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path("kjv-gpt2") / f, src / f)
    with pytest.raises(NormswapError, match="arm rmsnorm-exact"):
        _study(src, tmp_path / "a", arms=["layernorm", "rmsnorm-exact"], steps=2, seeds=1)
    assert not (tmp_path / "a").exists()
    res = _study(src, tmp_path / "b", steps=2, seeds=1)
    assert res["setup"]["arms"] == [
        "layernorm",
        "rmsnorm",
        "layernorm-control",
        "layernorm-planted-lr0.7",
        "rmsnorm-approx",
    ]
    assert any(n.startswith("rmsnorm-exact left out") for n in res["notes"])


# --- the second edition: protocol, baselines, equivalence, planted difference, sequential seeds ------


@pytest.fixture(scope="module")
def instrument_study(tmp_path_factory):
    """The default study's three layernorm arms on a tiny model, 3 seeds, trained once: layernorm, its
    null control (own data order) and the larger planted handicap (layernorm at half the rate: a
    16-step tiny model shows it at this margin)."""
    root = tmp_path_factory.mktemp("instrument")
    arms = ["layernorm", "layernorm-control", PLANTED]
    res = _study(_config(root), root / "s", arms=arms, steps=16, seeds=3, lr=3e-3, margin=0.15, eval_every=0)
    return res, root / "s", arms


def _instrument_check(out, arms, margin):
    """The equal-loss test of every arm, from the units in DIR, without the bigram gate (the claim's
    own gate, tested in test_equivalence_verdicts_tost_bigram_gate_and_holm: a 16-step model has not
    learned past a bigram; the test itself is what is checked here)."""
    from normswap.study.analysis import analyse
    from normswap.study.config import StudyConfig
    from normswap.study.study_dir import StudyDir, unit_key

    study = StudyDir(out)
    units = {(a, s, 1.0): study.read_unit(unit_key(a, s, 1.0)) for a in arms for s in range(3)}
    cfg = StudyConfig(out=str(out), margin=margin, arms=arms)
    return analyse(cfg, units, arms, {}, None)["instrument_check"]


def test_planted_arm_is_different_and_the_null_control_equivalent(instrument_study, monkeypatch):
    """The same run shows its equal-loss test going both ways: the planted handicap comes out
    "different" (its whole 90 % interval past the margin), the null control "equivalent". Negative
    control: a wrong TOST that always says "equivalent" makes the planted arm equivalent too, and the
    check says the test did not go both ways."""
    from normswap.stats.equivalence import tost
    from normswap.study import results as study_results
    from normswap.study.config import PLANTED_LR

    res, out, arms = instrument_study
    units = {(u["arm"], u["seed"]): u for u in res["units"]}
    assert units[(PLANTED, 0)]["lr"] == pytest.approx(PLANTED_LR[PLANTED] * units[("layernorm", 0)]["lr"])
    assert units[(PLANTED, 0)]["data_seed"] == units[("layernorm", 0)]["data_seed"]  # same data: only the rate
    check = _instrument_check(out, arms, 0.15)
    assert check["arms"][PLANTED]["finding"] == "different", check
    assert check["arms"]["layernorm-control"]["finding"] == "equivalent", check
    assert check["ok"] is True
    assert not [r for r in res["claims"] if r["arm"] in (PLANTED, "layernorm-control")]  # checks, not claims

    real = tost

    def always_equivalent(values, margin):
        out = real(values, margin)
        return dict(out, finding="equivalent") if out else out

    monkeypatch.setattr(study_results, "tost", always_equivalent)  # the control: a wrong TOST
    wrong = _instrument_check(out, arms, 0.15)
    assert wrong["arms"][PLANTED]["finding"] == "equivalent" and wrong["ok"] is False


def test_power_says_what_the_seeds_detect_and_how_many_would_decide(instrument_study):
    """study/power.py against a direct simulation of the TOST it describes, and its use in the run."""
    import random

    from normswap.stats import power_analysis as power
    from normswap.stats.equivalence import tost

    sd, margin, n = 0.01, 0.02, 6
    rng = random.Random(0)
    hits = sum(tost([rng.gauss(0, sd) for _ in range(n)], margin)["finding"] == "equivalent" for _ in range(2000))
    assert power.equivalence_power(n, sd, margin) == pytest.approx(hits / 2000, abs=0.04)
    assert power.equivalence_power(n, sd, margin, true_difference=0.05) < 0.01  # past the margin: never
    need = power.seeds_needed(sd, margin)
    assert power.equivalence_power(need, sd, margin) >= 0.8 > power.equivalence_power(need - 1, sd, margin)
    res = instrument_study[0]
    row = res["power"]["arms"]["layernorm-control"]
    assert row["n"] == 3 and row["sd"] > 0 and row["seeds_for_equivalence_at_zero"] >= 2
    assert res["setup"]["design"]["power_plan"]["sd_max_by_seeds"]["3"] == pytest.approx(power.sd_max(3, 0.15))
    assert res["setup"]["design"]["planted"]["layernorm-planted-lr0.5"]["expected"] == "different"


def test_schedule_decays_and_final_quality_is_the_mean_of_the_last_evaluations(tmp_path):
    lines = []
    res = _study(
        _config(tmp_path),
        tmp_path / "s",
        arms=["layernorm"],
        steps=10,
        seeds=1,
        final_evals=3,
        final_eval_every=2,
        echo=lines.append,
    )
    s = res["setup"]
    assert s["lr_schedule"] == "cosine" and s["margin_nats"] == 0.03
    assert s["schedule"]["final_lr"] <= 0.1 * s["schedule"]["peak_lr"] + 1e-12
    u = res["units"][0]
    assert [e["step"] for e in u["final_evals"]] == [6, 8, 10] == s["final_eval_steps"]
    assert u["final_eval_loss"] == pytest.approx(sum(e["loss"] for e in u["final_evals"]) / 3)
    assert u["final_eval_loss"] != u["last_eval_loss"]  # negative control: not the last snapshot alone
    # held-out blocks are spread over the split, not its first tokens
    assert s["heldout"]["blocks"] * 32 == s["eval_tokens_used"] and s["heldout"]["stride_blocks"] > 1
    # the header came first, before any result
    assert lines[0].startswith("normswap study: ") and any("Ctrl-C" in line for line in lines[:8])
    # --steps below --warmup warns (and still runs); negative control: the run above did not warn
    assert not any("warning" in line for line in lines)
    warned = []
    _study(_config(tmp_path), tmp_path / "w", arms=["layernorm"], steps=1, warmup=4, seeds=1, echo=warned.append)
    assert any("--steps 1 is below --warmup-steps 4" in line for line in warned)


def test_ngram_baselines_are_proper_count_models():
    from normswap.study.baselines import ngram_losses

    g = torch.Generator().manual_seed(0)
    # a text where each token determines the next (a cycle): the bigram knows it, the unigram cannot
    cycle = torch.arange(16).repeat(64).view(32, 32) % 16
    held = torch.arange(16).repeat(8).view(4, 32) % 16
    r = ngram_losses(cycle, held, 16)
    assert r["bigram_loss"] < 0.1 < math.log(16) - 0.01 < r["unigram_loss"] < math.log(16) + 0.01
    # negative control: on held-out text with no such order the bigram is no better than chance
    shuffled = torch.randint(0, 16, (4, 32), generator=g)
    assert ngram_losses(cycle, shuffled, 16)["bigram_loss"] > r["unigram_loss"]
    # proper distributions: probabilities over the vocabulary sum to 1 for a seen and an unseen context
    import numpy as np

    train = torch.randint(0, 8, (16, 16), generator=g)
    for ctx in (3, 9):  # 9 never occurs in training
        ps = [math.exp(-ngram_losses(train, torch.tensor([[ctx, w]]), 12)["bigram_loss"]) for w in range(12)]
        assert np.isclose(sum(ps), 1.0)


def _cmp(diffs, *, base=5.0, arm_diverged=0):
    from normswap.stats.equivalence import tost

    return {
        "seeds": list(range(len(diffs))),
        "final_eval_loss_equivalence": tost(diffs, 0.02),
        "final_eval_loss_means": {"arm": base + sum(diffs) / len(diffs), "baseline": base},
        "diverged": {"arm": arm_diverged, "baseline": 0},
    }


def test_equivalence_verdicts_tost_bigram_gate_and_holm():
    from normswap.study import claim_judges

    ctx = claim_judges.Context(margin=0.02, baselines={"bigram_loss": 5.5})
    tight = [0.001, -0.002, 0.0015, 0.0, -0.001]
    assert claim_judges.equal_loss(_cmp(tight), ctx).verdict == "reproduced"
    assert claim_judges.equal_loss(_cmp([0.05, 0.06, 0.055, 0.052]), ctx).verdict == "not reproduced"
    wide = claim_judges.equal_loss(_cmp([0.03, -0.03, 0.01, -0.02]), ctx)
    assert wide.verdict == "not measurable here" and wide.open  # more seeds could decide it
    # a study whose models did not beat the bigram baseline never reproduces equal loss, however tight
    gated = claim_judges.equal_loss(_cmp(tight, base=5.6), ctx)
    assert gated.verdict == "not measurable here" and gated.reason == "not-below-bigram" and not gated.open
    # Holm: verdicts that pass alone fail together when each is only just significant ...
    barely = claim_judges.equal_loss(_cmp([0.012, -0.004, 0.008]), ctx)
    assert barely.verdict == "reproduced" and 0.05 / 3 < barely.p_value < 0.05
    rows = [claim_judges._row("c", f"a{i}", barely) for i in range(3)]
    claim_judges.adjust(rows, 0.05)
    assert [r["verdict"] for r in rows] == ["not measurable here"] * 3
    assert rows[2]["family_size"] == 3 and "after Holm over 3 tests" in rows[2]["decided_by"]
    # ... while a strong verdict survives the same family
    rows = [claim_judges._row("c", "t", claim_judges.equal_loss(_cmp(tight), ctx))] + [
        claim_judges._row("c", "b", barely)
    ] * 2
    claim_judges.adjust(rows, 0.05)
    assert rows[0]["verdict"] == "reproduced"
    # negative control: alone, the same verdict stands
    alone = [claim_judges._row("c", "b", barely)]
    claim_judges.adjust(alone, 0.05)
    assert alone[0]["verdict"] == "reproduced"


def test_the_equal_loss_verdict_says_which_error_keeps_it_from_the_margin():
    from normswap.study import claim_judges

    ctx = claim_judges.Context(margin=0.02, baselines={"bigram_loss": 5.5})
    wide = _cmp([0.03, -0.03, 0.01, -0.02])
    noisy_blocks = claim_judges.equal_loss(dict(wide, seed_standard_error=0.013, heldout_standard_error=0.012), ctx)
    assert "held-out sampling 0.0120 (more --eval-tokens)" in noisy_blocks.decided_by
    assert "seed to seed 0.0130 (more seeds)" in noisy_blocks.decided_by
    # negative control: blocks that sample the text finely enough are not blamed
    fine_blocks = claim_judges.equal_loss(dict(wide, seed_standard_error=0.013, heldout_standard_error=0.002), ctx)
    assert "held-out sampling 0.0020 nats" in fine_blocks.decided_by and "--eval-tokens" not in fine_blocks.decided_by


def test_sequential_seeds_stop_when_decided_or_out_of_budget():
    from normswap.study.config import StudyConfig
    from normswap.study.seeds import seed_decision

    cfg = StudyConfig(out="x", seeds=2, max_seeds=5, budget=100)
    open_row = [{"verdict": "not measurable here", "open": True, "claim": "equal loss at equal tokens", "arm": "r"}]
    closed = [{"verdict": "reproduced", "open": False, "claim": "equal loss at equal tokens", "arm": "r"}]
    assert seed_decision(cfg, 2, open_row, 40.0, [20.0, 20.0])[0] is True
    assert seed_decision(cfg, 2, closed, 40.0, [20.0, 20.0]) == (False, "every verdict decided after 2 seeds")
    go, why = seed_decision(cfg, 4, open_row, 90.0, [20.0] * 4)
    assert not go and why.startswith("budget")
    assert seed_decision(cfg, 5, open_row, 0.0, [1.0])[0] is False  # --max-seeds
    assert seed_decision(StudyConfig(out="x", seeds=2, max_seeds=5, budget=0), 4, open_row, 1e9, [1e6])[0] is True


def test_sequential_seeds_run_while_a_verdict_is_open(tmp_path):
    """Throughput rows straddle their threshold with 2 seeds (t(0.975, 1) = 12.7): a third seed runs;
    negative control: --max-seeds 2 keeps the study at 2."""
    cfg = _config(tmp_path)
    res = _study(cfg, tmp_path / "s", arms=["layernorm", "rmsnorm"], steps=4, seeds=2, max_seeds=3)
    if any(r["open"] for r in res["claims"]):  # still open after 3: it went to the limit
        assert res["setup"]["seeds_run"] == 3 and "max-seeds" in res["setup"]["stopped_because"]
    assert res["setup"]["seeds_run"] in (2, 3) and res["multiplicity"]["method"].startswith("Holm")
    two = _study(cfg, tmp_path / "t", arms=["layernorm", "rmsnorm"], steps=4, seeds=2, max_seeds=2)
    assert two["setup"]["seeds_run"] == 2


@pytest.mark.parametrize("open_arm", ["rmsnorm", "layernorm-planted-lr0.5"])
def test_a_seed_beyond_seeds_trains_the_baseline_and_the_open_arms_only(tmp_path, monkeypatch, open_arm):
    """A decided arm's interval needs no more seeds: the extra seed trains layernorm and the arm whose
    verdict is open, and the open arm's comparison gains the seed. Negative control (the other
    parametrisation): which arm trains follows the open verdict, not a fixed list."""
    from normswap.study import seeds

    seen_before = []

    def one_open(plan, trained, before):
        seen_before.append((before, sorted({k[1] for k in trained.units})))
        row = {"claim": "equal loss at equal tokens", "arm": open_arm, "verdict": "not measurable here"}
        return [dict(row, open=True)]

    monkeypatch.setattr(seeds, "open_questions", one_open)
    arms = ["layernorm", "rmsnorm", "layernorm-planted-lr0.5"]
    lines = []
    res = _study(_config(tmp_path), tmp_path / "s", echo=lines.append, arms=arms, steps=2, seeds=1, max_seeds=2)
    trained = {(u["arm"], u["seed"]) for u in res["units"]}
    assert trained == {(a, 0) for a in arms} | {("layernorm", 1), (open_arm, 1)}
    closed = next(a for a in arms[1:] if a != open_arm)
    assert res["comparisons"][open_arm]["seeds"] == [0, 1] and res["comparisons"][closed]["seeds"] == [0]
    assert any(f"(training layernorm, {open_arm})" in line for line in lines)
    assert seen_before[0][0] == 1


def test_nobias_and_dyt_arms_change_only_the_replaced_norms(tmp_path):
    from normswap.study.arms import DyTNorm, build_arm, open_source, replaced_norms

    src = open_source(_config(tmp_path), from_scratch=True)
    ln, nb, dyt = (build_arm(src, a, 3, "torch") for a in ("layernorm", "layernorm-nobias", "dyt"))
    names = replaced_norms(src)
    assert len(names) == 2 * 2 + 1
    a, b = ln.state_dict(), nb.state_dict()
    assert set(a) - set(b) == {n + ".bias" for n in names} and all(torch.equal(b[k], a[k]) for k in b)
    for n in names:
        m = dyt.get_submodule(n)
        assert type(m) is DyTNorm and float(m.alpha.detach()) == 0.5
        x = torch.randn(3, 32)
        expect = torch.tanh(0.5 * x) * ln.get_submodule(n).weight + ln.get_submodule(n).bias
        assert torch.allclose(m(x), expect)
    # negative control: the LayerNorm arm keeps β and no DyT
    assert all(ln.get_submodule(n).bias is not None for n in names)
    assert not any(isinstance(m, DyTNorm) for m in ln.modules())


def test_ctrl_c_says_how_to_resume_and_resume_finishes(tmp_path):
    from normswap.study.runner import StudyInterrupted
    from normswap.testing import StudyHooks as Hooks

    cfg = _config(tmp_path)
    opts = dict(arms=["layernorm", "rmsnorm"], steps=4, seeds=2)

    def interrupt(seed, mult, step):
        if seed == 1 and step == 2:
            raise KeyboardInterrupt

    out = tmp_path / "s"
    with pytest.raises(StudyInterrupted, match=r"continue with: normswap study .* --out .* --resume") as e:
        _study(cfg, out, hooks=Hooks(after_step=interrupt), **opts)
    assert e.value.exit_code == 130 and "2 finished unit(s)" in str(e.value)
    assert json.loads((out / "study_run.json").read_text())["status"] == "interrupted"
    res = _study(cfg, out, resume=True, **opts)
    assert res["setup"]["seeds_run"] == 2 and len(res["units"]) == 4


def test_lm_eval_scores_every_arm_of_every_seed_paired(tmp_path):
    # in bf16: the norms compute in bfloat16, so lm-eval must run the model as it trained (under autocast)
    res = _study(
        _config(tmp_path),
        tmp_path / "s",
        arms=["layernorm", "dyt"],
        steps=3,
        seeds=2,
        precision="bf16",
        lm_eval_tasks=["normswap_kjv"],
        lm_eval_limit=2,
    )
    assert {u["arm"]: u["norm_compute_dtype"] for u in res["units"]} == {"layernorm": "bfloat16", "dyt": "bfloat16"}
    table = res["lm_eval"]
    assert set(table) == {"layernorm", "dyt"}
    assert set(table["dyt"]["per_seed"]) == {"0", "1"}  # every seed, not only the first
    a, b = (table[k]["scores"]["normswap_kjv"]["word_perplexity"] for k in ("layernorm", "dyt"))
    assert a > 1 and b > 1 and a != b  # each arm's own model was scored
    diff = table["dyt"]["differences"]["normswap_kjv word_perplexity"]
    per_seed = [
        table[k]["per_seed"][s]["normswap_kjv"]["word_perplexity"] for s in ("0", "1") for k in ("dyt", "layernorm")
    ]
    assert diff["n"] == 2 and diff["values"] == pytest.approx([per_seed[0] - per_seed[1], per_seed[2] - per_seed[3]])


def test_the_default_study_reads_bytes_and_records_why(tmp_path):
    """The default (no MODEL): kjv-gpt2's architecture over the byte vocabulary — token id = byte, any
    text round-trips — and the design recorded in results.json's setup; --tokens model keeps the
    BPE model; bytes on trained weights is refused in one line."""
    from normswap.errors import NormswapError
    from normswap.study import bytes_model
    from normswap.study.config import DEFAULT_ARMS, StudyConfig
    from normswap.study.config import PLANTED as DEFAULT_PLANTED
    from normswap.study.inputs import open_study_source

    src = open_study_source(StudyConfig(out=str(tmp_path / "a"), from_scratch=True))
    text = "In the beginning God créated\n the heaven."
    ids = src.tokenizer(text)["input_ids"]
    assert ids == list(text.encode()) and src.tokenizer.decode(ids) == text
    assert src.config.vocab_size == 257 and src.config.n_layer == 4 and src.config.n_embd == 128
    assert bytes_model.describe(src.config)["why"]
    bpe = open_study_source(StudyConfig(out=str(tmp_path / "b"), from_scratch=True, tokens="model"))
    assert bpe.config.vocab_size == 4096  # negative control: the shipped BPE model as it is
    with pytest.raises(NormswapError, match="--tokens bytes .* --from-scratch"):
        open_study_source(StudyConfig(out=str(tmp_path / "c"), tokens="bytes"))
    assert DEFAULT_PLANTED in DEFAULT_ARMS and "layernorm-control" in DEFAULT_ARMS


def test_units_in_worker_processes_compute_what_one_process_does_and_speed_comes_from_the_timing_phase(
    instrument_study,
):
    """--workers 2: the units trained in two spawned processes equal the one-process study's (same
    seed, same arm: the same losses), keep no throughput samples of their own, and the throughput
    verdict reads the timing phase (normswap.timing.compare, layernorm's second copy as null)."""
    res, out, _ = instrument_study
    root = out.parent
    same = dict(steps=16, lr=3e-3, eval_every=0)  # the instrument study's, one seed
    par = _study(
        _config(root), root / "par", arms=["layernorm", "rmsnorm"], seeds=1, workers=2, speed_seconds=2, **same
    )
    one = {(u["arm"], u["seed"]): u for u in res["units"]}[("layernorm", 0)]
    two = {(u["arm"], u["seed"]): u for u in par["units"]}[("layernorm", 0)]
    assert two["loss"] == one["loss"] and two["final_eval_loss"] == one["final_eval_loss"]
    assert par["setup"]["workers"] == 2 and two["timing"]["timed_steps"] == 0
    phase = par["speed_phase"]
    assert phase["instrument"] == "normswap.timing.compare" and set(phase["candidates"]) == {"rmsnorm"}
    boot = par["comparisons"]["rmsnorm"]["throughput_ratio_bootstrap"]
    assert boot["pairs"] == phase["candidates"]["rmsnorm"]["pairs"] > 0
