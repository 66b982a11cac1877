"""The study's speed, measured once, after training, with normswap's one timing instrument.

Training units run in parallel worker processes (units.py), so their step times were taken beside
another process's work and never paired with the baseline's: they say nothing about speed. Speed
is measured here instead, in a phase of its own with the machine to itself (no worker runs):
``normswap.timing.compare`` times one plain training step (forward, loss, backward, clip, AdamW
update: finetune/step.py's TrainStep) of each arm against layernorm's, in interleaved pairs whose
order alternates, the median of the per-pair ratios with a bootstrap interval; the null control is
a second, separately built copy of layernorm timed in the same rounds. The stop rule (converged /
budget / max pairs) is the instrument's; ``--speed-seconds`` is its budget.

Arms whose step is layernorm's own (the null control, a planted arm: the same modules at another
rate or data order) are not timed again: their speed is layernorm's by construction.
"""

from __future__ import annotations

import torch

from normswap import timing
from normswap.study.config import BASELINE, CONTROL, PLANTED_LR

NULL = "layernorm (second copy)"
TARGET_HALFWIDTH = 0.01
METHOD = (
    "a timing phase after training (no worker running): normswap.timing.compare — one plain training step "
    "of each arm against layernorm's in interleaved pairs (order alternating), median of per-pair ratios, "
    "95 % bootstrap over pairs; null control: a second copy of layernorm timed in the same rounds"
)


def _step_fn(model, cfg, batch: torch.Tensor, device):
    """One plain optimizer step of ``model`` on ``batch`` (the study's step, finetune/step.py)."""
    from normswap.finetune.step import Schedule, TrainStep, precision_for

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr * 0.01, betas=(0.9, 0.95))
    step = TrainStep(
        model,
        opt,
        Schedule(cfg.lr * 0.01, 1 << 30, 0, kind="constant"),
        clip_grad=cfg.clip_grad,
        precision=precision_for(cfg.precision, device),
    )

    def run():
        step.run(lambda: model(input_ids=batch, labels=batch).loss, 1)

    return run


def timed_arms(arms: list[str]) -> list[str]:
    return [a for a in arms if a != BASELINE and a != CONTROL and a not in PLANTED_LR]


def measure(plan, echo) -> dict | None:
    """``{ratios: {arm: interval}, null: interval, ...}`` from the timing phase (None: nothing to time)."""
    from normswap.study.training.arms import build_arm

    cfg, source, device = plan.cfg, plan.source, plan.dist.device
    arms = timed_arms(plan.arms)
    if not arms:
        return None
    torch.manual_seed(0)
    batch = torch.randint(0, int(source.config.vocab_size), (cfg.batch_size, cfg.seq_len), device=device)
    rms_impl = plan.kernel_setup.get("rms_impl")

    def fn(arm):
        model = build_arm(source, arm, 0, cfg.kernels, precision=cfg.precision, rms_impl=rms_impl).to(device)
        return _step_fn(model, cfg, batch, device)

    fns = {BASELINE: fn(BASELINE), NULL: fn(BASELINE), **{a: fn(a) for a in arms}}
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    echo(f"normswap study: timing phase: {', '.join(arms)} against layernorm, ≤ {cfg.speed_seconds:g} s")
    result = timing.compare(
        fns,
        BASELINE,
        NULL,
        calls_per_sample=1,
        target_halfwidth=TARGET_HALFWIDTH,
        budget_s=cfg.speed_seconds,
        min_pairs=20,
        warmup=2,
        sync=sync,
    )
    out = result.to_json()
    out["arms"] = arms
    out["instrument"] = "normswap.timing.compare"
    return out


def interval(ratio: dict, method: str = METHOD) -> dict:
    """A timing.Ratio as the throughput gates read intervals (speed.py): median, low, high, pairs."""
    return {
        "median": ratio["ratio"],
        "low": ratio["low"],
        "high": ratio["high"],
        "repeats": ratio["pairs"],
        "pairs": ratio["pairs"],
        "verdict": ratio["verdict"],
        "instrument": "normswap.timing.compare",
        "method": method,
    }
