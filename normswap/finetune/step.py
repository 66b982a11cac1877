"""One optimizer step, written once for the fine-tune (finetune/trainer.py) and the study
(study/training/interleaved.py): the schedule's rate, the loss under the run's precision, backward (scaled in
fp16), the gradients averaged across processes, clipping, the optimizer update (or its refusal),
and the gradients cleared.

What differs between the two callers is passed in, not branched on here:

* how gradients travel between processes: the fine-tune's 🤗 accelerate does it inside its
  ``backward`` and ``clip_grad_norm_`` (DDP and FSDP), so it hands those two in; the study's plain
  processes hand in ``average_grads`` (one all-reduce of the flattened gradients);
* the precision: ``precision_for("bf16", device)`` autocasts the forward pass; ``"fp16"`` adds a
  loss scaler (the step is skipped, and counted, when the scaled gradients overflow); the
  fine-tune's accelerator autocasts inside its prepared model, so it passes ``Precision()``.

Step numbers are 1-based (finetune/schedule.py). A step whose loss (or, without a loss scaler,
gradient norm) is not finite never updates the weights: ``update`` says so and the caller decides
whether that stops the run (the fine-tune) or only that arm (the study).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from normswap.finetune.schedule import SCHEDULES, lr_factor

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Schedule:
    """η_t = peak · lr_factor(t): linear warmup over ``warmup_steps``, then ``kind`` (constant,
    cosine or linear) down to ``min_ratio`` · peak at ``total_steps``."""

    peak: float
    total_steps: int
    warmup_steps: int
    kind: str = "cosine"
    min_ratio: float = 0.0

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.kind!r} (one of {', '.join(SCHEDULES)})")

    def lr(self, step: int) -> float:
        return self.peak * lr_factor(
            step,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            schedule=self.kind,
            min_ratio=self.min_ratio,
        )

    def describe(self) -> dict:
        """What results and run files record about the schedule."""
        return {
            "kind": self.kind,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "peak_lr": self.peak,
            "final_lr": self.lr(self.total_steps),
            "min_ratio": self.min_ratio if self.kind != "constant" else 1.0,
        }


@dataclass
class Precision:
    """The forward pass's autocast (a context factory) and, for fp16, a loss scaler."""

    name: str = "fp32"
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    scaler: object | None = None
    dtype: torch.dtype = torch.float32


def precision_for(name: str, device: torch.device | str) -> Precision:
    """fp32: nothing; bf16: autocast to bfloat16; fp16: autocast to float16 with a GradScaler."""
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r} (one of {', '.join(PRECISIONS)})")
    device = torch.device(device)
    if name == "fp32":
        return Precision()
    dtype = torch.bfloat16 if name == "bf16" else torch.float16

    def autocast():
        return torch.autocast(device_type=device.type, dtype=dtype)

    scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
    return Precision(name, autocast, scaler, dtype)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices (and embeddings) only, never on norms or biases —
    the same for the fine-tune and every study arm."""
    from normswap.model_facts import norm_modules

    norm_params = {id(p) for _, m in norm_modules(model) for p in m.parameters(recurse=False)}
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # named_parameters de-duplicates tied weights
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or id(p) in norm_params else decay).append(p)
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]


@dataclass
class Update:
    """What ``TrainStep.update`` did: ``applied`` (the weights changed), ``skipped`` (fp16: the
    scaler found overflowing gradients and skipped the update), ``refused`` (a non-finite loss or
    gradient norm: nothing changed), and the loss scale the gradients were divided by."""

    applied: bool
    skipped: bool = False
    refused: str | None = None
    scale: float = 1.0


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()


def _plain_clip(params, max_norm: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


@dataclass
class TrainStep:
    """The step's pieces for one model: call ``begin(t)``, then ``loss(fn)`` / ``backward(loss)``
    per micro-batch, then ``clip()``, then ``update(loss_value, grad_norm)``."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    clip_grad: float = 0.0  # 0: no clipping (the norm is still measured)
    precision: Precision = field(default_factory=Precision)
    backward_fn: Callable[[torch.Tensor], None] = _plain_backward  # accelerate's backward in the fine-tune
    clip_fn: Callable = _plain_clip  # accelerate's clip_grad_norm_ in the fine-tune
    average_grads: Callable[[list], None] | None = None  # the study's all-reduce across processes
    params: list = field(default_factory=list)

    def __post_init__(self):
        if not self.params:
            self.params = [p for p in self.model.parameters() if p.requires_grad]

    @property
    def scaler(self):
        return self.precision.scaler

    def begin(self, step: int) -> float:
        """Set the optimizer's rate for ``step`` (1-based); return it."""
        lr = self.schedule.lr(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def loss(self, fn: Callable[[], torch.Tensor]):
        """``fn()`` (the forward pass and its loss) under the precision's autocast."""
        with self.precision.autocast():
            return fn()

    def backward(self, loss: torch.Tensor, divisor: float = 1.0) -> None:
        """Back-propagate ``loss / divisor`` (scaled first under fp16)."""
        if divisor != 1:
            loss = loss / divisor
        self.backward_fn(self.scaler.scale(loss) if self.scaler is not None else loss)

    def clip(self) -> float:
        """Average the gradients across processes, unscale them (fp16), clip their global norm;
        return the norm before clipping (nan when the clip function returns nothing)."""
        if self.average_grads is not None:
            self.average_grads(self.params)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = self.clip_fn(self.params, self.clip_grad if self.clip_grad > 0 else float("inf"))
        return float(norm) if norm is not None else float("nan")

    def run(self, loss_fn: Callable[[], torch.Tensor], step: int, *, loss_hook=None, reduce_loss=None):
        """The whole step on one batch: ``begin(step)``, the loss under the precision (``loss_hook``
        may replace it: fault injection), backward, clip, update. ``reduce_loss(value)`` turns this
        process's loss into the global one (the study's mean across processes). Returns
        ``(loss value, gradient norm before clipping, Update)``."""
        self.begin(step)
        loss = self.loss(loss_fn)
        if loss_hook is not None:
            loss = loss_hook(loss)
        self.backward(loss)
        grad_norm = self.clip()
        value = float(loss.detach().float())
        if reduce_loss is not None:
            value = reduce_loss(value)
        return value, grad_norm, self.update(value, grad_norm)

    def update(self, loss_value: float, grad_norm: float) -> Update:
        """Apply the optimizer step unless the loss (or, without a loss scaler, the gradient norm)
        is not finite; clear the gradients either way."""
        scale = float(self.scaler.get_scale()) if self.scaler is not None else 1.0
        if not math.isfinite(loss_value):
            out = Update(False, refused="loss", scale=scale)
        elif self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale
            out = Update(not skipped, skipped=skipped, scale=scale)
        elif not math.isfinite(grad_norm):
            out = Update(False, refused="gradient norm", scale=scale)
        else:
            self.optimizer.step()
            out = Update(True, scale=scale)
        self.optimizer.zero_grad(set_to_none=True)
        return out
