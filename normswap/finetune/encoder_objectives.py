"""What the fine-tune minimises for a model without a causal-LM head (BERT, RoBERTa, MiniLM …).

* ``EncoderDistill`` (``--distill-from SRC``): the student's hidden states toward the frozen
  teacher's on the same text (the final layer, or every layer with ``--distill-layers all``), each
  layer's mean squared error divided by the teacher's mean square there (so every layer weighs
  alike whatever its scale); on the final layer also the direction of each token's state (1 −
  cosine) and of mean-pooled spans of ``SPAN`` tokens (1 − cosine: what a sentence encoder
  outputs for a short sentence, which the squared error weighs only through its scale); plus,
  where both models have a masked-LM head, KL(teacher‖student) of the head's token
  distributions. ``--distill-alpha`` < 1 mixes in the masked-LM loss. The student trains without
  dropout: the target is the teacher's deterministic function, and dropout noise in the student
  would dominate the small remaining error (with dropout, the train loss stays several times the
  held-out loss, which is measured without it).
* ``MaskedLM`` (no teacher, masked-LM models): the pre-training objective: 15 % of the tokens
  chosen, 80 % of those replaced by [MASK], 10 % by a random token, 10 % kept, cross-entropy on
  the chosen ones (what transformers' DataCollatorForLanguageModeling does).

Masks are drawn per row from a generator seeded by ``--seed`` and the row's tokens, never from a
global RNG: a resumed run, a run on more processes and the held-out loss all see the same masks
for the same text. Packed training rows are framed like an encoder's input ([CLS] … [SEP]).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from normswap.errors import NormswapError
from normswap.finetune.objectives import Loss, heldout_mean

MASK_RATE = 0.15
SPAN = 16  # tokens per pooled span: about a short sentence
DISTILL_LAYERS = ("final", "all")


def has_mlm_head(model) -> bool:
    return any(cls.__name__.endswith("ForMaskedLM") for cls in type(model).__mro__)


def frame(ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """Rows as an encoder reads them: first token [CLS], last token [SEP] (when the tokenizer has both)."""
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    if cls is None or sep is None:
        return ids
    ids = ids.clone()
    ids[:, 0], ids[:, -1] = cls, sep
    return ids


def _row_seed(seed: int, row: torch.Tensor) -> int:
    flat = row.detach().to("cpu", torch.int64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64)
    return (seed * 1_000_003 + int((flat * weights).sum() % 2_147_483_647)) % (2**63)


def mask_tokens(ids: torch.Tensor, tokenizer, seed: int, rate: float = MASK_RATE) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels): BERT-style masking of ``ids`` [n, L]; labels are -100 where nothing is predicted."""
    if tokenizer.mask_token_id is None:
        raise NormswapError(
            "masked-LM training needs a tokenizer with a mask token; this one has none (use --distill-from)"
        )
    special = torch.zeros_like(ids, dtype=torch.bool)
    for tid in (tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            special |= ids == tid
    vocab = len(tokenizer)
    inputs, labels = ids.clone(), torch.full_like(ids, -100)
    for i in range(ids.shape[0]):
        g = torch.Generator().manual_seed(_row_seed(seed, ids[i]))
        u = torch.rand((3, ids.shape[1]), generator=g)
        random_ids = torch.randint(0, vocab, (ids.shape[1],), generator=g).to(ids.device)
        chosen = (u[0] < rate).to(ids.device) & ~special[i]
        to_mask = chosen & (u[1] < 0.8).to(ids.device)
        to_random = chosen & ~to_mask & (u[2] < 0.5).to(ids.device)
        labels[i, chosen] = ids[i, chosen]
        inputs[i, to_mask] = tokenizer.mask_token_id
        inputs[i, to_random] = random_ids[to_random]
    return inputs, labels


def _mlm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


def _token_kl(student_logits, teacher_logits, temperature: float) -> torch.Tensor:
    t = float(temperature)
    s = F.log_softmax(student_logits.float() / t, dim=-1).reshape(-1, student_logits.size(-1))
    p = F.log_softmax(teacher_logits.float() / t, dim=-1).reshape(-1, teacher_logits.size(-1))
    return F.kl_div(s, p, reduction="batchmean", log_target=True) * (t * t)


def hidden_state_loss(student_hidden, teacher_hidden, layers: str) -> torch.Tensor:
    """Mean over the chosen layers of MSE(student, teacher) / mean(teacher²)."""
    pairs = list(zip(student_hidden, teacher_hidden))
    if layers == "final":
        pairs = pairs[-1:]
    terms = [(s.float() - t.float()).pow(2).mean() / t.float().pow(2).mean().clamp_min(1e-12) for s, t in pairs]
    return torch.stack(terms).mean()


def token_cosine_loss(student_last: torch.Tensor, teacher_last: torch.Tensor) -> torch.Tensor:
    """1 − mean cosine of each token's final hidden state to the teacher's."""
    return 1.0 - F.cosine_similarity(student_last.float(), teacher_last.float(), dim=-1).mean()


def pooled_cosine_loss(student_last: torch.Tensor, teacher_last: torch.Tensor, span: int = SPAN) -> torch.Tensor:
    """1 − mean cosine of mean-pooled spans of ``span`` tokens (each row cut into whole spans; a
    row shorter than one span is pooled whole)."""
    s, t = student_last.float(), teacher_last.float()
    n, length, d = s.shape
    k = max(length // span, 1)
    size = length // k
    s, t = s[:, : k * size].reshape(n * k, size, d).mean(1), t[:, : k * size].reshape(n * k, size, d).mean(1)
    return 1.0 - F.cosine_similarity(s, t, dim=-1).mean()


def without_dropout(model) -> None:
    """Dropout off in every module (attention dropout included: transformers reads the module's p)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


class MaskedLM:
    """The masked-LM loss (the non-distilled objective of an MLM model); its held-out loss is the
    masked-LM loss on held-out rows (so ``eval_perplexity`` is the masked-token perplexity)."""

    reports_perplexity = True
    heldout_names = ("masked-LM cross-entropy", "masked-token perplexity")

    def __init__(self, tokenizer, *, seed: int = 0, autocast=contextlib.nullcontext):
        self.tokenizer, self.seed, self.autocast = tokenizer, seed, autocast

    def loss(self, student, batch: torch.Tensor) -> Loss:
        inputs, labels = mask_tokens(frame(batch, self.tokenizer), self.tokenizer, self.seed)
        return Loss(_mlm_loss(student(input_ids=inputs).logits, labels))

    def heldout_loss(self, model, blocks: torch.Tensor, *, micro_batch: int = 8, accelerator=None) -> float:
        def sums(model, ids):
            inputs, labels = mask_tokens(frame(ids, self.tokenizer), self.tokenizer, self.seed)
            n = int((labels != -100).sum())
            return _mlm_loss(model(input_ids=inputs).logits, labels) * n, n

        return heldout_mean(
            model, blocks, sums, micro_batch=micro_batch, accelerator=accelerator, autocast=self.autocast
        )


class EncoderDistill:
    """Hidden states (and the MLM head's distributions, where both models have one) toward a teacher;
    its held-out loss is the same distillation loss on held-out rows (not a perplexity)."""

    reports_perplexity = False
    heldout_names = ("distillation loss", None)

    def __init__(
        self,
        teacher,
        tokenizer,
        *,
        layers: str = "all",
        alpha: float = 1.0,
        temperature: float = 1.0,
        seed: int = 0,
        logits: bool = True,
        autocast=contextlib.nullcontext,
    ):
        if layers not in DISTILL_LAYERS:
            raise NormswapError(f"--distill-layers must be one of {', '.join(DISTILL_LAYERS)}, got {layers}")
        self.teacher, self.tokenizer, self.layers = teacher, tokenizer, layers
        self.alpha, self.temperature, self.seed, self.autocast = alpha, temperature, seed, autocast
        self.logits = logits

    def _distill(self, student, ids) -> tuple[torch.Tensor, dict]:
        out = student(input_ids=ids, output_hidden_states=True)
        with torch.no_grad(), self.autocast():
            ref = self.teacher(input_ids=ids, output_hidden_states=True)
        if len(out.hidden_states) != len(ref.hidden_states):
            raise NormswapError(
                f"--distill-from: the teacher has {len(ref.hidden_states) - 1} layers, the model "
                f"{len(out.hidden_states) - 1}; layer-wise distillation needs the same depth"
            )
        last, ref_last = out.hidden_states[-1], ref.hidden_states[-1]
        parts = {
            "hidden_loss": hidden_state_loss(out.hidden_states, ref.hidden_states, self.layers),
            "token_cosine_loss": token_cosine_loss(last, ref_last),
            "pooled_cosine_loss": pooled_cosine_loss(last, ref_last),
        }
        total = parts["hidden_loss"] + parts["token_cosine_loss"] + parts["pooled_cosine_loss"]
        if self.logits:
            parts["logit_kl"] = _token_kl(out.logits, ref.logits, self.temperature)
            total = total + parts["logit_kl"]
        return total, parts

    def loss(self, student, batch: torch.Tensor) -> Loss:
        ids = frame(batch, self.tokenizer)
        kd, parts = self._distill(student, ids)
        if self.alpha >= 1.0:
            return Loss(kd, dict(parts, distill_loss=kd))
        inputs, labels = mask_tokens(ids, self.tokenizer, self.seed)
        mlm = _mlm_loss(student(input_ids=inputs).logits, labels)
        return Loss(self.alpha * kd + (1.0 - self.alpha) * mlm, dict(parts, distill_loss=kd, mlm_loss=mlm))

    def heldout_loss(self, model, blocks: torch.Tensor, *, micro_batch: int = 8, accelerator=None) -> float:
        def sums(model, ids):
            return self._distill(model, frame(ids, self.tokenizer))[0] * ids.shape[0], ids.shape[0]

        return heldout_mean(
            model, blocks, sums, micro_batch=micro_batch, accelerator=accelerator, autocast=self.autocast
        )


class Encoder:
    """The objective class ``objective_for`` returns for a model without a causal-LM head."""

    task = "auto"  # load the class the checkpoint names (BertModel, BertForMaskedLM, their converted forms)

    @classmethod
    def build(cls, cfg, model, teacher, *, autocast=contextlib.nullcontext):
        from normswap.checkpoint.load import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
        if teacher is None:
            if not has_mlm_head(model):
                raise NormswapError(
                    f"{cfg.model} is an encoder without a masked-LM head: there is nothing to train it on "
                    "without a teacher; pass --distill-from SRC (e.g. the unconverted source)"
                )
            return MaskedLM(tokenizer, seed=cfg.seed, autocast=autocast)
        if int(teacher.config.vocab_size) != int(model.config.vocab_size):
            raise NormswapError(
                f"--distill-from {cfg.distill_from}: its vocabulary ({teacher.config.vocab_size}) differs from the "
                f"model's ({model.config.vocab_size}); distillation needs the same tokenizer"
            )
        if cfg.distill_alpha < 1.0 and not has_mlm_head(model):
            raise NormswapError(
                "--distill-alpha < 1 mixes in the masked-LM loss, which needs a masked-LM head; this encoder has none"
            )
        without_dropout(model)
        return EncoderDistill(
            teacher,
            tokenizer,
            layers=cfg.distill_layers,
            alpha=cfg.distill_alpha,
            temperature=cfg.distill_temperature,
            seed=cfg.seed,
            logits=has_mlm_head(model) and has_mlm_head(teacher),
            autocast=autocast,
        )
