"""``run_study``: options, MODEL, DIR, the groups (seed × rate, arms interleaved), the analysis.

Reads top to bottom. Everything that can fail on bad input (options, arm names, MODEL without a
LayerNorm to replace, DIR that is not a study or overlaps an input, data too short) fails before
DIR is touched. Only process 0 writes; every process trains its rows of every group.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import shlex
import statistics
import sys
import time

import torch

from normswap.devices import resolve_device
from normswap.errors import NormswapError
from normswap.finetune.step import Schedule, precision_for
from normswap.study import claims as claims_mod
from normswap.study import kernels as study_kernels
from normswap.study import measure, migration, speed
from normswap.study import results as res
from normswap.study.arms import build_arm, check_arms, check_replaceable, default_arms, open_source
from normswap.study.config import (
    ARM_SCHEDULE,
    BASELINE,
    CONTROL,
    DEFAULT_MODEL,
    TRAINED_ONLY,
    StudyConfig,
    flag,
    option_errors,
)
from normswap.study.heldout import heldout_blocks
from normswap.study.study_dir import StudyDir, resolve_resume, unit_key
from normswap.study.trainer import Dist, Group, Hooks

SCHEMA_VERSION = 1
PROGRESS_EVERY = 30.0  # seconds between progress lines when stderr is not a terminal


def _init_dist(device: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
        rank = dist.get_rank()
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
            torch.cuda.set_device(torch.device(device))
        return Dist(torch.device(device), rank, dist.get_world_size())
    return Dist(torch.device(device))


def _agree(dist: Dist, flags: list[bool]) -> list[bool]:
    """Process 0's decisions, sent as a tensor (nothing pickled)."""
    if dist.world == 1 or not flags:
        return flags
    import torch.distributed as tdist

    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int64, device=dist.device)
    tdist.broadcast(t, 0)
    return [bool(v) for v in t.tolist()]


class Progress:
    """A tqdm bar on a terminal, else one line every PROGRESS_EVERY seconds (a Heartbeat's interval
    rule, normswap/progress.py; the line is built only when it is due)."""

    def __init__(self, total: int, show_bar: bool, echo):
        from normswap.progress import Heartbeat

        self.total, self.done = total, 0
        self.heartbeat = Heartbeat(echo, every=PROGRESS_EVERY, enabled=True, clock=time.perf_counter)
        self.bar = None
        if show_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="study", unit="arm-step", dynamic_ncols=True, file=sys.stderr)

    def step(self, n: int, where: str, arms) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix_str(where)
            return
        done, beat = self.done, self.heartbeat

        def line() -> str:
            losses = "  ".join(
                f"{a.name} {a.record['loss'][-1]:.3f}"
                for a in arms
                if a.record["loss"] and a.record["loss"][-1] is not None
            )
            elapsed = beat.clock() - beat.t0
            left = elapsed / max(done, 1) * (self.total - done)
            return (
                f"study: {where}  {done}/{self.total} arm-steps  loss {losses}  ({elapsed:.0f} s, ~{left:.0f} s left)"
            )

        beat.update(line)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _agree_choice(dist: Dist, choice: str) -> str:
    """Process 0's kernel choice for every process (timings differ between processes)."""
    names = list(study_kernels.RMS_IMPLS)
    return names[_agree_index(dist, names.index(choice))] if choice in names else choice


def _agree_index(dist: Dist, i: int) -> int:
    if dist.world == 1:
        return i
    import torch.distributed as tdist

    t = torch.tensor([i], dtype=torch.int64, device=dist.device)
    tdist.broadcast(t, 0)
    return int(t.item())


def _check_sizes(cfg: StudyConfig, source, world: int) -> None:
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


def _cpus() -> int | None:
    """The CPUs this process may run on (the load gate's yardstick)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _loads(load_start, units: dict) -> list[float]:
    """The 1-minute load averages recorded so far (at the start, now, and by each unit): speed.py's gate."""
    loads = [load_start, _load_average()] + [v for u in units.values() for v in (u.get("load") or [])]
    return [v[0] if isinstance(v, list) else v for v in loads if v is not None]


