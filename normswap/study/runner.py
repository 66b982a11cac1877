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
import sys
import time

import torch

from normswap.devices import resolve_device
from normswap.errors import NormswapError
from normswap.study import claims as claims_mod
from normswap.study import kernels as study_kernels
from normswap.study import measure, migration, speed
from normswap.study import results as res
from normswap.study.arms import build_arm, check_arms, check_replaceable, default_arms, open_source
from normswap.study.config import BASELINE, CONTROL, TRAINED_ONLY, StudyConfig, flag, option_errors
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


def run_study(cfg: StudyConfig, *, given: set[str] | None = None, hooks: Hooks | None = None, echo=None) -> dict:
    """Run (or resume) the study of ``cfg`` in ``cfg.out``; return results.json's content."""
    from normswap.data import finetune_splits
    from normswap.finetune.data import TrainStream, eval_blocks

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
    mults = cfg.multipliers()
    ref_mult = 1.0 if 1.0 in mults else mults[0]
    train_split, eval_spec, eval_split = finetune_splits(cfg.data)
    eval_set = eval_blocks(source.tokenizer, eval_spec, cfg.seq_len, cfg.eval_tokens, split=eval_split)
    TrainStream(source.tokenizer, cfg.data, cfg.seq_len, 0, split=train_split).take(
        1
    )  # fails now if the data is too short

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
                {"config": cfg.recorded(), "arms": arms, "status": "running", "resumes": 0, "kernels": kernel_setup},
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

    # ---- the groups ----
    keys = [(arm, seed, m) for seed in range(cfg.seeds) for m in mults for arm in arms]
    done_flags = _agree(dist, [main and study.read_unit(unit_key(*k)) is not None for k in keys])
    units = {k: study.read_unit(unit_key(*k)) for k, d in zip(keys, done_flags) if d} if main else {}
    todo = [k for k, d in zip(keys, done_flags) if not d]
    if main and len(todo) < len(keys):
        echo(
            f"normswap study: resuming {cfg.out}: {len(keys) - len(todo)} of {len(keys)} units finished, "
            f"{len(todo)} to run"
        )
    show_bar = cfg.progress if cfg.progress is not None else sys.stderr.isatty()
    progress = Progress(len(todo) * cfg.steps, bool(show_bar) and main, echo if main else (lambda m: None))
    tokens_per_step = cfg.batch_size * cfg.seq_len
    # the migration rule's held-out blocks: validation and a disjoint test set (migration.py)
    held_out = migration.blocks(source.tokenizer, eval_spec, cfg, eval_set) if len(mults) > 1 else None

    def run_group(seed: int, m: float, group_arms: list[str]) -> None:
        group = Group(source, cfg, group_arms, seed, m, dist, hooks, rms_impl=kernel_setup["rms_impl"])
        stream = TrainStream(source.tokenizer, cfg.data, cfg.seq_len, seed, split=train_split)
        where = f"seed {seed + 1}/{cfg.seeds}" + (f" lr ×{m:g}" if len(mults) > 1 else "")

        def save(record):
            units[(record["arm"], seed, m)] = record
            if main:
                study.write_unit(unit_key(record["arm"], seed, m), record)

        def on_step(t, arms_now):
            progress.step(
                sum(1 for a in arms_now if a.record["steps_done"] == t),
                f"{where} step {t}/{cfg.steps}",
                arms_now,
            )

        records = group.run(stream, eval_set, on_step=on_step, on_arm_done=save)
        if held_out is not None:
            migration.add_block_losses(group.arms, held_out, cfg.precision, dist.device)
        for record in records:
            if record["status"] == "finished":
                save(record)
        if main:
            for record in group.arms:
                if record.record["status"] == "diverged":
                    nf = record.record["nonfinite"]
                    echo(
                        f"normswap study: arm {record.name} (seed {seed}, lr ×{m:g}) "
                        f"stopped at step {nf['step']}: "
                        f"{nf['what']} is {nf['value']}; the other arms went on"
                    )

    try:
        for seed in range(cfg.seeds):
            for m in mults:
                group_arms = [a for a in arms if (a, seed, m) in todo]
                if group_arms:
                    run_group(seed, m, group_arms)
        # a best rate at the sweep's edge: one more rate past it (at most MAX_EXTENSIONS), decided by process 0
        for _ in range(migration.MAX_EXTENSIONS if held_out is not None else 0):
            new = migration.extension(units, [a for a in arms if a != CONTROL], mults, list(range(cfg.seeds)))
            low, high = _agree(dist, [new is not None and new < min(mults), new is not None and new > max(mults)])
            if not (low or high):
                break
            new = mults[0] ** 2 / mults[1] if low else mults[-1] ** 2 / mults[-2]
            echo(f"normswap study: a best rate sits at the sweep's edge: adding lr ×{new:g}")
            mults = sorted(mults + [new])
            for seed in range(cfg.seeds):
                keys += [(arm, seed, new) for arm in arms]
                done = _agree(dist, [main and study.read_unit(unit_key(a, seed, new)) is not None for a in arms])
                for arm, d in zip(arms, done):
                    if d and main:
                        units[(arm, seed, new)] = study.read_unit(unit_key(arm, seed, new))
                group_arms = [a for a, d in zip(arms, done) if not d]
                if group_arms:
                    run_group(seed, new, group_arms)
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
                make_stream=lambda seed: TrainStream(source.tokenizer, cfg.data, cfg.seq_len, seed, split=train_split),
                main=main,
                echo=echo,
            )
    finally:
        progress.close()
    if not main:
        return {}

    # ---- analysis, precision table, results.json ----
    from normswap.study import precision as kernel_acc

    unit_list = list(units.values())
    precision = kernel_acc.kernel_accuracy(
        "cpu" if dist.device.type != "cuda" else dist.device,
        kernel_acc.kernels_for(unit_list, cfg.kernels, {a: kernel_acc.arm_kind(a) for a in arms}),
    )
    comparisons = {a: res.compare(units, a, BASELINE, ref_mult) for a in arms if a != BASELINE}
    base_units = [u for (a, _, m), u in units.items() if a == BASELINE and m == ref_mult]
    norm_share = speed.add_amdahl(comparisons, base_units, kernel_setup)
    loads = [load_start, _load_average()] + [v for u in units.values() for v in (u.get("load") or [])]
    loads = [v[0] if isinstance(v, list) else v for v in loads if v is not None]
    cpus = _cpus()
    control_boot = (comparisons.get(CONTROL) or {}).get("throughput_ratio_bootstrap")
    for c in comparisons.values():
        c["throughput_gates"] = speed.gates(control_boot, c.get("amdahl_bound"), loads, cpus)
    stability, stability_sweep = None, None
    if stab_units is not None:
        seeds = list(range(cfg.seeds))
        stability = stab.summarize(stab_units, arms, seeds, cfg)
        stability_sweep = stab.sweep_record(stab_units, arms, seeds, cfg, BASELINE)
    sw = res.sweep(units, arms, mults, BASELINE)
    rules = {}
    if sw is not None:
        for a in arms:
            if a not in (BASELINE, CONTROL):
                rules[a] = migration.analyse(
                    units, a, BASELINE, mults, list(range(cfg.seeds)), ref_mult, from_scratch=source.from_scratch
                )
    verdicts = claims_mod.judge(
        comparisons, rules, precision, cfg.precision, CONTROL, loads=loads, cpus=cpus, stability_sweep=stability_sweep
    )
    n_params = sum(p.numel() for p in source.start(0).parameters())  # tied weights counted once
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
            "seeds_list": list(range(cfg.seeds)),
            "multipliers": mults,
            "reference_multiplier": ref_mult,
            "tokens_per_step": tokens_per_step,
            "eval_tokens_used": int(eval_set.numel()),
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
        "units": [res.summarize_unit(units[k], tokens_per_step) for k in keys if k in units],
        "comparisons": comparisons,
        "null_control": claims_mod.null_control(comparisons.get(CONTROL)),
        "baseline_norm_share": norm_share,
        "lr_sweep": sw,
        "migration_rule": rules or None,
        "precision": precision,
        "stability": stability,
        "stability_sweep": stability_sweep,
        "claims": verdicts,
        "timing": {
            "wall_seconds": time.perf_counter() - wall0,
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


def _finite(obj):
    """JSON has no inf/nan: they become strings ("inf"), so results.json stays standard JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


__all__ = ["Hooks", "run_study"]
