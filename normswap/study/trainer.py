"""The interleaved trainer: the arms of one (seed, learning-rate multiplier) group, one step each in turn.

One process holds every arm of the group. Step t reads one global batch from the seed's token
stream and gives it to every arm; the arms' order rotates with t, so no arm always runs first
after the data is read (or after the held-out evaluation). Whatever else the machine does while
the group runs lands on every arm alike, so per-step time ratios between arms cancel drift; the
``layernorm-control`` arm shows how far apart two identical arms still measure (the noise floor).

Identical across the arms of a group: the initial weights (arms.py builds each from the seed's
start), the batches and their order, the dropout masks (the global RNG is re-seeded from
(seed, t) before each arm's step, so an arm's masks do not depend on which arms run beside it),
the learning-rate schedule η_t = η_max·min(t/T_w, 1), the precision and the kind of kernel.
Because nothing an arm computes depends on the other arms, a group that runs only some of its
arms (a resumed study whose other units are finished) computes exactly what the whole group would.

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

import contextlib
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from normswap.model_facts import norm_modules
from normswap.study import measure
from normswap.study.arms import build_arm

SPIKE_WINDOW = 20  # a spike is judged against the median of this many previous losses
SPIKE_MIN_HISTORY = 10
GRAD_SCALE_STEPS = 10  # the gradient scale of the migration rule: mean global grad norm over the first steps


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
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def lr_at(step: int, peak: float, warmup: int) -> float:
    """η_t = η_max·min(t/T_w, 1) (1-based steps: step T_w is the first at the full rate)."""
    return peak * (min(step / warmup, 1.0) if warmup > 0 else 1.0)


def _param_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (and embeddings) only, never on norms or biases (vectors)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]


@dataclass
class Arm:
    """One arm of the group while it trains, and the unit record it fills."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: object | None
    probe: measure.ArmProbe
    norms: list
    record: dict
    stopped: bool = False
    params: list = field(default_factory=list)


def new_record(arm: str, seed: int, multiplier: float, lr: float, norms: list) -> dict:
    return {
        "arm": arm,
        "seed": seed,
        "lr_multiplier": multiplier,
        "lr": lr,
        "status": "running",
        "steps_done": 0,
        "loss": [],
        "grad_norm": [],
        "eval": [],
        "final_eval_loss": None,
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
        self.arms: list[Arm] = []
        self.plan = measure.StepPlan(cfg.steps, arm_names)
        for name in arm_names:
            model = build_arm(source, name, seed, cfg.kernels, precision=cfg.precision, rms_impl=rms_impl)
            model = model.to(dist.device)
            opt = torch.optim.AdamW(
                _param_groups(model, cfg.weight_decay), lr=self.peak_lr, betas=(0.9, 0.95), eps=1e-8
            )
            scaler = torch.amp.GradScaler(dist.device.type) if cfg.precision == "fp16" else None
            norms = norm_modules(model)
            self.arms.append(
                Arm(
                    name,
                    model,
                    opt,
                    scaler,
                    measure.ArmProbe(self.plan, model, norms, dist.device),
                    norms,
                    new_record(name, seed, multiplier, self.peak_lr, norms),
                    params=list(model.parameters()),
                )
            )

    # ------------------------------------------------------------------------ one arm's step
    def _step(self, arm: Arm, batch: torch.Tensor, t: int) -> None:
        cfg, rec = self.cfg, arm.record
        torch.manual_seed(self.seed * 1_000_003 + t)  # the same dropout masks for every arm at step t
        lr = lr_at(t, self.peak_lr, cfg.warmup)
        for g in arm.optimizer.param_groups:
            g["lr"] = lr
        with arm.probe.step(t) as probe:  # the whole step: timed, or measured (measure.StepPlan)
            probe.result = self._forward_backward_update(arm, batch, t, rec)
        self._after(arm, t, probe, rec)

    def _forward_backward_update(self, arm: Arm, batch: torch.Tensor, t: int, rec: dict) -> tuple:
        cfg = self.cfg
        with autocast_for(cfg.precision, self.dist.device):
            loss = arm.model(input_ids=batch, labels=batch).loss
        if self.hooks.loss is not None:
            loss = self.hooks.loss(arm.name, t, loss)
        (arm.scaler.scale(loss) if arm.scaler is not None else loss).backward()
        self.dist.average_grads(arm.params)
        if arm.scaler is not None:
            arm.scaler.unscale_(arm.optimizer)
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(arm.params, cfg.clip_grad if cfg.clip_grad > 0 else float("inf"))
        )
        loss_v = float(self.dist.mean_(loss.detach().float().reshape(1))[0])
        scale = float(arm.scaler.get_scale()) if arm.scaler is not None else 1.0
        skipped = False
        if not math.isfinite(loss_v):
            rec["nonfinite"] = {"step": t, "what": "loss", "value": str(loss_v)}
        elif arm.scaler is not None:
            arm.scaler.step(arm.optimizer)
            arm.scaler.update()
            skipped = arm.scaler.get_scale() < scale
        elif not math.isfinite(grad_norm):
            rec["nonfinite"] = {"step": t, "what": "gradient norm", "value": str(grad_norm)}
        else:
            arm.optimizer.step()
        arm.optimizer.zero_grad(set_to_none=True)
        return loss_v, grad_norm, scale, skipped

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
    def heldout(self, arm: Arm, eval_set: torch.Tensor) -> float:
        """Mean next-token loss over the held-out blocks (the processes split the blocks)."""
        model, dev = arm.model, self.dist.device
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=dev)
        mine = eval_set[self.dist.rank :: self.dist.world]
        with torch.no_grad(), autocast_for(self.cfg.precision, dev):
            for i in range(0, len(mine), self.cfg.batch_size):
                rows = mine[i : i + self.cfg.batch_size].to(dev)
                loss = model(input_ids=rows, labels=rows).loss.double()
                total[0] += loss * len(rows)
                total[1] += len(rows)
        model.train()
        total = self.dist.sum_(total)
        v = float(total[0] / total[1])
        return v if math.isfinite(v) else None

    def _evaluate(self, t: int, eval_set) -> None:
        for arm in self.arms:
            if not arm.stopped:
                v = self.heldout(arm, eval_set)
                arm.record["eval"].append({"step": t, "loss": v})
                if t == self.cfg.steps:
                    arm.record["final_eval_loss"] = v

    # ------------------------------------------------------------------------ the loop
    def run(self, stream, eval_set, *, on_step=None, on_arm_done=None) -> list[dict]:
        """Train every arm for cfg.steps (or until it diverges); return their records."""
        cfg, world, rank = self.cfg, self.dist.world, self.dist.rank
        micro = cfg.batch_size // world
        self._evaluate(0, eval_set)
        for t in range(1, cfg.steps + 1):
            active = [a for a in self.arms if not a.stopped]
            if not active:
                break
            batch = stream.take(cfg.batch_size)[rank * micro : (rank + 1) * micro].to(self.dist.device)
            for arm in self.plan.order(t, active):  # a Williams order over the timed steps
                self._step(arm, batch, t)
                if arm.stopped and on_arm_done:
                    on_arm_done(arm.record)
            if t == cfg.steps or (cfg.eval_every and t % cfg.eval_every == 0):
                self._evaluate(t, eval_set)
            if on_step:
                on_step(t, self.arms)
            if self.hooks.after_step:
                self.hooks.after_step(self.seed, self.multiplier, t)
        for arm in self.arms:
            arm.probe.remove()
            if not arm.stopped:
                arm.record["status"] = "finished"
        return [a.record for a in self.arms]