class StudyInterrupted(NormswapError):
    """Ctrl-C: the finished units are kept in DIR; ``--resume`` continues the study."""

    exit_code = 130


def resume_command(cfg: StudyConfig) -> str:
    model = "" if cfg.model == DEFAULT_MODEL and cfg.from_scratch else f" {shlex.quote(cfg.model)}"
    return f"normswap study{model} --out {shlex.quote(str(cfg.out))} --resume"


def header_lines(cfg: StudyConfig, source, arms: list[str], mults: list[float], dist: Dist, n_params: int) -> list[str]:
    """What the study is about to do, printed before the first step."""
    start = "random initialisation per seed" if source.from_scratch else "its trained weights"
    arm_mults = cfg.arm_multipliers()
    moved = "".join(f" ({a} at ×{m:g} lr)" for a, m in arm_mults.items())
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
        f"{dist.device} × {dist.world} process(es)",
        f"  work: {per_seed:,} arm-steps per seed, {per_seed * cfg.seeds:,} for the first {cfg.seeds} seeds "
        f"(at most {per_seed * cfg.seed_limit():,}); final quality = mean of {len(cfg.final_eval_steps())} "
        f"held-out evaluations; equivalence margin ±{cfg.margin:g} nats"
        + (f"; lm-eval {','.join(tasks)} on the first seed" if tasks else ""),
        f"  Ctrl-C stops it; `{resume_command(cfg)}` continues",
    ]


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


def analyse(
    cfg: StudyConfig,
    units: dict,
    arms: list[str],
    baselines: dict,
    precision: dict | None,
    *,
    kernel_setup: dict | None = None,
    loads=(),
    cpus: int | None = None,
    stability_sweep: dict | None = None,
    mults: list[float] | None = None,
    from_scratch: bool = True,
) -> dict:
    """Comparisons (with the Amdahl bound and the throughput gates, speed.py), sweep, migration rule,
    null control and the claims' verdicts from the units so far (the runner also calls it between
    seeds to decide whether another one is needed)."""
    mults = mults or cfg.multipliers()  # the sweep's rates, extended past an edge where one was
    ref_mult = 1.0 if 1.0 in mults else mults[0]
    diverged_loss = baselines.get("uniform_loss")
    comparisons = {
        a: res.compare(units, a, BASELINE, ref_mult, margin=cfg.margin, diverged_loss=diverged_loss)
        for a in arms
        if a != BASELINE
    }
    base_units = [u for (a, _, m), u in units.items() if a == BASELINE and m == ref_mult]
    norm_share = speed.add_amdahl(comparisons, base_units, kernel_setup or {})
    loads = list(loads)
    control_boot = (comparisons.get(CONTROL) or {}).get("throughput_ratio_bootstrap")
    for c in comparisons.values():
        c["throughput_gates"] = speed.gates(control_boot, c.get("amdahl_bound"), loads, cpus)
    sw = res.sweep(units, arms, mults, BASELINE)
    rules = {}
    if sw is not None:
        for a in arms:
            if a not in (BASELINE, CONTROL) and a in claims_mod.RMS_ARMS:
                seeds = sorted({s for (arm, s, _) in units if arm == a})
                rules[a] = migration.analyse(units, a, BASELINE, mults, seeds, ref_mult, from_scratch=from_scratch)
    null = claims_mod.null_control(comparisons.get(CONTROL))
    ctx = claims_mod.Context(
        margin=cfg.margin,
        baselines=baselines,
        control=comparisons.get(CONTROL),
        null_control=null,
        precision=precision,
        train_precision=cfg.precision,
        rules=rules,
        loads=tuple(loads),
        cpus=cpus,
        stability_sweep=stability_sweep,
    )
    verdicts = claims_mod.judge(comparisons, ctx, CONTROL)
    return {
        "reference_multiplier": ref_mult,
        "comparisons": comparisons,
        "baseline_norm_share": norm_share,
        "lr_sweep": sw,
        "migration_rule": rules or None,
        "null_control": null,
        "claims": verdicts,
        "multiplicity": claims_mod.multiplicity(verdicts),
    }


