"""``run_study``: five named stages, read top to bottom at the end of this file.

1. ``plan_study``: options, MODEL (over bytes by default, study/bytes_model.py), arms, data, the count
   baselines and the kernel choice; everything that can fail on bad input (options, arm names, MODEL
   without a LayerNorm to replace, DIR that is not a study or overlaps an input, data too short)
   fails before DIR is touched.
2. ``train_units``: --seeds seeds in one round, spread over worker processes (study/units.py), then
   one seed a round while a verdict is still open and --budget allows; plain steps, memory and the
   norms' share measured on a few sampled steps (study/measure.py).
3. ``speed_phase.measure``: after training, alone on the machine, the one timing instrument
   (normswap/timing.py): interleaved pairs of short train steps, each arm against layernorm, with
   layernorm's second copy as the null control.
4. ``decide`` (analysis.py): comparisons, the power of the equal-loss test (study/power.py), the instrument check
   (planted arm different, null control equivalent), the claims' verdicts.
5. ``write_results`` (results_writer.py): results.json, the report, the run file.

Only process 0 writes; under torchrun every process trains its rows of every group.

The parts each stage calls live in modules named for their job: preflight_checks.py (every refusal),
distributed.py (torchrun: process 0's decisions sent to all), progress_display.py, console_text.py
(the header, a diverged arm, the resume command), seeds.py (whether another seed runs),
analysis.py (stage 4), results_writer.py (stage 5), baselines.py (the count models' losses);
study_plan.py holds the records the stages hand each other.
"""

from __future__ import annotations

import sys
import time

import torch

from normswap.devices import resolve_device
from normswap.errors import NormswapError
from normswap.host import load_average, usable_cpus
from normswap.study import migration, norm_impl, speed_phase
from normswap.study.analysis import decide
from normswap.study.arms import build_arm, check_replaceable
from normswap.study.baselines import baseline_losses
from normswap.study.config import BASELINE, CONTROL, StudyConfig
from normswap.study.console_text import header_lines, report_diverged, resume_command
from normswap.study.distributed import agree, agree_choice, init_dist
from normswap.study.inputs import open_study_source, study_data
from normswap.study.interleaved import Dist, Group, Hooks
from normswap.study.preflight_checks import arms_for, check_memory, check_options, check_sizes, lm_eval_or_note
from normswap.study.progress_display import Progress
from normswap.study.results_writer import write_results
from normswap.study.seeds import next_seed, worker_rounds
from normswap.study.speed import recorded_loads
from normswap.study.study_dir import unit_key
from normswap.study.study_plan import Plan, Trained
from normswap.study.units import Trainer, run_in_workers


class StudyInterrupted(NormswapError):
    """Ctrl-C: the finished units are kept in DIR; ``--resume`` continues the study."""

    exit_code = 130


def _workers(cfg: StudyConfig, dist: Dist, hooks: Hooks) -> int:
    """Processes to train units in: one (this one) under torchrun, with test hooks, or on CUDA."""
    if dist.world > 1 or hooks != Hooks() or dist.device.type == "cuda":
        return 1
    return cfg.workers or max(1, usable_cpus() or 1)


