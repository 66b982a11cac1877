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


def lr_factor(
    step: int, *, total_steps: int, warmup_steps: int, schedule: str = "constant", min_ratio: float = 0.0
) -> float:
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
