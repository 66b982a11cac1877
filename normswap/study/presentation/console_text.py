"""What the study says on the console: the header before the first step, a diverged arm, how to resume."""

from __future__ import annotations

import shlex

from normswap.evaluate.lm_eval_adapter import unavailable as lm_eval_unavailable
from normswap.study.config import DEFAULT_MODEL, PLANTED_LR, StudyConfig
from normswap.study.study_plan import Plan
from normswap.study.training.interleaved import Dist


def resume_command(cfg: StudyConfig) -> str:
    model = "" if cfg.model == DEFAULT_MODEL and cfg.from_scratch else f" {shlex.quote(cfg.model)}"
    return f"normswap study{model} --out {shlex.quote(str(cfg.out))} --resume"


def header_lines(
    cfg: StudyConfig, source, arms: list[str], mults: list[float], dist: Dist, n_params: int, workers: int = 1
) -> list[str]:
    """What the study is about to do, printed before the first step."""
    start = "random initialisation per seed" if source.from_scratch else "its trained weights"
    arm_mults = cfg.arm_multipliers()
    moved = "".join(f" ({a} at ×{m:g} lr)" for a, m in {**PLANTED_LR, **arm_mults}.items() if a in arms)
    per_seed = len(arms) * len(mults) * cfg.steps
    budget = f"a budget of {cfg.budget:g} s of training" if cfg.budget else "no time budget"
    sweep = f" × lr sweep {', '.join(f'{m:g}' for m in mults)}" if len(mults) > 1 else ""
    tasks = cfg.lm_eval_task_list()
    return [
        f"normswap study: {cfg.model} ({source.config.model_type}, {n_params:,} parameters, {start}) -> {cfg.out}",
        f"  arms: {', '.join(arms)}{moved}{sweep}",
        f"  seeds: {cfg.seeds} first, then one at a time up to {cfg.seed_limit()} while a verdict is open; {budget}",
        f"  each arm: {cfg.steps} steps × {cfg.batch_size} × {cfg.seq_len} tokens, lr {cfg.lr:g} with {cfg.warmup} "
        f"warmup steps then {cfg.lr_schedule} (to {cfg.min_lr_ratio:g} × peak), precision {cfg.precision}, "
        f"{dist.device} × {dist.world} process(es)"
        + (f", units spread over {workers} worker processes" if workers > 1 else ""),
        f"  work: {per_seed:,} arm-steps per seed, {per_seed * cfg.seeds:,} for the first {cfg.seeds} seeds "
        f"(at most {per_seed * cfg.seed_limit():,}); final quality = mean of {len(cfg.final_eval_steps())} "
        f"held-out evaluations; equivalence margin ±{cfg.margin:g} nats"
        + (f"; lm-eval {','.join(tasks)} on every seed" if tasks and lm_eval_unavailable() is None else ""),
        f"  Ctrl-C stops it; `{resume_command(cfg)}` continues",
    ]


def report_diverged(plan: Plan, units: dict, seed: int, m: float, echo) -> None:
    for (arm, s, mm), rec in units.items():
        if plan.main and s == seed and mm == m and rec.get("status") == "diverged":
            nf = rec["nonfinite"]
            echo(
                f"normswap study: arm {arm} (seed {seed + 1}, lr ×{m:g}) stopped at step {nf['step']}: "
                f"{nf['what']} is {nf['value']}; the other arms went on"
            )