def seed_decision(
    cfg: StudyConfig, seed: int, rows: list[dict], spent: float, per_seed: list[float]
) -> tuple[bool, str]:
    """Whether seed ``seed`` (0-based, beyond --seeds) should run, and why: while a verdict is still
    open (claims.open_rows: more seeds could decide it), below --max-seeds, and while the seeds so
    far (their mean time) say another fits in --budget."""
    if seed >= cfg.seed_limit():
        return False, f"--max-seeds {cfg.seed_limit()} reached"
    pending = claims_mod.open_rows(rows)
    if not pending:
        return False, f"every verdict decided after {seed} seeds"
    estimate = statistics.fmean(per_seed) if per_seed else 0.0
    if cfg.budget and spent + estimate > cfg.budget:
        return False, (
            f"budget: {spent:.0f} s spent, another seed takes ~{estimate:.0f} s of {cfg.budget:g} s "
            f"({len(pending)} verdict(s) still open)"
        )
    names = ", ".join(sorted({f"{r['claim'].split(':')[0]} ({r['arm']})" for r in pending})[:3])
    return True, f"{len(pending)} verdict(s) open after {seed} seeds, e.g. {names}"


def run_study(cfg: StudyConfig, *, given: set[str] | None = None, hooks: Hooks | None = None, echo=None) -> dict:
    """Run (or resume) the study of ``cfg`` in ``cfg.out``; return results.json's content."""
    from normswap.data import finetune_splits
    from normswap.finetune.data import TrainStream

    echo = echo or (lambda msg: print(msg, file=sys.stderr))
    hooks = hooks or Hooks()
    wall0 = time.perf_counter()
    load_start = _load_average()

    # ---- options (a resume takes DIR's) ----
    problems = [f"{flag(n)} {why}" for n, why in option_errors(dataclasses.asdict(cfg))]
    if problems:
        raise NormswapError("; ".join(problems))
    study = StudyDir(cfg.out)
    recorded = study.check(reads=[("MODEL", cfg.model), ("the data", cfg.data)], resume=cfg.resume, force=cfg.force)
    if recorded is not None:
        cfg = resolve_resume(cfg, recorded.get("config"), given, where=str(study.run_file))
    device = resolve_device(cfg.device)
    if cfg.threads and not device.startswith("cuda"):
        torch.set_num_threads(cfg.threads)
    dist = _init_dist(device)
    main = dist.rank == 0

    # ---- MODEL, arms, data: every refusal before DIR changes ----
    source = open_source(cfg.model, from_scratch=cfg.from_scratch)
    arms = check_arms(list(cfg.arms) or default_arms(source), source)
    missing = [a for a in cfg.arm_multipliers() if a not in arms]
    if missing:
        raise NormswapError(f"--arm-lr names {missing[0]}, which is not among the arms ({', '.join(arms)})")
    n_params = check_memory(source, arms, device)  # tied weights counted once
    norms_replaced = check_replaceable(source, 0)
    notes = []
    for arm in [a for a in arms if a in TRAINED_ONLY]:
        try:  # a conversion the architecture cannot have (exact needs pre-LN) fails here, not mid-study
            build_arm(source, arm, 0, cfg.kernels, precision=cfg.precision)
        except NormswapError as e:
            if cfg.arms:
                raise
            arms.remove(arm)  # a default arm: left out, and said
            notes.append(f"{arm} left out: {e}")
    _check_sizes(cfg, source, dist.world)
    tasks = cfg.lm_eval_task_list()
    if tasks and main:
        _check_lm_eval_tasks(tasks)
    mults = cfg.multipliers()
    train_split, eval_spec, eval_split = finetune_splits(cfg.data)
    heldout = heldout_blocks(source.tokenizer, eval_spec, cfg.seq_len, cfg.eval_tokens, split=eval_split)
    eval_set = heldout["blocks"]
    TrainStream(source.tokenizer, cfg.data, cfg.seq_len, 0, split=train_split).take(1)  # fails now if too short
    if cfg.steps < cfg.warmup and main:
        echo(
            f"normswap study: warning: --steps {cfg.steps} is below --warmup {cfg.warmup}: the rate never reaches "
            f"its peak {cfg.lr:g} and never decays (the schedule is all warmup)"
        )
    baselines = baseline_losses(source, cfg, train_split, eval_set) if main else {}

    # ---- kernels: chosen (and their speed-ups measured) before any training step ----
    kernel_setup = (recorded or {}).get("kernels") or study_kernels.setup(
        lambda arm, impl: build_arm(source, arm, 0, cfg.kernels, precision=cfg.precision, rms_impl=impl),
        arms,
        BASELINE,
        cfg.kernels,
        dist.device,
        cfg.precision,
        rows=(cfg.batch_size // dist.world) * cfg.seq_len,
    )
    kernel_setup = dict(kernel_setup, rms_impl=_agree_choice(dist, kernel_setup["rms_impl"]))

    # ---- DIR ----
    if main:
        if recorded is None:
            study.start(
                {
                    "config": cfg.recorded(),
                    "arms": arms,
                    "status": "running",
                    "resumes": 0,
                    "kernels": kernel_setup,
                    "seeds_started": 0,
                },
                replace=cfg.force,
            )
        else:
            study.write_run(
                dict(
                    recorded,
                    config=cfg.recorded(),
                    status="running",
                    resumes=recorded.get("resumes", 0) + 1,
                    kernels=kernel_setup,
                )
            )
        for line in header_lines(cfg, source, arms, mults, dist, n_params):
            echo(line)

    # ---- the seeds, one after another ----
    run_record = (study.read_run() or {}) if main else {}
    started = int(run_record.get("seeds_started", 0))
    spent = float(run_record.get("train_seconds", 0.0))
    per_seed: list[float] = list(run_record.get("seed_seconds", []))
    units: dict = {}
    seeds_done: list[int] = []  # the seeds run or found finished, the same on every process
    stop_reason = None
    tokens_per_step = cfg.batch_size * cfg.seq_len
    # the migration rule's held-out blocks: validation and a disjoint test set (migration.py)
    held_out = migration.blocks(source.tokenizer, eval_spec, cfg, eval_set) if len(mults) > 1 else None

    show_bar = cfg.progress if cfg.progress is not None else sys.stderr.isatty()
    progress = Progress(
        len(arms) * len(mults) * cfg.steps * cfg.seeds, bool(show_bar) and main, echo if main else (lambda m: None)
    )
    run = _Run(
        cfg,
        source,
        study,
        units,
        arms,
        dist,
        hooks,
        train_split,
        eval_set,
        progress,
        echo,
        main,
        kernel_setup["rms_impl"],
        held_out,
    )
    try:
        for seed in range(cfg.seed_limit()):
            keys = [(arm, seed, m) for m in mults for arm in arms]
            done_flags = _agree(dist, [main and study.read_unit(unit_key(*k)) is not None for k in keys])
            if main:
                units.update({k: study.read_unit(unit_key(*k)) for k, d in zip(keys, done_flags) if d})
            if all(done_flags):
                seeds_done.append(seed)
                continue
            if seed >= max(cfg.seeds, started):
                rows = (
                    analyse(
                        cfg,
                        units,
                        arms,
                        baselines,
                        None,
                        kernel_setup=kernel_setup,
                        loads=_loads(load_start, units),
                        cpus=_cpus(),
                    )["claims"]
                    if main
                    else []
                )
                go, why = seed_decision(cfg, seed, rows, spent, per_seed) if main else (True, "")
                go = _agree(dist, [go])[0]
                if main:
                    echo(f"normswap study: {'seed ' + str(seed + 1) + ': ' if go else 'stopping: '}{why}")
                if not go:
                    stop_reason = why
                    break
                progress.total += len(arms) * len(mults) * cfg.steps
            todo = [k for k, d in zip(keys, done_flags) if not d]
            if main and len(todo) < len(keys):
                echo(
                    f"normswap study: resuming seed {seed + 1}: {len(keys) - len(todo)} of {len(keys)} units finished, "
                    f"{len(todo)} to run"
                )
            if main and seed + 1 > started:
                started = seed + 1
                study.write_run(dict(study.read_run() or {}, seeds_started=started))
            seeds_done.append(seed)
            t_seed = time.perf_counter()
            for m in mults:
                _run_group(run, todo, seed, m)
            took = time.perf_counter() - t_seed
            spent += took
            per_seed.append(took)
            if main:
                study.write_run(dict(study.read_run() or {}, train_seconds=spent, seed_seconds=per_seed))
        else:
            stop_reason = f"--max-seeds {cfg.seed_limit()} reached"
        # a best rate at the sweep's edge: one more rate past it (at most MAX_EXTENSIONS), decided by process 0
        for _ in range(migration.MAX_EXTENSIONS if held_out is not None else 0):
            new = migration.extension(units, [a for a in arms if a != CONTROL], mults, seeds_done)
            low, high = _agree(dist, [new is not None and new < min(mults), new is not None and new > max(mults)])
            if not (low or high):
                break
            new = mults[0] ** 2 / mults[1] if low else mults[-1] ** 2 / mults[-2]
            echo(f"normswap study: a best rate sits at the sweep's edge: adding lr ×{new:g}")
            mults = sorted(mults + [new])
            for seed in seeds_done:
                todo = [(arm, seed, new) for arm in arms]
                done = _agree(dist, [main and study.read_unit(unit_key(*k)) is not None for k in todo])
                for k, d in zip(todo, done):
                    if d and main:
                        units[k] = study.read_unit(unit_key(*k))
                todo = [k for k, d in zip(todo, done) if not d]
                _run_group(run, todo, seed, new)
        stab_units = None
        if cfg.stability:
            from normswap.study import stability as stab

            stab_units = stab.run_sweep(
                cfg,
                arms,
                study=study,
                make_group=lambda c, group_arms, seed, m: Group(
                    source, c, group_arms, seed, m, dist, hooks, rms_impl=kernel_setup["rms_impl"]
                ),
                eval_set=eval_set,
                make_stream=lambda seed: stream_factory(source, cfg, train_split),
                main=main,
                agree=lambda flags: _agree(dist, flags),
                echo=echo,
            )
    except KeyboardInterrupt:
        progress.close()
        finished = len([p for p in study.units.glob("*.json")]) if main else 0
        if main:
            study.write_run(dict(study.read_run() or {}, status="interrupted"))
        raise StudyInterrupted(
            f"interrupted: {finished} finished unit(s) kept in {cfg.out}; continue with: {resume_command(cfg)}"
        ) from None
    finally:
        progress.close()
    if not main:
        return {}

    # ---- analysis, precision table, results.json ----
    from normswap.study import precision as kernel_acc

    loads = _loads(load_start, units)
    cpus = _cpus()
    unit_list = list(units.values())
    precision = kernel_acc.kernel_accuracy(
        "cpu" if dist.device.type != "cuda" else dist.device,
        kernel_acc.kernels_for(unit_list, cfg.kernels, {a: kernel_acc.arm_kind(a) for a in arms}),
    )
    stability, stability_sweep = None, None
    if stab_units is not None:
        stab_seeds = list(range(cfg.seeds))
        stability = stab.summarize(stab_units, arms, stab_seeds, cfg)
        stability_sweep = stab.sweep_record(stab_units, arms, stab_seeds, cfg, BASELINE)
    analysis = analyse(
        cfg,
        units,
        arms,
        baselines,
        precision,
        kernel_setup=kernel_setup,
        loads=loads,
        cpus=cpus,
        stability_sweep=stability_sweep,
        mults=mults,
        from_scratch=source.from_scratch,
    )
    seeds_run = sorted({seed for (_, seed, _) in units})
    order = [(arm, seed, m) for seed in seeds_run for m in mults for arm in arms]
    results = {
        "schema_version": SCHEMA_VERSION,
        "kind": "normswap-study",
        "model": cfg.model,
        "from_scratch": source.from_scratch,
        "architecture": {
            "model_type": source.config.model_type,
            "parameters": n_params,
            "norms_replaced": norms_replaced,
        },
        "setup": {
            **cfg.recorded(),
            "arms": arms,
            "seeds_list": seeds_run,
            "seeds_run": len(seeds_run),
            "seed_limit": cfg.seed_limit(),
            "stopped_because": stop_reason,
            "multipliers": mults,
            "arm_lr_multipliers": cfg.arm_multipliers(),
            "arm_schedules": {a: ARM_SCHEDULE[a] for a in arms if a in ARM_SCHEDULE},
            "reference_multiplier": analysis["reference_multiplier"],
            "tokens_per_step": tokens_per_step,
            "margin_nats": cfg.margin,
            "lr_schedule": cfg.lr_schedule,
            "schedule": Schedule(cfg.lr, cfg.steps, cfg.warmup, cfg.lr_schedule, cfg.min_lr_ratio).describe(),
            "final_eval_steps": cfg.final_eval_steps(),
            "eval_tokens_used": int(eval_set.numel()),
            "heldout": {
                "blocks": int(eval_set.shape[0]),
                "tokens": int(eval_set.numel()),
                "blocks_in_pool": heldout["read"],
                "stride_blocks": heldout["stride"],
                "split": eval_split,
                "rule": "disjoint blocks at an even stride over the validation split (study/heldout.py)",
            },
            "control_data": "layernorm-control: own data order and dropout stream (seed + 1000003), same init",
            "device": str(dist.device),
            "world_size": dist.world,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "spike_rule": f"loss > {cfg.spike_factor:g} × median of the previous {20} steps (after 10)",
            "statistics": res.stats.METHOD,
            "cpus": cpus,
            "kernels": kernel_setup,
            "memory_method": measure.memory_method(dist.device),
            "step_plan": {
                "memory_step": measure.MEMORY_STEP,
                "profiled_steps": f"every {measure.PROFILE_EVERY}th from step {measure.PROFILE_START}",
                "timed_steps": len(measure.StepPlan(cfg.steps, arms).timed_steps()),
                "arm_order": "Williams design over the timed steps",
            },
            "throughput_method": speed.METHOD,
        },
        "notes": notes,
        "baseline": BASELINE,
        "control": CONTROL if CONTROL in arms else None,
        "baselines": baselines,
        "units": [res.summarize_unit(units[k], tokens_per_step) for k in order if k in units],
        "comparisons": analysis["comparisons"],
        "null_control": analysis["null_control"],
        "baseline_norm_share": analysis["baseline_norm_share"],
        "lr_sweep": analysis["lr_sweep"],
        "migration_rule": analysis["migration_rule"],
        "precision": precision,
        "stability": stability,
        "stability_sweep": stability_sweep,
        "lm_eval": res.lm_eval_table(units, arms, analysis["reference_multiplier"]),
        "claims": analysis["claims"],
        "multiplicity": analysis["multiplicity"],
        "timing": {
            "wall_seconds": time.perf_counter() - wall0,
            "train_seconds": spent,  # every seed's training (resumes included): what --budget counts
            "load_average_start": load_start,
            "load_average_end": _load_average(),
        },
    }
    results = _finite(results)
    from normswap.publish import atomic_write_json

    atomic_write_json(study.results_file, results)
    from normswap.study.report import write_report

    write_report(results, study.out)
    run = study.read_run() or {}
    study.write_run(dict(run, status="finished"))
    return results


def baseline_losses(source, cfg: StudyConfig, train_split: str, eval_set) -> dict:
    """The count models' held-out losses (study/baselines.py) on the tokens a seed's arms read."""
    from normswap.study.baselines import ngram_losses, training_blocks

    train = training_blocks(source.tokenizer, cfg.data, cfg.seq_len, cfg.steps * cfg.batch_size, train_split)
    vocab = int(getattr(source.config, "vocab_size", 0) or len(source.tokenizer))
    return ngram_losses(train, eval_set, vocab)


def stream_factory(source, cfg: StudyConfig, train_split: str):
    """A data-order seed -> its token stream (made on first use): what ``Group.run`` reads batches from."""
    from normswap.finetune.data import TrainStream

    streams: dict = {}

    def stream_for(data_seed):
        if data_seed not in streams:
            streams[data_seed] = TrainStream(source.tokenizer, cfg.data, cfg.seq_len, data_seed, split=train_split)
        return streams[data_seed]

    return stream_for


@dataclasses.dataclass
class _Run:
    """What every (seed, multiplier) group of one study shares."""

    cfg: StudyConfig
    source: object
    study: StudyDir
    units: dict
    arms: list
    dist: Dist
    hooks: Hooks
    train_split: object
    eval_set: object
    progress: object
    echo: object
    main: bool
    rms_impl: str | None
    held_out: object = None


def _run_group(run: _Run, todo, seed, m):
    """One (seed, multiplier): its unfinished arms trained together; each unit written as it ends."""
    cfg, source, study, units, dist, main = run.cfg, run.source, run.study, run.units, run.dist, run.main
    arms, progress, echo, held_out = run.arms, run.progress, run.echo, run.held_out
    group_arms = [a for a in arms if (a, seed, m) in todo]
    if not group_arms:
        return
    group = Group(source, cfg, group_arms, seed, m, dist, run.hooks, rms_impl=run.rms_impl)
    stream_for = stream_factory(source, cfg, run.train_split)

    where = f"seed {seed + 1}" + (f" lr ×{m:g}" if len(cfg.multipliers()) > 1 else "")

    def save(record):
        units[(record["arm"], seed, m)] = record
        if main:
            study.write_unit(unit_key(record["arm"], seed, m), record)

    def on_step(t, arms_now):
        progress.step(
            sum(1 for a in arms_now if a.record["steps_done"] == t), f"{where} step {t}/{cfg.steps}", arms_now
        )

    def lm_eval(finished):
        tasks = cfg.lm_eval_task_list()
        if not tasks or seed != 0 or not main:
            return
        from normswap.evaluate.lm_eval_adapter import run_tasks
        from normswap.model_facts import context_length

        for arm in finished:
            arm.record["lm_eval"] = run_tasks(
                arm.model,
                source.tokenizer,
                tasks,
                batch_size=16,
                max_length=context_length(source.config),
                limit=cfg.lm_eval_limit or None,
                device=dist.device,
                log_path=study.out / "lm_eval.log",
                # the model as it trained: under bf16/fp16 its norms compute in that dtype, inside autocast
                mixed_precision=None if cfg.precision == "fp32" else precision_for(cfg.precision, dist.device).dtype,
            )

    records = group.run(stream_for, run.eval_set, on_step=on_step, on_arm_done=save, after_arms=lm_eval)
    if held_out is not None:  # the migration rule's per-block losses (migration.py)
        migration.add_block_losses(group.arms, held_out, cfg.precision, dist.device)
    for record in records:
        if record["status"] == "finished":
            save(record)
    if main:
        for arm in group.arms:
            if arm.record["status"] == "diverged":
                nf = arm.record["nonfinite"]
                echo(
                    f"normswap study: arm {arm.name} (seed {seed + 1}, lr ×{m:g}) stopped at step {nf['step']}: "
                    f"{nf['what']} is {nf['value']}; the other arms went on"
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


__all__ = ["Hooks", "StudyInterrupted", "run_study"]
