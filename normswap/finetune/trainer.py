"""The warmup fine-tune that heals a converted model (or trains any causal LM a little further).

``run_finetune`` reads top to bottom, one named step per line: options (and the processes that
run them), data, model and objective, OUT, resume, the loop (``_train``), the summary, the final
model. One code path for one process, DDP and FSDP: the model and optimizer go through
🤗 accelerate, everything else (data sharding, schedule, logging, checkpoints) is ours so that its
semantics do not depend on the launcher:

* ``batch_size`` is the *global* batch (sequences per optimizer step). Each optimizer step reads
  ``batch_size`` blocks from one deterministic stream; with W processes and A accumulation steps,
  process r takes rows ``[r·m, (r+1)·m)`` of every micro-batch of ``batch_size/A`` rows
  (m = batch_size/(A·W)). The averaged gradient is therefore the one-process gradient of the same
  global batch, and the loss curve matches a one-process run up to float summation order.
* Only process 0 writes files. Every log row carries ``world_size`` and each process' checksum of
  the rows it trained on (``data_fingerprint``), which shows that the processes split the batch.
* Checkpoints (state.py) are written to a temporary directory and renamed; ``--resume`` restores
  the newest intact one and replays the same trajectory (bitwise on CPU).
* A non-finite loss or gradient norm stops the run before the optimizer step; a checkpoint whose
  weights are not sane is never written; either way the run keeps its last good checkpoint and
  exits non-zero (``TrainingDiverged``). SIGINT/SIGTERM finish the current step, save a checkpoint
  and stop (``TrainingInterrupted``, exit 130).

Faults are injected by tests through ``Hooks`` (a parameter, never the environment; tests reach it
as ``normswap.testing.FinetuneHooks``); the recipe runner's progress lines use its ``after_step``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from normswap.data import finetune_splits
from normswap.errors import NormswapError
from normswap.finetune import state as ckpt
from normswap.finetune.batches import TrainStream, corpus_header, eval_blocks, fingerprint, training_data_record
from normswap.finetune.centring import Centring, keep_centred
from normswap.finetune.config import LOG_FILE, FinetuneConfig, default_eval_tokens, flag, option_errors, options
from normswap.finetune.encoder_objectives import Encoder
from normswap.finetune.objectives import CausalLM
from normswap.finetune.run_dir import RunDir, check_new_out, check_out_overlap
from normswap.finetune.step import Schedule, TrainStep, param_groups
from normswap.model_facts import context_length, norm_modules
from normswap.private_dirs import NotPrivate


class TrainingDiverged(NormswapError):
    """The loss, the gradient or the weights blew up; the run stopped and kept its last good checkpoint."""

    exit_code = 1


class TrainingInterrupted(NormswapError):
    """SIGINT/SIGTERM: the run saved a checkpoint and stopped; ``--resume`` continues it."""

    exit_code = 130


@dataclass
class Hooks:
    """Fault injection for tests: ``loss(step, loss) -> loss`` may replace a step's loss (e.g. by
    NaN); ``after_step(step)`` runs after each completed step (e.g. a delay so a test can kill)."""

    loss: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    after_step: Callable[[int], None] | None = None
    # called once before the first step with (the step it starts after, the last step): what a
    # progress line counts from and to, a resumed run's real target included
    started: Callable[[int, int], None] | None = None


@dataclass
class StepRecord:
    """What one optimizer step measured, agreed across processes."""

    loss: float
    parts: dict[str, float]  # the objective's named terms (e.g. lm_loss, distill_loss)
    grad_norm: float
    fingerprints: list[int]  # per process: checksum of the rows it trained on
    stop_requested: bool  # some process received SIGINT/SIGTERM during the step

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def objective_for(config):
    """The objective class for a model of this config: its ``task`` says how to load the model,
    its ``build(cfg, model, teacher, autocast=)`` makes the objective."""
    from normswap.checkpoint.load import is_causal_lm

    return CausalLM if is_causal_lm(config) else Encoder


# ---------------------------------------------------------------------------------- options
def resolve_options(cfg: FinetuneConfig, run: RunDir, given: set[str] | None) -> tuple[FinetuneConfig, dict]:
    """Validate ``cfg``; for ``--resume`` take the options recorded in OUT, checking the ones given
    (``given``: names typed on the command line; None: every non-None field, the Python API).
    Returns the options in force and the overrides ({name: [recorded, new]}) of a resume."""
    problems = [f"{flag(name)} {why}" for name, why in option_errors(dataclasses.asdict(cfg))]
    if problems:
        raise NormswapError("; ".join(problems))
    if not cfg.resume:
        check_new_out(cfg)
        return cfg, {}
    if not run.out.exists():
        raise NormswapError(f"cannot resume: {cfg.out} does not exist (start the run without --resume)")
    recorded_run = run.read_run()
    if recorded_run is None:
        raise NormswapError(
            f"cannot resume: {cfg.out} is not a normswap finetune run (no {run.run_file.name}); choose another OUT"
        )
    run.check()  # a link or another user's directory in OUT is refused before anything loads
    recorded = recorded_run["config"]
    # the record is a file: its options meet the same declared bounds as the command line's, before
    # any is compared or used (a stored steps: -3 published a model; batch_size: "8" a TypeError)
    stored = {f.name: recorded[f.name] for f in options() if isinstance(recorded, dict) and f.name in recorded}
    bad = [f"{name} {why}" for name, why in option_errors(stored)]
    if not isinstance(recorded, dict) or bad:
        raise NormswapError(
            f"cannot resume {cfg.out}: the options recorded in {run.run_file.name} are not valid: "
            + ("; ".join(bad) if bad else "no options object")
            + "; start the run again with --force"
        )
    mine = dataclasses.asdict(cfg)
    if given is None:
        given = {k for k, v in mine.items() if v is not None}
    merged, overrides, mismatches = dict(mine), {}, []
    for f in options():
        rule, name = f.metadata["resume"], f.name
        if rule == "free" or name not in recorded:
            continue
        theirs, value = recorded[name], mine[name]
        merged[name] = theirs
        if name not in given or value is None or value == theirs:
            continue
        if rule == "extend" and value > theirs:
            merged[name], overrides[name] = value, [theirs, value]
        elif rule == "lower" and value < theirs:
            merged[name], overrides[name] = value, [theirs, value]
        else:
            may = {"extend": " (it may only be raised)", "lower": " (it may only be lowered)"}.get(rule, "")
            mismatches.append(f"{flag(name)} is {value!r} but the run used {theirs!r}{may}")
    if mismatches:
        raise NormswapError(
            f"cannot resume {cfg.out}: "
            + "; ".join(mismatches)
            + f" (--resume takes the options recorded in {run.run_file.name}: give none, or the same)"
        )
    if recorded_run.get("status") == "finished" and "steps" not in overrides:
        done = recorded.get("steps")
        raise NormswapError(
            f"{cfg.out} already holds a finished fine-tune of {done} steps: "
            f"`normswap finetune {cfg.out} --resume --steps N` (N > {done}) trains it further, "
            "--force starts again"
        )
    return FinetuneConfig(**merged), overrides


def _model_id(spec: str) -> str:
    """A local model as an absolute path (so a resume from another directory finds it); else the id."""
    from normswap.checkpoint.load import is_local, resolve

    resolved = resolve(spec)
    return str(Path(resolved).resolve()) if is_local(resolved) else spec


# ---------------------------------------------------------------------------------- model helpers
def _select_trainable(model, trainable: str) -> int:
    """Freeze what is not trained; return the number of trainable parameters.

    ``norms`` trains the parameters of the normalisation layers only: for a converted model, the
    new RMSNorm γ (and β where convert kept it; convert with ``--gamma keep``); for an unconverted
    model, its LayerNorms' γ and β. Folding (exact conversion, or approx with γ folded) leaves the
    RMSNorms without γ: we refuse rather than silently add γ = 1 parameters that the converted
    checkpoint format (and its modeling file) would not know about. We refuse as soon as one norm
    was folded: an exact conversion keeps only the final norm's γ (for a tied head), and training
    that one norm alone is not what "norms" promises.
    """
    if trainable == "all":
        for p in model.parameters():
            p.requires_grad_(True)
        return sum(p.numel() for p in model.parameters())
    norms = norm_modules(model)
    folded = [n for n, m in norms if type(m).__name__ == "RMSNorm" and getattr(m, "weight", None) is None]
    if folded:
        raise NormswapError(
            f"--trainable norms: {len(folded)} of the model's {len(norms)} norms have no γ "
            "(conversion folded it into the next "
            f"layers, e.g. {folded[0]}); convert with --gamma keep to train the norms alone, or use --trainable all"
        )
    norm_params = {id(p) for _, m in norms for p in m.parameters(recurse=False)}
    if not norm_params:
        raise NormswapError("--trainable norms: the model's norm layers have no parameters; use --trainable all")
    n = 0
    for p in model.parameters():
        train = id(p) in norm_params
        p.requires_grad_(train)
        n += p.numel() if train else 0
    return n


def _source_dtype(config):
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop checks it (agreed across processes) after each step."""

    def __init__(self):
        self.signal = None
        self._old = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:
            raise KeyboardInterrupt  # a second Ctrl-C or SIGTERM means "now"
        self.signal = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


