"""Training the study's units: one (seed, rate) group of arms in this process, or units spread over
worker processes (``--workers``), each unit written to DIR the moment it ends.

A unit is one arm × seed × rate. Nothing an arm computes depends on the arms beside it
(interleaved.py), so a unit trained alone in a worker computes what it would inside its whole group;
what a worker does not give is timing: its steps ran beside other processes, never paired with
the baseline's, so a worker's unit keeps no timed steps (``timing_paired: false``) and speed comes
from the separate timing phase (speed_phase.py).

Workers are spawned (a fresh interpreter each: no fork of a process holding threads), one torch
thread each; they receive the options and a unit key, rebuild MODEL, the data and the held-out
blocks from the options, and write the unit file themselves. Nothing travels back but the key:
the parent reads the unit from DIR like a resumed study does (study_dir.py: JSON, bounded, no
link followed).
"""

from __future__ import annotations

import dataclasses

import torch

from normswap.study.persistence.study_dir import StudyDir, unit_key
from normswap.study.training import migration
from normswap.study.training.interleaved import Dist, Group, Hooks


@dataclasses.dataclass
class Trainer:
    """What every unit of one study shares: options, MODEL, data, held-out blocks, kernel choice."""

    cfg: object
    source: object
    study: StudyDir
    dist: Dist
    train_split: object
    eval_set: torch.Tensor
    rms_impl: str | None
    held_out: dict | None = None  # the migration rule's validation/test blocks (an lr sweep only)
    main: bool = True
    blocks: torch.Tensor | None = None  # the packed training split, made on first use

    def stream_for(self, data_seed: int):
        """A data-order seed -> a fresh sampler of its batches (sampler.py): what ``Group.run`` reads.
        Fresh per call, so every unit of that seed reads the same batches whatever ran before."""
        from normswap.study.training.sampler import BlockSampler, training_blocks_all

        if self.blocks is None:
            self.blocks = training_blocks_all(self.source.tokenizer, self.cfg.data, self.cfg.seq_len, self.train_split)
        return BlockSampler(self.blocks, data_seed)

    def lm_eval(self, finished) -> None:
        """lm-eval on every finished arm of every seed (paired by seed in results.py)."""
        from normswap.evaluate.lm_eval_adapter import run_tasks, unavailable

        tasks = self.cfg.lm_eval_task_list()
        if not tasks or not self.main or unavailable() is not None:  # skipped: the plan's notes say why
            return
        from normswap.finetune.step import precision_for
        from normswap.model_facts import context_length

        cfg = self.cfg
        # the model as it trained: under bf16/fp16 its norms compute in that dtype, inside autocast
        low = None if cfg.precision == "fp32" else precision_for(cfg.precision, self.dist.device).dtype
        for arm in finished:
            arm.record["lm_eval"] = run_tasks(
                arm.model,
                self.source.tokenizer,
                tasks,
                batch_size=16,
                max_length=context_length(self.source.config),
                limit=cfg.lm_eval_limit or None,
                device=self.dist.device,
                log_path=self.study.out / "lm_eval.log",
                mixed_precision=low,
            )

    def group(self, arms: list[str], seed: int, m: float, hooks: Hooks, *, on_step=None, save=None) -> Group:
        """Train ``arms`` of (seed, m) together; ``save(record)`` as each ends (diverged ones at once)."""
        group = Group(self.source, self.cfg, arms, seed, m, self.dist, hooks, rms_impl=self.rms_impl)
        records = group.run(self.stream_for, self.eval_set, on_step=on_step, on_arm_done=save, after_arms=self.lm_eval)
        if self.held_out is not None:  # the migration rule's per-block losses (migration.py)
            migration.add_block_losses(group.arms, self.held_out, self.cfg.precision, self.dist.device)
        for record in records:
            if record["status"] == "finished" and save is not None:
                save(record)
        return group


# ---------------------------------------------------------------------------- worker processes
_WORKER: dict = {}


def _worker_init(cfg_fields: dict, rms_impl: str | None, threads: int) -> None:
    """A worker's one-time setup: its thread count, then MODEL, data and held-out blocks rebuilt."""
    from normswap.processes import child_started

    child_started()  # ends with the study, whatever ends it
    torch.set_num_threads(max(1, threads))
    from normswap.study.config import StudyConfig
    from normswap.study.inputs import open_study_source, study_data

    cfg = StudyConfig(**cfg_fields)
    source = open_study_source(cfg)
    data = study_data(cfg, source)
    _WORKER["trainer"] = Trainer(
        cfg,
        source,
        StudyDir(cfg.out),
        Dist(torch.device("cpu")),
        data["train_split"],
        data["eval_set"],
        rms_impl,
        held_out=data["held_out"],
    )


def _worker_unit(key: tuple[str, int, float]) -> str:
    """Train one unit in this worker and write it to DIR; return its key."""
    trainer: Trainer = _WORKER["trainer"]
    arm, seed, m = key

    def save(record):
        record["timed_steps"] = []  # not paired with the baseline's steps: no throughput sample
        record["timing_paired"] = False
        trainer.study.write_unit(unit_key(arm, seed, m), record)

    trainer.group([arm], seed, m, Hooks(), save=save)
    return unit_key(arm, seed, m)


def run_in_workers(trainer: Trainer, keys: list, workers: int, echo, on_done) -> None:
    """Train ``keys`` over ``workers`` spawned processes; ``on_done(key, record)`` as each unit lands."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor, as_completed

    cfg_fields = {f.name: getattr(trainer.cfg, f.name) for f in dataclasses.fields(trainer.cfg)}
    t0 = time.perf_counter()
    with ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_init,
        initargs=(cfg_fields, trainer.rms_impl, trainer.cfg.threads or 1),
    ) as pool:
        futures = {pool.submit(_worker_unit, k): k for k in keys}
        try:
            for n, fut in enumerate(as_completed(futures), 1):
                key = futures[fut]
                fut.result()
                record = trainer.study.read_unit(unit_key(*key))
                on_done(key, record)
                loss = (record or {}).get("final_eval_loss")
                echo(
                    f"study: unit {unit_key(*key)} {'finished' if loss is not None else 'ended'}"
                    + (f", final held-out loss {loss:.3f}" if loss is not None else "")
                    + f"  ({n}/{len(keys)} units of this round, {time.perf_counter() - t0:.0f} s)"
                )
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
