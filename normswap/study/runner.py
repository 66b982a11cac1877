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
4. ``decide``: comparisons, the power of the equal-loss test (study/power.py), the instrument check
   (planted arm different, null control equivalent), the claims' verdicts.
5. ``write_results``: results.json, the report, the run file.

Only process 0 writes; under torchrun every process trains its rows of every group.
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
from normswap.evaluate.lm_eval_adapter import unavailable as lm_eval_unavailable
from normswap.finetune.step import Schedule
from normswap.study import claim_judges as claims_mod
from normswap.study import kernels as study_kernels
from normswap.study import measure, migration, sampler, speed, speed_phase
from normswap.study import results as res
from normswap.study.arms import build_arm, check_arms, check_replaceable, default_arms
from normswap.study.config import (
    ARM_SCHEDULE,
    BASELINE,
    CONTROL,
    DEFAULT_MODEL,
    PLANTED_LR,
    TRAINED_ONLY,
    StudyConfig,
    flag,
    option_errors,
)
from normswap.study.inputs import open_study_source, study_data
from normswap.study.interleaved import Dist, Group, Hooks
from normswap.study.study_dir import StudyDir, resolve_resume, unit_key
from normswap.study.units import Trainer, run_in_workers

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


def _lm_eval_or_note(cfg: StudyConfig, dist: Dist, notes: list[str], echo) -> None:
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
    speed_phase: dict | None = None,
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
    control_boot = None
    if speed_phase is not None:  # the timing phase's ratios replace the units' (unpaired in workers)
        control_boot = speed.use_speed_phase(comparisons, speed_phase)
    base_units = [u for (a, _, m), u in units.items() if a == BASELINE and m == ref_mult]
    norm_share = speed.add_amdahl(comparisons, base_units, kernel_setup or {})
    loads = list(loads)
    control_boot = control_boot or (comparisons.get(CONTROL) or {}).get("throughput_ratio_bootstrap")
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
        throughput_null=control_boot,
    )
    verdicts = claims_mod.judge(comparisons, ctx, CONTROL)
    from normswap.study import power

    return {
        "power": power.achieved(comparisons, cfg.margin, CONTROL),
        "instrument_check": claims_mod.instrument_check(comparisons, ctx, CONTROL, list(PLANTED_LR)),
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


# ---------------------------------------------------------------------------- the stages
@dataclasses.dataclass
class Plan:
    """What the study will do, fixed before DIR changes (stage 1: ``plan_study``)."""

    cfg: StudyConfig
    study: StudyDir
    recorded: dict | None
    source: object
    arms: list[str]
    notes: list[str]
    n_params: int
    norms_replaced: int
    dist: Dist
    data: dict
    baselines: dict
    kernel_setup: dict
    workers: int

    @property
    def main(self) -> bool:
        return self.dist.rank == 0


@dataclasses.dataclass
class Trained:
    """What training left (stage 2: ``train_units``)."""

    units: dict
    seeds_done: list[int]
    mults: list[float]
    stop_reason: str | None = None
    spent: float = 0.0
    stab_units: dict | None = None


def _check_options(cfg: StudyConfig, given):
    problems = [f"{flag(n)} {why}" for n, why in option_errors(dataclasses.asdict(cfg))]
    if problems:
        raise NormswapError("; ".join(problems))
    study = StudyDir(cfg.out)
    recorded = study.check(reads=[("MODEL", cfg.model), ("the data", cfg.data)], resume=cfg.resume, force=cfg.force)
    if recorded is not None:
        cfg = resolve_resume(cfg, recorded.get("config"), given, where=str(study.run_file))
    return cfg, study, recorded


def _arms_for(cfg: StudyConfig, source, notes: list[str]) -> list[str]:
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


def _workers(cfg: StudyConfig, dist: Dist, hooks: Hooks) -> int:
    """Processes to train units in: one (this one) under torchrun, with test hooks, or on CUDA."""
    if dist.world > 1 or hooks != Hooks() or dist.device.type == "cuda":
        return 1
    return cfg.workers or max(1, _cpus() or 1)


def plan_study(cfg: StudyConfig, given, hooks: Hooks, echo) -> Plan:
    """Stage 1: every refusal (options, MODEL, arms, data, DIR) before DIR changes; the baselines and
    the kernel choice measured; DIR started and the header printed."""
    cfg, study, recorded = _check_options(cfg, given)
    device = resolve_device(cfg.device)
    if cfg.threads and not device.startswith("cuda"):
        torch.set_num_threads(cfg.threads)
    dist = _init_dist(device)
    source = open_study_source(cfg)
    notes: list[str] = []
    arms = _arms_for(cfg, source, notes)
    n_params = check_memory(source, arms, device)  # tied weights counted once
    norms_replaced = check_replaceable(source, 0)
    _check_sizes(cfg, source, dist.world)
    _lm_eval_or_note(cfg, dist, notes, echo)
    data = study_data(cfg, source)
    from normswap.finetune.batches import TrainStream

    TrainStream(source.tokenizer, cfg.data, cfg.seq_len, 0, split=data["train_split"]).take(1)  # too short: now
    if cfg.steps < cfg.warmup and dist.rank == 0:
        echo(
            f"normswap study: warning: --steps {cfg.steps} is below --warmup {cfg.warmup}: the rate never reaches "
            f"its peak {cfg.lr:g} and never decays (the schedule is all warmup)"
        )
    baselines = baseline_losses(source, cfg, data["train_split"], data["eval_set"]) if dist.rank == 0 else {}
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
    done = _agree(plan.dist, [plan.main and plan.study.read_unit(unit_key(*k)) is not None for k in keys])
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
        _report_diverged(plan, units, seed, m, echo)


def _report_diverged(plan: Plan, units: dict, seed: int, m: float, echo) -> None:
    for (arm, s, mm), rec in units.items():
        if plan.main and s == seed and mm == m and rec.get("status") == "diverged":
            nf = rec["nonfinite"]
            echo(
                f"normswap study: arm {arm} (seed {seed + 1}, lr ×{m:g}) stopped at step {nf['step']}: "
                f"{nf['what']} is {nf['value']}; the other arms went on"
            )


def _open_questions(plan: Plan, trained: Trained, before: int) -> list[dict]:
    """The claims' rows, and the instrument check's arms still undecided (as open rows): what more
    seeds could decide, from the seeds before ``before`` (a resumed run decides as the first did,
    whatever of seed ``before`` it had finished). In worker processes speed is the timing phase's,
    which seeds do not change."""
    units = {k: u for k, u in trained.units.items() if k[1] < before}
    analysis = analyse(plan.cfg, units, plan.arms, plan.baselines, None, kernel_setup=plan.kernel_setup,
                       cpus=_cpus())  # fmt: skip
    rows = [r for r in analysis["claims"] if plan.workers == 1 or r["claim"] != claims_mod.THROUGHPUT]
    for arm, r in ((analysis.get("instrument_check") or {}).get("arms") or {}).items():
        if r["finding"] == "undecided":
            rows.append({"claim": f"instrument check: {r['role']}", "arm": arm, "verdict": claims_mod.NOT_MEASURABLE,
                         "open": True})  # fmt: skip
    return rows


def _next_seed(plan: Plan, trained: Trained, seed: int, per_seed: list, echo) -> list[str]:
    """Beyond --seeds: the arms seed ``seed`` trains (none: it does not run), decided by process 0
    from the verdicts so far. Only the baseline and the arms with a verdict still open: a decided
    arm's interval needs no more seeds, and its units would only cost the open ones their budget."""
    rows = _open_questions(plan, trained, seed) if plan.main else []
    open_arms = {r.get("arm") for r in claims_mod.open_rows(rows)}
    wanted = [a for a in plan.arms if a == BASELINE or a in open_arms] if plan.main else list(plan.arms)
    # per_seed holds whole seeds' seconds: a seed of fewer arms takes fewer rounds of the workers
    share = _rounds(plan, len(wanted)) / _rounds(plan, len(plan.arms))
    estimate = [x * share for x in per_seed]
    go, why = seed_decision(plan.cfg, seed, rows, trained.spent, estimate) if plan.main else (True, "")
    flags = _agree(plan.dist, [go, *(a in wanted for a in plan.arms)])
    go, wanted = flags[0], [a for a, w in zip(plan.arms, flags[1:]) if w]
    if plan.main:
        also = f" (training {', '.join(wanted)})" if go and len(wanted) < len(plan.arms) else ""
        echo(f"normswap study: {'seed ' + str(seed + 1) + ': ' if go else 'stopping: '}{why}{also}")
    if not go:
        trained.stop_reason = why
        return []
    return wanted


def _rounds(plan: Plan, units: int) -> int:
    """Rounds of the worker processes ``units`` units take (each worker trains one at a time)."""
    return max(1, math.ceil(units / max(1, plan.workers)))


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
            arms = _next_seed(plan, trained, seed, per_seed, echo)
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
            whole = _rounds(plan, len(plan.arms) * len(seeds) * len(trained.mults)) / _rounds(plan, len(todo))
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
        low, high = _agree(plan.dist, [new is not None and new < min(mults), new is not None and new > max(mults)])
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
                agree=lambda flags: _agree(dist, flags),
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


def decide(plan: Plan, trained: Trained, speed_record: dict | None, loads: list) -> dict:
    """Stage 4: the kernels' accuracy, the stability summary, the comparisons and the verdicts."""
    from normswap.study import precision as kernel_acc

    cfg, arms, units = plan.cfg, plan.arms, trained.units
    dev = "cpu" if plan.dist.device.type != "cuda" else plan.dist.device
    kinds = {a: kernel_acc.arm_kind(a) for a in arms}
    precision = kernel_acc.kernel_accuracy(dev, kernel_acc.kernels_for(list(units.values()), cfg.kernels, kinds))
    stability, stability_sweep = None, None
    if trained.stab_units is not None:
        from normswap.study import stability as stab

        stab_seeds = list(range(cfg.seeds))
        stability = stab.summarize(trained.stab_units, arms, stab_seeds, cfg)
        stability_sweep = stab.sweep_record(trained.stab_units, arms, stab_seeds, cfg, BASELINE)
    analysis = analyse(
        cfg,
        units,
        arms,
        plan.baselines,
        precision,
        kernel_setup=plan.kernel_setup,
        loads=loads,
        cpus=_cpus(),
        stability_sweep=stability_sweep,
        mults=trained.mults,
        from_scratch=plan.source.from_scratch,
        speed_phase=speed_record,
    )
    return dict(analysis, precision=precision, stability=stability, stability_sweep=stability_sweep)


def run_study(cfg: StudyConfig, *, given: set[str] | None = None, hooks: Hooks | None = None, echo=None) -> dict:
    """Run (or resume) the study of ``cfg`` in ``cfg.out``; return results.json's content.

    plan (every refusal before DIR changes) → train units (seeds in worker processes) → measure
    speed (a protected timing phase) → decide (comparisons, verdicts) → write (results, report)."""
    echo = echo or (lambda msg: print(msg, file=sys.stderr))
    hooks = hooks or Hooks()
    clock = {"wall0": time.perf_counter(), "load_start": _load_average()}
    plan = plan_study(cfg, given, hooks, echo)
    trained = train_units(plan, hooks, echo)
    if not plan.main:
        return {}
    speed_record = speed_phase.measure(plan, echo) if plan.cfg.speed_seconds > 0 else None
    loads = _loads(clock["load_start"], trained.units)
    analysis = decide(plan, trained, speed_record, loads)
    return write_results(plan, trained, analysis, speed_record, clock)


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
            "rule": "disjoint blocks at an even stride over the validation split (study/heldout_blocks.py)",
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
        "statistics": res.stats.METHOD,
        "cpus": _cpus(),
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
    from normswap.study import bytes_model
    from normswap.study import power as power_mod

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
            "load_average_end": _load_average(),
        },
    }
    results = _finite(results)
    from normswap.publish import atomic_write_json

    atomic_write_json(plan.study.results_file, results)
    from normswap.study.study_report import write_report

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


def baseline_losses(source, cfg: StudyConfig, train_split: str, eval_set) -> dict:
    """The count models' held-out losses (study/baselines.py) on the tokens a seed's arms read."""
    from normswap.study.baselines import ngram_losses, training_blocks

    train = training_blocks(source.tokenizer, cfg.data, cfg.seq_len, cfg.steps * cfg.batch_size, train_split)
    vocab = int(getattr(source.config, "vocab_size", 0) or len(source.tokenizer))
    return ngram_losses(train, eval_set, vocab)


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
