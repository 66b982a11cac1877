"""What the fine-tune minimises, chosen by the kind of model.

An objective is the seam between the training loop and the model kind: the loop only calls
``objective.loss(student, batch) -> Loss`` on each micro-batch and ``objective.heldout_loss(...)``
at evaluation time. The trainer's ``objective_for(config)`` picks the objective class (this
module's ``CausalLM`` or ``encoder_objectives.Encoder``); its ``task`` says how the trainer loads
the model (and a teacher).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from normswap.errors import NormswapError
from normswap.finetune.losses import distill_loss, lm_loss


@dataclass
class Loss:
    """One micro-batch's loss: ``total`` is back-propagated; ``parts`` (named tensors) are logged as
    extra columns of train_log.jsonl when the objective has more than one term."""

    total: torch.Tensor
    parts: dict[str, torch.Tensor] = field(default_factory=dict)


class CausalLM:
    """Next-token cross-entropy, or distillation toward a frozen teacher's next-token distributions
    mixed with it: loss = α·KL(teacher‖student) + (1−α)·cross-entropy."""

    task = "causal-lm"
    heldout_names = ("cross-entropy", "perplexity")  # what heldout_loss is, and exp() of it

    def __init__(self, teacher=None, *, alpha: float = 1.0, temperature: float = 1.0, autocast=contextlib.nullcontext):
        self.teacher = teacher
        self.alpha = alpha
        self.temperature = temperature
        self.autocast = autocast

    def loss(self, student, batch: torch.Tensor) -> Loss:
        logits = student(input_ids=batch, use_cache=False).logits
        lm = lm_loss(logits, batch)
        if self.teacher is None:
            return Loss(lm)
        with torch.no_grad(), self.autocast():
            teacher_logits = self.teacher(input_ids=batch, use_cache=False).logits
        kd = distill_loss(logits, teacher_logits, self.temperature)
        return Loss(self.alpha * kd + (1.0 - self.alpha) * lm, {"lm_loss": lm, "distill_loss": kd})

    def heldout_loss(self, model, blocks: torch.Tensor, *, micro_batch: int = 8, accelerator=None) -> float:
        return heldout_loss(model, blocks, micro_batch=micro_batch, accelerator=accelerator, autocast=self.autocast)

    @classmethod
    def build(cls, cfg, model, teacher, *, autocast=contextlib.nullcontext) -> CausalLM:
        """The objective for ``model`` (and ``teacher``, loaded with ``task``) under the options in ``cfg``."""
        if teacher is not None:
            student_vocab, teacher_vocab = _vocab_size(model), _vocab_size(teacher)
            if student_vocab != teacher_vocab:
                raise NormswapError(
                    f"--distill-from {cfg.distill_from}: its vocabulary ({teacher_vocab}) differs from "
                    f"the model's ({student_vocab}); distillation needs the same tokenizer"
                )
        return cls(teacher, alpha=cfg.distill_alpha, temperature=cfg.distill_temperature, autocast=autocast)


def _vocab_size(model) -> int:
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


def heldout_loss(model, blocks: torch.Tensor, *, micro_batch: int = 8, accelerator=None, autocast=None) -> float:
    """Mean next-token cross-entropy (``losses.lm_loss``) of ``model`` over ``blocks`` ([n, seq_len])."""

    def sums(model, ids):
        predicted = ids[:, 1:].numel()
        return lm_loss(model(input_ids=ids, use_cache=False).logits, ids).double() * predicted, predicted

    return heldout_mean(model, blocks, sums, micro_batch=micro_batch, accelerator=accelerator, autocast=autocast)


def heldout_mean(
    model, blocks: torch.Tensor, batch_sums, *, micro_batch: int = 8, accelerator=None, autocast=None
) -> float:
    """Σ loss / Σ count over ``blocks``, where ``batch_sums(model, ids) -> (loss sum, count)`` scores one micro-batch.

    With an accelerator the blocks are shared out across processes (every process runs the same
    number of forward passes, padding with zero-weight repeats, as FSDP needs) and the sums are
    reduced, so the value does not depend on the number of processes beyond float rounding.
    """
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    mine = list(range(rank, blocks.shape[0], world))
    per_rank = -(-blocks.shape[0] // world)
    chunks = -(-per_rank // micro_batch)
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    ctx = autocast if autocast is not None else contextlib.nullcontext
    with torch.no_grad():
        for c in range(chunks):
            idx = mine[c * micro_batch : (c + 1) * micro_batch]
            weight = 1.0
            if not idx:  # keep the forward-pass count equal across processes
                idx, weight = [0], 0.0
            ids = blocks[idx].to(device)
            with ctx():
                loss_sum, n = batch_sums(model, ids)
            total += loss_sum.double() * weight
            count += n * weight
    if accelerator is not None and world > 1:
        total, count = accelerator.reduce(torch.stack([total, count]), reduction="sum").unbind()
    if was_training:
        model.train()
    return float(total / count)


def heldout_line(summary: dict) -> str:
    """The fine-tune's held-out result in the metric its objective measures: ``held-out cross-entropy
    4.8210 -> 4.7901 (perplexity 124.10 -> 120.33), 4,096 held-out tokens``; a distillation distance
    (an encoder's hidden-state objective) has no perplexity and gets none, never "n/a -> n/a"."""
    metric, ppl_name = summary.get("heldout_metric") or "loss", summary.get("heldout_perplexity_name") or "perplexity"

    def f(v):
        return "n/a" if v is None else f"{v:.4g}" if metric == "distillation loss" else f"{v:.4f}"

    line = f"held-out {metric} {f(summary.get('initial_eval_loss'))} -> {f(summary.get('final_eval_loss'))}"
    if summary.get("initial_perplexity") is not None and summary.get("final_perplexity") is not None:
        line += f" ({ppl_name} {summary['initial_perplexity']:.2f} -> {summary['final_perplexity']:.2f})"
    return line + (f", {summary['eval_tokens']:,} held-out tokens" if summary.get("eval_tokens") else "")
