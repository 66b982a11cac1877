"""The interleaved trainer: the arms of one (seed, learning-rate multiplier) group, one step each in turn.

One process holds every arm of the group. Step t reads one global batch from the seed's token
stream and gives it to every arm; the arms' order follows a Williams design over the timed
steps (measure.StepPlan), so no arm always runs first, or after the same arm, after the data is
read (or after the held-out evaluation). Whatever else the machine
does while the group runs lands on every arm alike, so per-step time ratios between arms cancel
drift.

Identical across the arms of a group: the initial weights (arms.py builds each from the seed's
start), the batches and their order, the dropout masks (the global RNG is re-seeded from
(seed, t) before each arm's step, so an arm's masks do not depend on which arms run beside it),
the learning-rate schedule (finetune/step.py's: linear warmup, then cosine, linear or constant),
the precision and the kind of kernel. The step itself — rate, forward and loss under the
precision, backward, all-reduce, clip, update — is finetune/step.py's ``TrainStep``, the one the
fine-tune runs.

Two exceptions, both deliberate: ``layernorm-control`` draws its own data order and its own
dropout stream (``OWN_STREAM``), so its difference from layernorm is the noise floor — how far
two runs of the same model land apart when only the luck of the data differs; and an arm named in
``--arm-lr`` trains at its own multiple of the rate. Because nothing an arm computes depends on
the other arms, a group that runs only some of its arms (a resumed study whose other units are
finished) computes exactly what the whole group would.

Final quality: the mean held-out loss of the last ``--final-evals`` evaluations
(``StudyConfig.final_eval_steps``), with the per-block losses averaged the same way (results.py
pairs them across arms for the held-out sampling error). One evaluation at one step is at the
mercy of that step's batch; by the last steps the schedule has decayed the rate, and the mean of
several evaluations smooths what is left.

Several processes (torchrun / accelerate launch): every process reads the same global batch and
takes its rows; gradients are averaged across processes (all-reduce) before clipping, so each arm
follows the one-process trajectory up to float summation order. Dropout masks then differ from a
one-process run (each process draws for its own rows): exact agreement needs dropout 0, as the
shipped architecture has.

A non-finite loss (or, outside fp16, a non-finite gradient norm) stops that arm before its
weights change: the step and what was non-finite are recorded, the other arms go on. In fp16 a
non-finite gradient is the loss scaler's business: the step is skipped and counted.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from normswap.finetune.step import Schedule, TrainStep, param_groups, precision_for
from normswap.model_facts import norm_modules
from normswap.study.config import ARM_SCHEDULE, CONTROL, PLANTED_LR
from normswap.study.measuring import measure
from normswap.study.training.arms import build_arm

SPIKE_WINDOW = 20  # a spike is judged against the median of this many previous losses
SPIKE_MIN_HISTORY = 10
GRAD_SCALE_STEPS = 10  # the gradient scale of the migration rule: mean global grad norm over the first steps
OWN_STREAM = {CONTROL: 1_000_003}  # arms with their own data order and dropout: their seed offset


@dataclass
class Hooks:
    """Fault injection for tests (a parameter, never the environment): ``loss(arm, step, loss)`` may
    replace an arm's loss (e.g. by inf); ``after_step(seed, multiplier, step)`` runs after each
    interleaved step of every arm (e.g. raises to stop the study mid-unit)."""

    loss: Callable[[str, int, torch.Tensor], torch.Tensor] | None = None
    after_step: Callable[[int, float, int], None] | None = None


@dataclass
class Dist:
    """The process group (one process: rank 0 of 1) and the device."""

    device: torch.device
    rank: int = 0
    world: int = 1

    def mean_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
            t /= self.world
        return t

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def average_grads(self, params) -> None:
        if self.world == 1:
            return
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.mean_(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def autocast_for(precision: str, device: torch.device):
    """The forward pass's autocast for ``precision`` (finetune/step.py's precision_for)."""
    return precision_for(precision, device).autocast()


@dataclass
class Arm:
    """One arm of the group while it trains, and the unit record it fills."""

    name: str
    model: torch.nn.Module
    step: TrainStep
    probe: measure.ArmProbe
    norms: list
    record: dict
    stream_seed: int  # its data order and dropout stream (the group's seed, or the control's own)
    stopped: bool = False
    final_blocks: list = field(default_factory=list)  # per-block held-out losses at the final evaluations

    @property
    def optimizer(self):
        return self.step.optimizer

    @property
    def scaler(self):
        return self.step.scaler

    @property
    def params(self):
        return self.step.params


def stream_seed(arm: str, seed: int) -> int:
    return seed + OWN_STREAM.get(arm, 0)


def new_record(
    arm: str,
    seed: int,
    multiplier: float,
    lr: float,
    norms: list,
    arm_multiplier: float = 1.0,
    warmup: int | None = None,
) -> dict:
    return {
        "arm": arm,
        "seed": seed,
        "lr_multiplier": multiplier,
        "arm_lr_multiplier": arm_multiplier,
        "lr": lr,
        "warmup": warmup,
        "data_seed": stream_seed(arm, seed),
        "status": "running",
        "steps_done": 0,
        "loss": [],
        "grad_norm": [],
        "eval": [],
        "final_eval_loss": None,
        "final_evals": [],
        "final_eval_blocks": None,
        "last_eval_loss": None,
        "lm_eval": None,
        "norm_input_grad_norm": {"layers": [n for n, _ in norms], "per_step": []},
        "nonfinite": None,
        "spikes": [],
        "skipped_steps": [],
        "step_seconds": [],
        "memory": None,
        "norm_share": None,
        "grad_scale_start": None,
    }


class Group:
    """The arms of one (seed, multiplier) and the loop that steps them in turn."""

    def __init__(
        self,
        source,
        cfg,
        arm_names: list[str],
        seed: int,
        multiplier: float,
        dist: Dist,
        hooks: Hooks,
        rms_impl: str | None = None,
    ):
        self.cfg, self.seed, self.multiplier, self.dist, self.hooks = cfg, seed, multiplier, dist, hooks
        self.peak_lr = cfg.lr * multiplier
        self.final_steps = set(cfg.final_eval_steps())
        arm_mults = {**PLANTED_LR, **cfg.arm_multipliers()}  # a planted arm's handicap is its rate
        self.arms: list[Arm] = []
        self.plan = measure.StepPlan(cfg.steps, arm_names)
        for name in arm_names:
            model = build_arm(source, name, seed, cfg.kernels, precision=cfg.precision, rms_impl=rms_impl)
            model = model.to(dist.device)
            peak = self.peak_lr * arm_mults.get(name, 1.0)
            warmup = ARM_SCHEDULE.get(name, {}).get("warmup", cfg.warmup)
            opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=peak, betas=(0.9, 0.95), eps=1e-8)
            step = TrainStep(
                model,
                opt,
                Schedule(peak, cfg.steps, warmup, kind=cfg.lr_schedule, min_ratio=cfg.min_lr_ratio),
                clip_grad=cfg.clip_grad,
                precision=precision_for(cfg.precision, dist.device),
                average_grads=dist.average_grads,
                params=list(model.parameters()),
            )
            norms = norm_modules(model)
            self.arms.append(
                Arm(
                    name,
                    model,
                    step,
                    measure.ArmProbe(self.plan, model, norms, dist.device),
                    norms,
                    new_record(name, seed, multiplier, peak, norms, arm_mults.get(name, 1.0), warmup),
                    stream_seed(name, seed),
                )
            )

    # ------------------------------------------------------------------------ one arm's step
    def _step(self, arm: Arm, batch: torch.Tensor, t: int) -> None:
        rec = arm.record
        torch.manual_seed(arm.stream_seed * 1_000_003 + t)  # the same dropout masks for every arm at step t
        with arm.probe.step(t) as probe:  # the whole step: timed, or measured (measure.StepPlan)
            probe.result = self._forward_backward_update(arm, batch, t, rec)
        self._after(arm, t, probe, rec)

    def _forward_backward_update(self, arm: Arm, batch: torch.Tensor, t: int, rec: dict) -> tuple:
        """finetune/step.py's whole step: rate, loss under the precision, backward, all-reduce, clip, update."""
        hook = self.hooks.loss
        loss_v, grad_norm, update = arm.step.run(
            lambda: arm.model(input_ids=batch, labels=batch).loss,
            t,
            loss_hook=None if hook is None else (lambda loss: hook(arm.name, t, loss)),
            reduce_loss=lambda v: float(self.dist.mean_(torch.tensor([v], device=self.dist.device))[0]),
        )
        if update.refused is not None:
            value = loss_v if update.refused == "loss" else grad_norm
            rec["nonfinite"] = {"step": t, "what": update.refused, "value": str(value)}
        return loss_v, grad_norm, update.scale, update.skipped

    def _after(self, arm: Arm, t: int, probe, rec: dict) -> None:
        """Record step t (outside its timing): the measurements of its role, loss, spikes, status."""
        cfg, world = self.cfg, self.dist.world
        loss_v, grad_norm, scale, skipped = probe.result
        arm.probe.record(rec, t, probe, arm.optimizer, reduce_sq=lambda sq: self.dist.sum_(sq) / (world**2 * scale**2))
        rec["loss"].append(loss_v if math.isfinite(loss_v) else None)
        rec["grad_norm"].append(grad_norm if math.isfinite(grad_norm) else None)
        rec["steps_done"] = t
        if skipped:
            rec["skipped_steps"].append(t)
        prev = [v for v in rec["loss"][-1 - SPIKE_WINDOW : -1] if v is not None]
        if (
            math.isfinite(loss_v)
            and len(prev) >= SPIKE_MIN_HISTORY
            and loss_v > cfg.spike_factor * statistics.median(prev)
        ):
            rec["spikes"].append(t)
        if t == min(GRAD_SCALE_STEPS, cfg.steps):
            norms = [g for g in rec["grad_norm"] if g is not None]
            rec["grad_scale_start"] = sum(norms) / len(norms) if norms else None
        if rec["nonfinite"] is not None:
            arm.stopped = True
            rec["status"] = "diverged"

    # ------------------------------------------------------------------------ held-out loss
    def heldout_blocks(self, arm: Arm, eval_set: torch.Tensor) -> torch.Tensor:
        """Each held-out block's mean next-token loss (float64, [n]; the processes split the blocks)."""
        model, dev = arm.model, self.dist.device
        model.eval()
        per_block = torch.zeros(len(eval_set), dtype=torch.float64, device=dev)
        mine = list(range(self.dist.rank, len(eval_set), self.dist.world))
        with torch.no_grad(), arm.step.precision.autocast():
            for i in range(0, len(mine), self.cfg.batch_size):
                idx = mine[i : i + self.cfg.batch_size]
                rows = eval_set[idx].to(dev)
                logits = model(input_ids=rows, use_cache=False).logits.float()
                nll = F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="none"
                )
                per_block[idx] = nll.view(len(idx), -1).double().mean(1)
        model.train()
        return self.dist.sum_(per_block)

    def heldout(self, arm: Arm, eval_set: torch.Tensor) -> float | None:
        """Mean next-token loss over the held-out blocks (every block the same length: their mean)."""
        v = float(self.heldout_blocks(arm, eval_set).mean())
        return v if math.isfinite(v) else None

    def _evaluate(self, t: int, eval_set) -> None:
        for arm in self.arms:
            if arm.stopped:
                continue
            blocks = self.heldout_blocks(arm, eval_set)
            v = float(blocks.mean())
            v = v if math.isfinite(v) else None
            arm.record["eval"].append({"step": t, "loss": v})
            if t in self.final_steps:
                arm.record["final_evals"].append({"step": t, "loss": v})
                arm.final_blocks.append(blocks.cpu())
            if t == self.cfg.steps:
                self._final(arm)

    def _final(self, arm: Arm) -> None:
        """Final quality: the mean of the final evaluations (None if any was not finite)."""
        rec = arm.record
        rec["last_eval_loss"] = rec["final_evals"][-1]["loss"] if rec["final_evals"] else None
        losses = [e["loss"] for e in rec["final_evals"]]
        if losses and all(v is not None for v in losses):
            rec["final_eval_loss"] = statistics.fmean(losses)
            rec["final_eval_blocks"] = torch.stack(arm.final_blocks).mean(0).tolist()
        arm.final_blocks = []

    def _wants_eval(self, t: int) -> bool:
        return t in self.final_steps or bool(self.cfg.eval_every and t % self.cfg.eval_every == 0)

    # ------------------------------------------------------------------------ the loop
    def run(self, streams, eval_set, *, on_step=None, on_arm_done=None, after_arms=None) -> list[dict]:
        """Train every arm for cfg.steps (or until it diverges); return their records. ``streams``:
        a data-order seed -> its batches (``take(n)``; asked once per seed, here);
        ``after_arms(arms)``: runs once training ends, before the records are returned (lm-eval)."""
        cfg, world, rank = self.cfg, self.dist.world, self.dist.rank
        micro = cfg.batch_size // world
        sources = {key: streams(key) for key in dict.fromkeys(a.stream_seed for a in self.arms)}
        self._evaluate(0, eval_set)
        for t in range(1, cfg.steps + 1):
            active = [a for a in self.arms if not a.stopped]
            if not active:
                break
            batches = {}
            for key, source in sources.items():  # every stream advances every step
                batches[key] = source.take(cfg.batch_size)[rank * micro : (rank + 1) * micro].to(self.dist.device)
            for arm in self.plan.order(t, active):  # a Williams order over the timed steps
                self._step(arm, batches[arm.stream_seed], t)
                if arm.stopped and on_arm_done:
                    on_arm_done(arm.record)
            if self._wants_eval(t):
                self._evaluate(t, eval_set)
            if on_step:
                on_step(t, self.arms)
            if self.hooks.after_step:
                self.hooks.after_step(self.seed, self.multiplier, t)
        for arm in self.arms:
            arm.probe.remove()
        finished = [a for a in self.arms if not a.stopped]
        if after_arms and finished:
            after_arms(finished)
        for arm in finished:
            arm.record["status"] = "finished"
        return [a.record for a in self.arms]
