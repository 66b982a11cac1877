"""Losses: next-token cross-entropy and distillation toward a frozen teacher's distributions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every predicted position (fp32 whatever the logits)."""
    pred = logits[:, :-1, :].float()
    target = input_ids[:, 1:]
    return F.cross_entropy(pred.reshape(-1, pred.size(-1)), target.reshape(-1))


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher ‖ student) of the temperature-softened next-token distributions, averaged over
    positions and scaled by T² (Hinton et al.) so its gradient size does not depend on T."""
    t = float(temperature)
    s = F.log_softmax(student_logits[:, :-1, :].float() / t, dim=-1)
    p = F.log_softmax(teacher_logits[:, :-1, :].float() / t, dim=-1)
    kl = F.kl_div(s.reshape(-1, s.size(-1)), p.reshape(-1, p.size(-1)), reduction="batchmean", log_target=True)
    return kl * (t * t)