def _make_accelerator(cfg: FinetuneConfig):
    from accelerate import Accelerator

    from normswap.devices import resolve_device

    device = resolve_device(cfg.device)
    on_cpu = not device.startswith("cuda")
    if not on_cpu and ":" in device and "LOCAL_RANK" not in os.environ:
        torch.cuda.set_device(int(device.split(":", 1)[1]))
    # Under `accelerate launch` the launcher's config (e.g. FSDP's mixed precision) decides.
    mixed = (
        None
        if "ACCELERATE_MIXED_PRECISION" in os.environ
        else ("bf16" if (not on_cpu and cfg.dtype == "auto") else "no")
    )
    # cpu=True is what makes a CPU-only multi-process launch (torchrun, gloo) see its real world
    # size; without it each rank believes it is alone.
    return Accelerator(cpu=on_cpu, mixed_precision=mixed)


def _perplexity(objective, loss: float | None) -> float | None:
    """exp(held-out loss) where that loss is a cross-entropy (not for a distillation distance)."""
    return math.exp(min(loss, 700)) if loss is not None and getattr(objective, "reports_perplexity", True) else None


# ---------------------------------------------------------------------------------- the trainer
@dataclass
class Trainer:
    """The pieces one optimizer step needs, and the step itself."""

    cfg: FinetuneConfig
    accelerator: object
    model: torch.nn.Module
    optimizer: object
    objective: object
    stream: TrainStream
    run: RunDir
    start_weights: ckpt.WeightScale
    hooks: Hooks = field(default_factory=Hooks)

    def __post_init__(self):
        acc = self.accelerator
        self.rank, self.world, self.main = acc.process_index, acc.num_processes, acc.is_main_process
        self.micro = self.cfg.batch_size // (self.cfg.grad_accum * self.world)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # the step shared with the study (finetune/step.py); accelerate moves the gradients between
        # processes in its backward and clip, and autocasts inside the prepared model
        self.step = TrainStep(
            self.model,
            self.optimizer,
            Schedule(
                self.cfg.lr,
                self.cfg.steps,
                self.cfg.warmup_steps,
                kind=self.cfg.schedule,
                min_ratio=self.cfg.min_lr_ratio,
            ),
            clip_grad=self.cfg.clip_grad,
            backward_fn=acc.backward,
            clip_fn=acc.clip_grad_norm_,
            params=self.params,
        )

    def set_lr(self, step: int) -> float:
        return self.step.begin(step)

    def train_step(self, step: int, stop: _StopFlag) -> StepRecord:
        """Forward and backward over the global batch (gradients accumulated, not yet applied)."""
        acc, A, micro = self.accelerator, self.cfg.grad_accum, self.micro
        # sums stay on the device until the step ends: no synchronisation per micro-batch
        loss_sum, part_sums, prints = 0.0, {}, []
        for a in range(A):
            rows = self.stream.take(self.cfg.batch_size // A)[self.rank * micro : (self.rank + 1) * micro]
            prints.append(fingerprint(rows))
            sync = contextlib.nullcontext() if a == A - 1 else acc.no_sync(self.model)
            with sync:
                out = self.step.loss(lambda rows=rows: self.objective.loss(self.model, rows.to(acc.device)))
                total = self.hooks.loss(step, out.total) if self.hooks.loss else out.total
                self.step.backward(total, A)
            loss_sum = loss_sum + total.detach().double() / A
            for name, v in out.parts.items():
                part_sums[name] = part_sums.get(name, 0.0) + v.detach().double() / A
        grad_norm = self.step.clip()
        names = sorted(part_sums)
        stop_requested = stop.signal is not None
        measured = torch.stack(
            [
                loss_sum,
                *(part_sums[n] for n in names),
                torch.tensor(float(stop_requested), dtype=torch.float64, device=acc.device),
            ]
        )
        fingerprints = [sum(prints) % 2_147_483_647]
        if self.world > 1:  # average the losses, agree on stopping, collect every process' checksum
            measured = acc.reduce(measured, reduction="sum")
            measured[:-1] /= self.world
            fingerprints = acc.gather(torch.tensor(fingerprints, device=acc.device)).tolist()
        values = measured.tolist()
        return StepRecord(values[0], dict(zip(names, values[1:-1])), grad_norm, fingerprints, values[-1] > 0)

    def heldout(self, blocks: torch.Tensor) -> float:
        return self.objective.heldout_loss(
            self.model, blocks, micro_batch=max(self.micro, 1), accelerator=self.accelerator
        )

    def any_process(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (every process calls it: decisions stay in step)."""
        if self.world == 1:
            return flag
        return (
            float(self.accelerator.reduce(torch.tensor([float(flag)], device=self.accelerator.device), reduction="sum"))
            > 0
        )

    def last_good(self) -> str:
        cks = self.run.checkpoints()
        return str(cks[-1][1]) if cks else "none (no checkpoint was written yet)"

    def diverged(self, what: str, step: int, consequence: str) -> TrainingDiverged:
        cks = self.run.checkpoints()
        advice = (
            "resume from it with a lower learning rate: "
            f"normswap finetune {self.cfg.out} --resume --lr {self.cfg.lr / 10:g}"
            if cks
            else f"run again with a lower --lr (e.g. {self.cfg.lr / 10:g}) and --force"
        )
        return TrainingDiverged(
            f"{what} at step {step}: {consequence}; last good checkpoint: {self.last_good()}; {advice}"
        )

    def save_checkpoint(self, step: int) -> Path:
        """Write a checkpoint of the state after ``step``; refuse (TrainingDiverged) weights that are
        not sane rather than keep them as a point to resume from."""
        acc = self.accelerator
        tmp = self.run.staging_checkpoint(step) if self.main else None
        acc.wait_for_everyone()
        tmp = tmp or self.run.checkpoints_dir / f".tmp-step-{step}"
        weights = ckpt.full_weights(self.model)
        problem = self.start_weights.problem(weights) if self.main else None
        if self.any_process(problem is not None):
            if self.main:
                self.run.drop_checkpoint(tmp)
            raise self.diverged(f"the weights are not sane ({problem or 'see process 0'})", step, "not checkpointed")
        trainer_state = {
            "step": step,
            "data_position": self.stream.position,
            "epoch": self.stream.epoch,
            "world_size": self.world,
        }
        with self.run.checkpoint_at(tmp.name) as dir_fd:  # written through the handle: no link followed
            ckpt.save(
                dir_fd,
                tmp,
                model=self.model,
                optimizer=self.optimizer,
                weights=weights,
                trainer_state=trainer_state,
                rank=self.rank,
                main=self.main,
            )
        acc.wait_for_everyone()
        final = self.run.publish_checkpoint(tmp, step, self.cfg.keep_checkpoints) if self.main else None
        acc.wait_for_everyone()
        return final or self.run.checkpoints_dir / f"step-{step}"

    def restore(self, echo) -> int:
        """Load the newest intact checkpoint (falling back past broken ones, naming them); return its
        step, or 0 when OUT has no checkpoint yet. Every process takes the same decision."""
        broken = []
        checkpoints = self.run.checkpoints()
        like = ckpt.optimizer_template(self.model, self.optimizer) if checkpoints else None
        for step, path in reversed(checkpoints):
            # read and check every file first, then apply: each stage agreed by all processes
            loaded, error = None, None
            try:
                with self.run.checkpoint_at(path.name) as dir_fd:
                    loaded = ckpt.read(
                        dir_fd, path, rank=self.rank, world=self.world, start=self.start_weights, optimizer_like=like
                    )
            except (ckpt.CheckpointError, NotPrivate) as e:  # a link or a loose directory: skipped, named
                error = str(e)
            except OSError as e:  # e.g. removed or unreadable since it was listed: named like a broken one
                error = f"{path}: {e.strerror or e}"
            if not self.any_process(error is not None):
                try:
                    ckpt.apply(loaded, model=self.model, optimizer=self.optimizer)
                except ckpt.CheckpointError as e:
                    error = str(e)
                if not self.any_process(error is not None):
                    if self.main:
                        for note in broken:
                            echo(f"normswap finetune: skipped the broken checkpoint {note}")
                        echo(f"normswap finetune: resuming from {path} (step {step}/{self.cfg.steps})")
                    self.stream = TrainStream(
                        self.stream.tokenizer,
                        self.cfg.data,
                        self.stream.seq_len,
                        self.cfg.seed,
                        position=int(loaded.trainer_state["data_position"]),
                        split=self.stream.split,
                    )
                    return step
            broken.append(error or f"{path} (a file of another process)")
        if broken:
            raise NormswapError(
                f"cannot resume {self.cfg.out}: no intact checkpoint ({'; '.join(broken)}); use --force to start again"
            )
        if self.main:
            echo(
                f"normswap finetune: {self.cfg.out} has no checkpoint yet: "
                f"resuming from the start (step 0/{self.cfg.steps})"
            )
        return 0


# ---------------------------------------------------------------------------------- the run
def run_finetune(cfg: FinetuneConfig, *, given: set[str] | None = None, hooks: Hooks | None = None, echo=None) -> dict:
    """Fine-tune ``cfg.model`` into ``cfg.out``; return the summary (same on every process).

    ``given``: the option names the user typed (they must match a resumed run's); None means
    every option that is not None. ``hooks``: fault injection for tests (normswap.testing)."""
    echo = echo or (lambda msg: print(msg, file=sys.stderr))
    run = RunDir(cfg.out)
    cfg, overrides, accelerator = _options(cfg, run, given)
    if accelerator.is_main_process:  # at once: reading the data and loading the model take a while
        echo(
            f"normswap finetune: {'resuming ' if cfg.resume else ''}{cfg.model} -> {cfg.out}: "
            "reading the data, then loading the model"
        )
    cfg, job = _prepare(cfg, accelerator, echo)  # everything that can fail on bad input, before OUT is touched
    _start_out(run, cfg, accelerator)
    trainer = _trainer(cfg, accelerator, job, run, hooks or Hooks())
    start_step = _resume(trainer, job, overrides, echo) if cfg.resume else 0
    last_row, initial_eval, wall = _train(trainer, job, start_step)
    summary = _summary(trainer, job, start_step, last_row, initial_eval, wall)
    _write_final(trainer, job, summary)
    return summary


@dataclass
class _Job:
    """What a fine-tune reads, built before OUT is touched: the model, its data and its objective."""

    resolved: str  # the model's resolved spec
    config: object
    tokenizer: object
    train_split: str
    eval_set: torch.Tensor
    param_dtype: torch.dtype
    objective_kind: type
    model: torch.nn.Module
    objective: object
    start_weights: ckpt.WeightScale
    n_trainable: int
    n_params: int
    centring: Centring | None  # an exact conversion kept exact after each optimizer step (centring.py)


def _options(cfg: FinetuneConfig, run: RunDir, given) -> tuple[FinetuneConfig, dict, object]:
    """The options in force (a resume takes the ones recorded in OUT), checked against what is
    read, and the processes that agree to run them."""
    cfg = dataclasses.replace(
        cfg, model=cfg.model and _model_id(cfg.model), distill_from=cfg.distill_from and _model_id(cfg.distill_from)
    )
    cfg, overrides = resolve_options(cfg, run, given)
    check_out_overlap(cfg)  # the CLI checked before taking OUT's lock; the recipe runner and the API come here
    accelerator = _make_accelerator(cfg)
    world = accelerator.num_processes
    if cfg.batch_size % (cfg.grad_accum * world):
        raise NormswapError(
            f"--batch-size {cfg.batch_size} (the global batch) must be divisible by "
            f"processes ({world}) × --grad-accum ({cfg.grad_accum})"
        )
    return cfg, overrides, accelerator


def _prepare(cfg: FinetuneConfig, accelerator, echo) -> tuple[FinetuneConfig, _Job]:
    """Data (sequence length and held-out tokens decided), model, teacher and objective."""
    from accelerate.utils import set_seed

    from normswap.checkpoint.load import load_config, load_model, load_tokenizer, resolve

    resolved = resolve(cfg.model)
    config = load_config(resolved)
    context = context_length(config)
    seq_len = cfg.seq_len or min(context or 512, 512)
    if context is not None and seq_len > context:
        raise NormswapError(f"--seq-len {seq_len} is longer than the model's context ({context})")
    _check_batch_fits(cfg, config, seq_len, accelerator)
    eval_tokens = cfg.eval_tokens or default_eval_tokens(cfg.steps, cfg.batch_size, seq_len)
    cfg = dataclasses.replace(cfg, seq_len=seq_len, eval_tokens=eval_tokens)
    tokenizer = load_tokenizer(resolved)
    train_split, eval_spec, eval_split = finetune_splits(cfg.data, cfg.eval_data)
    eval_set = eval_blocks(tokenizer, eval_spec, seq_len, eval_tokens, split=eval_split)
    if accelerator.is_main_process:  # before the model loads: what the run will read, and how often
        header, _ = corpus_header(
            tokenizer,
            cfg.data,
            train_split,
            int(eval_set.numel()),
            eval_spec,
            eval_split,
            cfg.steps * cfg.batch_size * seq_len,
        )
        for line in header:
            echo(f"normswap finetune: {line}")
        echo("normswap finetune: loading the model")  # the status a log repeats while it loads

    set_seed(cfg.seed + accelerator.process_index)
    param_dtype = {
        "auto": torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float64": torch.float64,
    }[cfg.dtype]
    objective_kind = objective_for(config)
    model = load_model(resolved, dtype=param_dtype, device="cpu", task=objective_kind.task, config=config)
    n_trainable = _select_trainable(model, cfg.trainable)
    centring = keep_centred(model, config, enabled=cfg.keep_centred, distributed_type=accelerator.distributed_type)
    n_params = sum(p.numel() for p in model.parameters())
    start_weights = ckpt.WeightScale.of(ckpt.full_weights(model))
    teacher = None
    if cfg.distill_from:
        teacher = load_model(cfg.distill_from, dtype=param_dtype, device="cpu", task=objective_kind.task)
        teacher.requires_grad_(False)
    objective = objective_kind.build(cfg, model, teacher, autocast=accelerator.autocast)
    if teacher is not None:
        teacher.to(accelerator.device)
    return cfg, _Job(
        resolved,
        config,
        tokenizer,
        train_split,
        eval_set,
        param_dtype,
        objective_kind,
        model,
        objective,
        start_weights,
        n_trainable,
        n_params,
        centring,
    )


def _check_batch_fits(cfg: FinetuneConfig, config, seq_len: int, accelerator) -> None:
    """Refuse, before the data or the model is read, a micro-batch whose logits alone (forward, their
    log-softmax and its gradient, in float32) cannot fit in the memory available: such a step never
    ends, since one allocation can neither finish nor be interrupted (``--batch-size 100000000`` ran
    six minutes, ignored SIGTERM and ended in an allocator abort)."""
    from normswap.checkpoint.sizes import check_fits
    from normswap.devices import available_memory

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    rows = cfg.batch_size // (cfg.grad_accum * accelerator.num_processes)
    need = 3 * 4 * rows * seq_len * max(vocab, 1)
    what = f"one micro-batch's logits ({rows:,} × {seq_len:,} × {vocab:,})"
    try:
        check_fits(need, available_memory(str(accelerator.device)), cfg.model, what)
    except NormswapError as e:
        raise NormswapError(f"{e}: lower --batch-size or --seq-len, or raise --grad-accum") from None


def _start_out(run: RunDir, cfg: FinetuneConfig, accelerator) -> None:
    """OUT fresh (its run file written) or resumed (leftovers of a killed run removed); process 0 writes."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if not cfg.resume:
            run.start(
                {"status": "running", "config": cfg.recorded(), "world_size": accelerator.num_processes, "resumes": []},
                replace=cfg.force,
            )
        run.remove_leftovers()
    accelerator.wait_for_everyone()


def _trainer(cfg: FinetuneConfig, accelerator, job: _Job, run: RunDir, hooks: Hooks) -> Trainer:
    optimizer = torch.optim.AdamW(
        param_groups(job.model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps
    )
    if job.centring is not None:
        optimizer.register_step_post_hook(lambda *_: job.centring())
    model, optimizer = accelerator.prepare(job.model, optimizer)
    stream = TrainStream(job.tokenizer, cfg.data, cfg.seq_len, cfg.seed, split=job.train_split)
    return Trainer(cfg, accelerator, model, optimizer, job.objective, stream, run, job.start_weights, hooks)


def _resume(trainer: Trainer, job: _Job, overrides: dict, echo) -> int:
    """The newest intact checkpoint restored (or a finished run's final model, to train it
    further), the log cut to it, the overrides recorded; its step."""
    run, cfg = trainer.run, trainer.cfg
    finished = run.read_run().get("status") == "finished"
    if finished and not run.checkpoints():
        start_step = _continue_finished(trainer, job, echo)
    else:
        start_step = trainer.restore(echo)
    if trainer.main:
        record = run.read_run()
        record["status"] = "running"
        record["config"] = cfg.recorded()
        record["resumes"] = record.get("resumes", []) + [{"from_step": start_step, "overrides": overrides}]
        run.write_run(record)
        if start_step:
            run.truncate_log(start_step)
        else:
            run.reset_log()
    return start_step


def _continue_finished(trainer: Trainer, job: _Job, echo) -> int:
    """A finished run trained further (``--resume --steps N``) whose checkpoints were dropped at its
    end: its final model in OUT becomes the state at its last step, the data stream continues where
    it stopped, AdamW's moments start afresh, and the schedule is the one of the new --steps (as for
    any --steps raised on resume). That state is checkpointed at once, so a kill from here on
    resumes like any unfinished run."""
    from normswap.checkpoint.load import load_model

    run, cfg = trainer.run, trainer.cfg
    done = int(run.read_run()["config"]["steps"])
    run.check_final_weights()  # the loader follows links (hub snapshots); weights in OUT may not
    final = load_model(str(run.out), dtype=job.param_dtype, device="cpu", task=job.objective_kind.task)
    trainer.accelerator.unwrap_model(trainer.model).load_state_dict(final.state_dict())
    del final
    trainer.stream = TrainStream(
        trainer.stream.tokenizer,
        cfg.data,
        trainer.stream.seq_len,
        cfg.seed,
        position=done * cfg.batch_size,
        split=trainer.stream.split,
    )
    if trainer.main:
        echo(
            f"normswap finetune: training the finished run in {cfg.out} further: from its final model "
            f"(step {done}/{cfg.steps}; optimizer state not kept at the end, so AdamW starts afresh)"
        )
    trainer.save_checkpoint(done)
    return done


def _train(trainer: Trainer, job: _Job, start_step: int) -> tuple[dict | None, float | None, float]:
    """The loop, from ``start_step`` to the last step: (the last step's log row, the held-out loss
    before training, seconds spent)."""
    cfg, run, model, world = trainer.cfg, trainer.run, trainer.model, trainer.world
    trainer.accelerator.wait_for_everyone()  # every process starts from OUT as process 0 left it
    tokens_per_step = cfg.batch_size * cfg.seq_len
    prior_rows = run.rows() if start_step else []
    initial_eval = next((r.get("eval_loss") for r in prior_rows if r.get("step") == 0), None)
    bar = _progress_bar(cfg, start_step) if trainer.main else None
    log = _Log(run if trainer.main else None)
    t_start = time.perf_counter()
    last_row = None
    try:
        if start_step == 0:
            initial_eval = trainer.heldout(job.eval_set)
            log(
                {
                    "step": 0,
                    "loss": None,
                    "lr": 0.0,
                    "grad_norm": None,
                    "tokens_per_second": None,
                    "world_size": world,
                    "eval_loss": initial_eval,
                    "eval_perplexity": _perplexity(job.objective, initial_eval),
                }
            )
        model.train()
        if trainer.hooks.started:
            trainer.hooks.started(start_step, cfg.steps)
        with _StopFlag() as stop:
            for step in range(start_step + 1, cfg.steps + 1):
                t0 = time.perf_counter()
                lr = trainer.set_lr(step)
                rec = trainer.train_step(step, stop)
                if not trainer.step.update(rec.loss, rec.grad_norm).applied:
                    what = f"loss is {rec.loss}" if not math.isfinite(rec.loss) else f"gradient norm is {rec.grad_norm}"
                    raise trainer.diverged(what, step, "stopped before updating the weights")
                dt = time.perf_counter() - t0

                row = {
                    "step": step,
                    "loss": rec.loss,
                    "lr": lr,
                    "grad_norm": rec.grad_norm,
                    "tokens_per_second": tokens_per_step / dt if dt > 0 else None,
                    "world_size": world,
                    "tokens": step * tokens_per_step,
                    "data_fingerprint": rec.fingerprints,
                    "epoch": trainer.stream.epoch,
                    **rec.parts,
                }
                if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
                    ev = trainer.heldout(job.eval_set)
                    row["eval_loss"], row["eval_perplexity"] = ev, _perplexity(job.objective, ev)
                log(row)
                last_row = row
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{rec.loss:.4f}", lr=f"{lr:.2e}")

                saved = None
                if (cfg.save_every and step % cfg.save_every == 0) or rec.stop_requested:
                    saved = trainer.save_checkpoint(step)
                if rec.stop_requested:
                    raise TrainingInterrupted(
                        f"interrupted at step {step}/{cfg.steps}: saved {saved}; continue with --resume"
                    )
                if trainer.hooks.after_step:
                    trainer.hooks.after_step(step)
    finally:
        if bar is not None:
            bar.close()
        log.close()
    return last_row, initial_eval, time.perf_counter() - t_start


def _progress_bar(cfg: FinetuneConfig, start_step: int):
    show = cfg.progress if cfg.progress is not None else (sys.stderr.isatty() and not os.environ.get("CI"))
    if not show:
        return None
    from tqdm.auto import tqdm

    from normswap.progress import unescaped

    return tqdm(
        total=cfg.steps,
        initial=start_step,
        desc="finetune",
        unit="step",
        dynamic_ncols=True,
        file=unescaped(sys.stderr),
    )


class _Log:
    """OUT/train_log.jsonl, one row per line, flushed at once (process 0; a no-op elsewhere)."""

    def __init__(self, run: RunDir | None):
        self.file = run.open_log() if run is not None else None

    def __call__(self, row: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _summary(trainer: Trainer, job: _Job, start_step: int, last_row: dict | None, initial_eval, wall: float) -> dict:
    """What the run returns (and records as finished): the same on every process."""
    cfg, run = trainer.cfg, trainer.run
    if last_row is None:  # resumed at the last step: nothing left to train
        last_row = next((r for r in reversed(run.rows()) if r.get("step") == cfg.steps), None) or {}
        if "eval_loss" not in last_row:
            last_row = dict(last_row, eval_loss=trainer.heldout(job.eval_set))
    final_eval = last_row["eval_loss"]
    distributed = trainer.accelerator.distributed_type
    return {
        "model": cfg.model,
        "out": str(run.out),
        "data": cfg.data,
        "steps": cfg.steps,
        "world_size": trainer.world,
        "distributed": distributed.value if hasattr(distributed, "value") else str(distributed),
        "global_batch": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
        "eval_tokens": int(job.eval_set.numel()),  # what the held-out split held, up to --eval-tokens
        "trainable": cfg.trainable,
        "trainable_parameters": job.n_trainable,
        "parameters": job.n_params,
        "distill_from": cfg.distill_from,
        "resumed_from_step": start_step if cfg.resume else None,
        "initial_eval_loss": initial_eval,
        "final_eval_loss": final_eval,
        "initial_perplexity": _perplexity(job.objective, initial_eval),
        "final_perplexity": _perplexity(job.objective, final_eval),
        "final_train_loss": last_row.get("loss"),
        "wall_seconds": wall,
        # what the held-out loss is for this objective (finetune/objectives.py: heldout_line words it)
        "heldout_metric": getattr(job.objective, "heldout_names", ("loss", None))[0],
        "heldout_perplexity_name": getattr(job.objective, "heldout_names", ("loss", None))[1]
        if _perplexity(job.objective, 0.0)
        else None,
    }


def _write_final(trainer: Trainer, job: _Job, summary: dict) -> None:
    """The final model, checked, in convert's format; the run marked finished (process 0 writes)."""
    from normswap.checkpoint.load import load_model

    cfg, run, accelerator = trainer.cfg, trainer.run, trainer.accelerator
    weights = ckpt.full_weights(trainer.model)  # a collective under FSDP
    problem = job.start_weights.problem(weights) if trainer.main else None
    if trainer.any_process(problem is not None):
        raise trainer.diverged(f"the final weights are not sane ({problem})", cfg.steps, "the model was not written")
    if trainer.main:
        from accelerate.utils import DistributedType

        if (
            accelerator.distributed_type == DistributedType.FSDP
        ):  # the sharded model cannot be saved: a plain copy gets the weights
            final_model = load_model(
                job.resolved, dtype=job.param_dtype, device="cpu", task=job.objective_kind.task, config=job.config
            )
            final_model.load_state_dict(weights)
        else:
            final_model = accelerator.unwrap_model(trainer.model).to("cpu")
        final_model.requires_grad_(True)  # frozen parameters (--trainable norms) are saved like the others
        src_dtype = _source_dtype(job.config)
        if cfg.dtype == "auto" and src_dtype in (torch.float16, torch.bfloat16):
            final_model = final_model.to(src_dtype)  # keep the source's storage dtype
        record = dict(
            cfg.recorded(),
            world_size=trainer.world,
            distributed=summary["distributed"],
            save_every=cfg.save_every,
            log=LOG_FILE,
            resumes=(run.read_run() or {}).get("resumes", []),
            training_data=training_data_record(cfg.data, job.train_split),
            kept_centred=job.centring.describe() if job.centring is not None else None,
            final_metrics={
                k: summary[k]
                for k in (
                    "initial_eval_loss",
                    "final_eval_loss",
                    "initial_perplexity",
                    "final_perplexity",
                    "final_train_loss",
                    "tokens",
                    "wall_seconds",
                    "trainable_parameters",
                )
            },
        )
        run.write_final(final_model, job.tokenizer, {"finetune": record})
        saved_run = run.read_run()
        saved_run.update(status="finished", summary=summary)
        run.write_run(saved_run)
        # only now: a kill before the status is written must still find checkpoints to resume from
        if not cfg.keep_checkpoints_after_finish:
            run.drop_checkpoints()
    accelerator.wait_for_everyone()
