"""Every refusal a study makes before DIR changes: options, DIR, arms, sizes, memory, lm-eval tasks."""

from __future__ import annotations

import dataclasses

from normswap.errors import NormswapError
from normswap.evaluate.lm_eval_adapter import unavailable as lm_eval_unavailable
from normswap.study.config import TRAINED_ONLY, StudyConfig, flag, option_errors
from normswap.study.persistence.study_dir import StudyDir, resolve_resume
from normswap.study.training.arms import build_arm, check_arms, default_arms
from normswap.study.training.interleaved import Dist


def check_options(cfg: StudyConfig, given):
    problems = [f"{flag(n)} {why}" for n, why in option_errors(dataclasses.asdict(cfg))]
    if problems:
        raise NormswapError("; ".join(problems))
    study = StudyDir(cfg.out)
    recorded = study.check(reads=[("MODEL", cfg.model), ("the data", cfg.data)], resume=cfg.resume, force=cfg.force)
    if recorded is not None:
        cfg = resolve_resume(cfg, recorded.get("config"), given, where=str(study.run_file))
    return cfg, study, recorded


def arms_for(cfg: StudyConfig, source, notes: list[str]) -> list[str]:
    arms = check_arms(list(cfg.arms) or default_arms(source), source)
    missing = [a for a in cfg.arm_multipliers() if a not in arms]
    if missing:
        raise NormswapError(f"--arm-lr names {missing[0]}, which is not among the arms ({', '.join(arms)})")
    for arm in [a for a in arms if a in TRAINED_ONLY]:
        try:  # a conversion the architecture cannot have (exact needs pre-LN) fails here, not mid-study
            build_arm(source, arm, 0, cfg.kernels, precision=cfg.precision)
        except NormswapError as e:
            if cfg.arms:
                raise
            arms.remove(arm)  # a default arm: left out, and said
            notes.append(f"{arm} left out: {e}")
    return arms


def check_sizes(cfg: StudyConfig, source, world: int) -> None:
    from normswap.model_facts import context_length

    context = context_length(source.config)
    if context is not None and cfg.seq_len > context:
        raise NormswapError(f"--seq-len {cfg.seq_len} is longer than the model's context ({context})")
    if cfg.batch_size % world:
        raise NormswapError(
            f"--batch-size {cfg.batch_size} (the global batch) must be divisible by the number of processes ({world})"
        )


BYTES_PER_TRAINED_PARAMETER = 16  # fp32 weight, gradient and AdamW's two moments


def check_memory(source, arms: list[str], device: str) -> int:
    """Refuse, before any model is built, a study whose arms would not fit: a (seed, rate) group trains
    every arm at once, each with its weights, gradients and AdamW moments, beside the starting model.
    A config alone is counted on the meta device (checkpoint/sizes.py), so a hostile config.json
    costs nothing to refuse. Returns the parameter count."""
    from transformers import AutoModelForCausalLM

    from normswap.checkpoint.sizes import check_fits, parameter_count
    from normswap.devices import available_memory

    if source.trained is not None:
        n = sum(p.numel() for p in source.trained.parameters())
    else:
        n = parameter_count(source.config, AutoModelForCausalLM)
    need = n * (BYTES_PER_TRAINED_PARAMETER * len(arms) + 4)
    what = f"training {len(arms)} arms of {n:,} parameters side by side (weights, gradients, AdamW moments)"
    check_fits(need, available_memory(device), source.spec, what)
    return n


def lm_eval_or_note(cfg: StudyConfig, dist: Dist, notes: list[str], echo) -> None:
    """lm-eval is optional: where it cannot run, its tasks are skipped with a note (said now and kept in
    results.json ``notes``) rather than failing after the training; where it can, unknown task names
    fail now."""
    tasks = cfg.lm_eval_task_list()
    if not tasks or dist.rank != 0:
        return
    missing = lm_eval_unavailable()
    if missing is None:
        _check_lm_eval_tasks(tasks)
        return
    notes.append(f"lm-eval tasks {', '.join(tasks)} not scored: {missing}")
    echo(f"normswap study: note: {notes[-1]}")


def _check_lm_eval_tasks(tasks: list[str]) -> None:
    """Unknown task names fail now, not after the training."""
    from normswap.evaluate.lm_eval_adapter import hub_tasks

    other = hub_tasks(tasks)
    if not other:
        return
    from lm_eval.tasks import TaskManager

    from normswap.evaluate.lm_eval_adapter import tasks_path

    unknown = [t for t in other if t not in TaskManager(include_path=tasks_path()).all_tasks]
    if unknown:
        raise NormswapError(
            f"--lm-eval-tasks: unknown lm-eval task(s) {', '.join(unknown)} (see `lm_eval --tasks list`)"
        )
