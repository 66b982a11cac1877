"""The study's results.json (atomic), its report and the run file marked finished."""

from __future__ import annotations

import math
import platform
import time

import torch

from normswap.finetune.step import Schedule
from normswap.host import load_average, usable_cpus
from normswap.stats.t_intervals import PAIRED_BY_SEED_METHOD
from normswap.study.config import ARM_SCHEDULE, BASELINE, CONTROL, PLANTED_LR
from normswap.study.judging import results as res
from normswap.study.judging import speed
from normswap.study.measuring import measure, speed_phase
from normswap.study.study_plan import Plan, Trained
from normswap.study.training import sampler

SCHEMA_VERSION = 1


def _setup_record(plan: Plan, trained: Trained, analysis: dict) -> dict:
    """results.json ``setup``: every option and the design behind them."""
    cfg, data, dist = plan.cfg, plan.data, plan.dist
    seeds_run = sorted({seed for (_, seed, _) in trained.units})
    heldout = data["heldout"]
    return {
        **cfg.recorded(),
        "arms": plan.arms,
        "seeds_list": seeds_run,
        "seeds_run": len(seeds_run),
        "seed_limit": cfg.seed_limit(),
        "stopped_because": trained.stop_reason,
        "multipliers": trained.mults,
        "arm_lr_multipliers": {**PLANTED_LR, **cfg.arm_multipliers()},
        "arm_schedules": {a: ARM_SCHEDULE[a] for a in plan.arms if a in ARM_SCHEDULE},
        "reference_multiplier": analysis["reference_multiplier"],
        "tokens_per_step": cfg.batch_size * cfg.seq_len,
        "margin_nats": cfg.margin,
        "lr_schedule": cfg.lr_schedule,
        "schedule": Schedule(cfg.lr, cfg.steps, cfg.warmup, cfg.lr_schedule, cfg.min_lr_ratio).describe(),
        "final_eval_steps": cfg.final_eval_steps(),
        "eval_tokens_used": int(data["eval_set"].numel()),
        "heldout": {
            "blocks": int(data["eval_set"].shape[0]),
            "tokens": int(data["eval_set"].numel()),
            "blocks_in_pool": heldout["read"],
            "stride_blocks": heldout["stride"],
            "split": data["eval_split"],
            "rule": "disjoint blocks at an even stride over the validation split (study/training/heldout_blocks.py)",
        },
        "control_data": "layernorm-control: own data order and dropout stream (seed + 1000003), same init",
        "data_order": sampler.METHOD,
        "design": design_record(plan),
        "device": str(dist.device),
        "world_size": dist.world,
        "workers": plan.workers,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "spike_rule": f"loss > {cfg.spike_factor:g} × median of the previous {20} steps (after 10)",
        "statistics": PAIRED_BY_SEED_METHOD,
        "cpus": usable_cpus(),
        "kernels": plan.kernel_setup,
        "memory_method": measure.memory_method(dist.device),
        "step_plan": {
            "memory_step": measure.MEMORY_STEP,
            "profiled_steps": f"{len(measure.StepPlan(cfg.steps, plan.arms).profiled_steps())} steps, every "
            f"{measure.StepPlan(cfg.steps, plan.arms).profile_every}th from step {measure.PROFILE_START}",
            "timed_steps": len(measure.StepPlan(cfg.steps, plan.arms).timed_steps()) if plan.workers == 1 else 0,
            "arm_order": "Williams design over the timed steps" if plan.workers == 1 else "units in worker processes",
        },
        "throughput_method": speed_phase.METHOD if plan.cfg.speed_seconds > 0 else speed.METHOD,
    }


def design_record(plan: Plan) -> dict:
    """Why the study is shaped as it is: the model it reads, the arms that check the test, the power."""
    from normswap.study.judging import power as power_mod
    from normswap.study.training import bytes_model

    cfg = plan.cfg
    byte_level = getattr(plan.source.config, "vocab_size", None) == bytes_model.VOCAB
    return {
        "model": bytes_model.describe(plan.source.config)
        if byte_level
        else {"tokens": "model", "vocab_size": getattr(plan.source.config, "vocab_size", None)},
        "planted": {a: {"lr_multiplier": PLANTED_LR[a], "expected": "different"} for a in plan.arms if a in PLANTED_LR},
        "null_control": {"arm": CONTROL, "expected": "equivalent"} if CONTROL in plan.arms else None,
        "power_plan": power_mod.plan(cfg.margin, cfg.seeds, cfg.seed_limit()),
    }


def write_results(plan: Plan, trained: Trained, analysis: dict, speed_record: dict | None, clock: dict) -> dict:
    """Stage 5: results.json (atomic), the report, the run file marked finished."""
    cfg, units, arms = plan.cfg, trained.units, plan.arms
    seeds_run = sorted({seed for (_, seed, _) in units})
    order = [(arm, seed, m) for seed in seeds_run for m in trained.mults for arm in arms]
    tokens_per_step = cfg.batch_size * cfg.seq_len
    results = {
        "schema_version": SCHEMA_VERSION,
        "kind": "normswap-study",
        "model": cfg.model,
        "from_scratch": plan.source.from_scratch,
        "architecture": {
            "model_type": plan.source.config.model_type,
            "parameters": plan.n_params,
            "norms_replaced": plan.norms_replaced,
            "vocab_size": getattr(plan.source.config, "vocab_size", None),
        },
        "setup": _setup_record(plan, trained, analysis),
        "notes": plan.notes + analysis.get("notes", []),
        "baseline": BASELINE,
        "control": CONTROL if CONTROL in arms else None,
        "baselines": plan.baselines,
        "units": [res.summarize_unit(units[k], tokens_per_step) for k in order if k in units],
        **{k: analysis[k] for k in ANALYSIS_KEYS},
        "speed_phase": speed_record,
        "lm_eval": res.lm_eval_table(units, arms, analysis["reference_multiplier"]),
        "timing": {
            "wall_seconds": time.perf_counter() - clock["wall0"],
            "train_seconds": trained.spent,  # every seed's training (resumes included): what --budget counts
            "speed_phase_seconds": (speed_record or {}).get("elapsed_s"),
            "load_average_start": clock["load_start"],
            "load_average_end": load_average(),
        },
    }
    results = _finite(results)
    from normswap.publish import atomic_write_json

    atomic_write_json(plan.study.results_file, results)
    from normswap.study.presentation.study_report import write_report

    write_report(results, plan.study.out)
    plan.study.write_run(dict(plan.study.read_run() or {}, status="finished"))
    return results


ANALYSIS_KEYS = (
    "comparisons",
    "null_control",
    "baseline_norm_share",
    "lr_sweep",
    "migration_rule",
    "precision",
    "stability",
    "stability_sweep",
    "claims",
    "multiplicity",
    "power",
    "instrument_check",
)


def _finite(obj):
    """JSON has no inf/nan: they become strings ("inf"), so results.json stays standard JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