def plan_study(cfg: StudyConfig, given, hooks: Hooks, echo) -> Plan:
    """Stage 1: every refusal (options, MODEL, arms, data, DIR) before DIR changes; the baselines and
    the kernel choice measured; DIR started and the header printed."""
    cfg, study, recorded = check_options(cfg, given)
    device = resolve_device(cfg.device)
    if cfg.threads and not device.startswith("cuda"):
        torch.set_num_threads(cfg.threads)
    dist = init_dist(device)
    source = open_study_source(cfg)
    notes: list[str] = []
    arms = arms_for(cfg, source, notes)
    n_params = check_memory(source, arms, device)  # tied weights counted once
    norms_replaced = check_replaceable(source, 0)
    check_sizes(cfg, source, dist.world)
    lm_eval_or_note(cfg, dist, notes, echo)
    data = study_data(cfg, source)
    from normswap.finetune.batches import TrainStream

    TrainStream(source.tokenizer, cfg.data, cfg.seq_len, 0, split=data["train_split"]).take(1)  # too short: now
    if cfg.steps < cfg.warmup and dist.rank == 0:
        echo(
            f"normswap study: warning: --steps {cfg.steps} is below --warmup-steps {cfg.warmup}: the rate never "
            f"reaches its peak {cfg.lr:g} and never decays (the schedule is all warmup)"
        )
    baselines = baseline_losses(source, cfg, data["train_split"], data["eval_set"]) if dist.rank == 0 else {}
    kernel_setup = (recorded or {}).get("kernels") or norm_impl.setup(
        lambda arm, impl: build_arm(source, arm, 0, cfg.kernels, precision=cfg.precision, rms_impl=impl),
        arms,
        BASELINE,
        cfg.kernels,
        dist.device,
        cfg.precision,
        rows=(cfg.batch_size // dist.world) * cfg.seq_len,
    )
    kernel_setup = dict(kernel_setup, rms_impl=agree_choice(dist, kernel_setup["rms_impl"]))
    plan = Plan(cfg, study, recorded, source, arms, notes, n_params, norms_replaced, dist, data, baselines,
                kernel_setup, _workers(cfg, dist, hooks))  # fmt: skip
    if plan.main:
        _start_dir(plan, echo)
    return plan


def _start_dir(plan: Plan, echo) -> None:
    cfg, study, recorded = plan.cfg, plan.study, plan.recorded
    if recorded is None:
        first = {"config": cfg.recorded(), "arms": plan.arms, "status": "running", "resumes": 0, "seeds_started": 0}
        study.start(dict(first, kernels=plan.kernel_setup), replace=cfg.force)
    else:
        resumes = recorded.get("resumes", 0) + 1
        study.write_run(
            dict(recorded, config=cfg.recorded(), status="running", resumes=resumes, kernels=plan.kernel_setup)
        )
    for line in header_lines(cfg, plan.source, plan.arms, cfg.multipliers(), plan.dist, plan.n_params, plan.workers):
        echo(line)


def _read_done(plan: Plan, keys: list, units: dict) -> list:
    """The keys not finished yet; the finished ones read from DIR into ``units`` (process 0 reads,
    every process learns which)."""
    done = agree(plan.dist, [plan.main and plan.study.read_unit(unit_key(*k)) is not None for k in keys])
    if plan.main:
        units.update({k: plan.study.read_unit(unit_key(*k)) for k, d in zip(keys, done) if d})
    return [k for k, d in zip(keys, done) if not d]


def _train_keys(plan: Plan, trainer: Trainer, keys: list, units: dict, hooks: Hooks, progress, echo) -> None:
    """Train the units ``keys``: in worker processes, or here one (seed, rate) group at a time."""
    if not keys:
        return
    if plan.workers > 1:
        workers = min(plan.workers, len(keys))

        def landed(key, record):
            if record is not None:
                units[key] = record

        return run_in_workers(trainer, keys, workers, echo, landed)
    for seed, m in dict.fromkeys((s, m) for _, s, m in keys):
        arms = [a for a in plan.arms if (a, seed, m) in keys]
        where = f"seed {seed + 1}" + (f" lr ×{m:g}" if len(plan.cfg.multipliers()) > 1 else "")

        def save(record, seed=seed, m=m):
            units[(record["arm"], seed, m)] = record
            if plan.main:
                plan.study.write_unit(unit_key(record["arm"], seed, m), record)

        def on_step(t, arms_now, where=where):
            n = sum(1 for a in arms_now if a.record["steps_done"] == t)
            progress.step(n, f"{where} step {t}/{plan.cfg.steps}", arms_now)

        trainer.group(arms, seed, m, hooks, on_step=on_step, save=save)
        report_diverged(plan, units, seed, m, echo)


def _train_seeds(plan: Plan, trainer: Trainer, trained: Trained, hooks: Hooks, progress, echo) -> None:
    """--seeds seeds first (one round: every worker busy), then one seed a round while a verdict is open."""
    cfg, study = plan.cfg, plan.study
    run = (study.read_run() or {}) if plan.main else {}
    started, trained.spent = int(run.get("seeds_started", 0)), float(run.get("train_seconds", 0.0))
    per_seed: list[float] = list(run.get("seed_seconds", []))
    seed = 0
    while seed < cfg.seed_limit():
        seeds = list(range(seed, max(cfg.seeds, started))) if seed < max(cfg.seeds, started) else [seed]
        keys = [(arm, s, m) for s in seeds for m in trained.mults for arm in plan.arms]
        todo = _read_done(plan, keys, trained.units)
        if todo and seed >= max(cfg.seeds, started):
            arms = next_seed(plan, trained, seed, per_seed, echo)
            if not arms:
                return
            keys, todo = [k for k in keys if k[0] in arms], [k for k in todo if k[0] in arms]
        if plan.main and len(keys) > len(todo) > 0:
            echo(f"normswap study: resuming: {len(keys) - len(todo)} of {len(keys)} units finished, {len(todo)} to run")
        if plan.main and seeds[-1] + 1 > started:
            started = seeds[-1] + 1
            study.write_run(dict(study.read_run() or {}, seeds_started=started))
        t0 = time.perf_counter()
        _train_keys(plan, trainer, todo, trained.units, hooks, progress, echo)
        took = time.perf_counter() - t0
        trained.seeds_done += seeds
        if todo:
            trained.spent += took
            whole = worker_rounds(plan, len(plan.arms) * len(seeds) * len(trained.mults)) / worker_rounds(
                plan, len(todo)
            )
            per_seed += [took * whole / len(seeds)] * len(seeds)  # as if every arm had trained
            if plan.main:
                study.write_run(dict(study.read_run() or {}, train_seconds=trained.spent, seed_seconds=per_seed))
        seed = seeds[-1] + 1
    trained.stop_reason = f"--max-seeds {cfg.seed_limit()} reached"


def _extend_sweep(plan: Plan, trainer: Trainer, trained: Trained, hooks, progress, echo) -> None:
    """A best rate at the sweep's edge: one more rate past it (at most MAX_EXTENSIONS), decided by process 0."""
    for _ in range(migration.MAX_EXTENSIONS if trainer.held_out is not None else 0):
        mults = trained.mults
        new = migration.extension(trained.units, [a for a in plan.arms if a != CONTROL], mults, trained.seeds_done)
        low, high = agree(plan.dist, [new is not None and new < min(mults), new is not None and new > max(mults)])
        if not (low or high):
            break
        new = mults[0] ** 2 / mults[1] if low else mults[-1] ** 2 / mults[-2]
        echo(f"normswap study: a best rate sits at the sweep's edge: adding lr ×{new:g}")
        trained.mults = sorted(mults + [new])
        keys = [(arm, seed, new) for seed in trained.seeds_done for arm in plan.arms]
        _train_keys(plan, trainer, _read_done(plan, keys, trained.units), trained.units, hooks, progress, echo)


def train_units(plan: Plan, hooks: Hooks, echo) -> Trained:
    """Stage 2: the seeds (sequentially decided), the sweep's extensions, the stability sweep."""
    cfg, dist = plan.cfg, plan.dist
    trainer = Trainer(cfg, plan.source, plan.study, dist, plan.data["train_split"], plan.data["eval_set"],
                      plan.kernel_setup["rms_impl"], held_out=plan.data["held_out"], main=plan.main)  # fmt: skip
    trained = Trained(units={}, seeds_done=[], mults=cfg.multipliers())
    show_bar = (cfg.progress if cfg.progress is not None else sys.stderr.isatty()) and plan.workers == 1
    total = len(plan.arms) * len(trained.mults) * cfg.steps * cfg.seeds
    progress = Progress(total, bool(show_bar) and plan.main, echo if plan.main else (lambda m: None))
    try:
        _train_seeds(plan, trainer, trained, hooks, progress, echo)
        _extend_sweep(plan, trainer, trained, hooks, progress, echo)
        if cfg.stability:
            from normswap.study import stability as stab

            trained.stab_units = stab.run_sweep(
                cfg,
                plan.arms,
                study=plan.study,
                make_group=lambda c, group_arms, seed, m: Group(
                    plan.source, c, group_arms, seed, m, dist, hooks, rms_impl=plan.kernel_setup["rms_impl"]
                ),
                eval_set=plan.data["eval_set"],
                make_stream=lambda seed: trainer.stream_for,
                main=plan.main,
                agree=lambda flags: agree(dist, flags),
                echo=echo,
            )
    except KeyboardInterrupt:
        progress.close()
        finished = len(list(plan.study.units.glob("*.json"))) if plan.main else 0
        if plan.main:
            plan.study.write_run(dict(plan.study.read_run() or {}, status="interrupted"))
        raise StudyInterrupted(
            f"interrupted: {finished} finished unit(s) kept in {cfg.out}; continue with: {resume_command(cfg)}"
        ) from None
    finally:
        progress.close()
    return trained


def run_study(cfg: StudyConfig, *, given: set[str] | None = None, hooks: Hooks | None = None, echo=None) -> dict:
    """Run (or resume) the study of ``cfg`` in ``cfg.out``; return results.json's content.

    plan (every refusal before DIR changes) → train units (seeds in worker processes) → measure
    speed (a protected timing phase) → decide (comparisons, verdicts) → write (results, report)."""
    echo = echo or (lambda msg: print(msg, file=sys.stderr))
    hooks = hooks or Hooks()
    clock = {"wall0": time.perf_counter(), "load_start": load_average()}
    plan = plan_study(cfg, given, hooks, echo)
    trained = train_units(plan, hooks, echo)
    if not plan.main:
        return {}
    speed_record = speed_phase.measure(plan, echo) if plan.cfg.speed_seconds > 0 else None
    loads = recorded_loads(clock["load_start"], trained.units)
    analysis = decide(plan, trained, speed_record, loads)
    return write_results(plan, trained, analysis, speed_record, clock)


__all__ = ["Hooks", "StudyInterrupted", "run_study"]
