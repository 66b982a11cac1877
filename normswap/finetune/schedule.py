"""Learning-rate schedule: linear warmup, then constant, cosine or linear decay.

Step numbers are 1-based: the first optimizer update is step 1 and uses
    η_1 = η_max · min(1 / T_w, 1),
so that step T_w is the first to use the full rate (the formula in the approximate-conversion
recipe, η_t = η_max·min(t/T_w, 1)). After the warmup the rate decays over the remaining
N − T_w steps to ``min_ratio``·η_max at step N (cosine or linear) or stays at η_max (constant).
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, schedule: str = "constant", min_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate used by optimizer step ``step`` (1-based)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}")
    t = max(int(step), 0)
    if warmup_steps > 0 and t < warmup_steps:
        return min(t / warmup_steps, 1.0)
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    # progress 0 at the last warmup step, 1 at the last step
    progress = min(max((t - warmup_steps) / (total_steps - warmup_steps), 0.0), 1.0)
    if schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


def make_scheduler(optimizer, *, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float = 0.0):
    """A LambdaLR whose ``last_epoch`` counts completed steps, so the rate in the optimizer while
    computing step t (1-based) is lr_factor(t)·η_max. Its state (the step count) is checkpointed."""
    from torch.optim.lr_scheduler import LambdaLR

    def factor(completed: int) -> float:
        return lr_factor(completed + 1, total_steps=total_steps, warmup_steps=warmup_steps, schedule=schedule, min_ratio=min_ratio)

    return LambdaLR(optimizer, factor)
