"""The fine-tune's options, declared once.

Each field of ``FinetuneConfig`` is declared with ``normswap.declared.option`` (help text, bounds,
choices) plus its role under ``--resume``; from them come the ``normswap finetune`` click options
(cli/finetune_command.py), the recipe schema's ``finetune:`` table (recipes/schema.py), the validation of
both, and what ``--resume`` may change:

* ``resume="match"``: part of the run's trajectory or of its evaluation; a resumed run takes the
  recorded value and refuses a different one given on the command line.
* ``resume="extend"`` (``--steps``): may be raised to train longer.
* ``resume="lower"`` (``--lr``): may be lowered (the advice after a divergence).
* ``resume="free"``: operational (checkpointing, device, progress bar); any value.

This module imports neither torch nor click, so that ``--help`` and recipe validation stay fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from normswap import declared
from normswap.declared import option

RUN_FILE = "finetune_run.json"
LOG_FILE = "train_log.jsonl"
SCHEDULES = ("constant", "cosine", "linear")
TRAIN_DTYPES = ("auto", "float32", "bfloat16", "float64")
# Held-out tokens when --eval-tokens is not given: a quarter of the run's training tokens, at least
# EVAL_MIN_BLOCKS sequences and at most EVAL_TOKENS_MAX tokens.
EVAL_TOKENS_MAX = 65536
EVAL_MIN_BLOCKS = 8
# Upper bounds of the counts: a run reads, holds or repeats in proportion to each, and one
# given without bound (a typo, a damaged finetune_run.json) would run for minutes into an allocator abort.
# The same bounds hold for the command line, a recipe and a resumed run's record (option_errors).
MAX_STEPS = 10_000_000
MAX_BATCH = 1 << 16  # sequences per optimizer step (memory is checked again against the model)
MAX_SEQ_LEN = 1 << 20  # also bounded by the model's context
MAX_EVAL_TOKENS = 1 << 24
MAX_KEEP = 10_000
EVAL_RULE = (
    f"default: a quarter of the run's training tokens (steps × batch-size × seq-len), at least {EVAL_MIN_BLOCKS} "
    f"sequences, at most {EVAL_TOKENS_MAX:,}"
)


def _opt(default, help, *, resume="match", **declaration):
    """A config field with its declaration (normswap/declared.py) and its role under --resume."""
    return option(default, help, resume=resume, **declaration)


@dataclass
class FinetuneConfig:
    model: str = _opt(dataclasses.MISSING, "the model to fine-tune", kind="str", recipe=False, cli=False)
    out: str = _opt(dataclasses.MISSING, "the output directory", kind="str", recipe=False, cli=False, resume="free")
    data: str = _opt("embedded", "training and held-out corpus", recipe=False)
    steps: int = _opt(
        200, "Optimizer steps (--resume: may be raised to train longer).", minimum=1, maximum=MAX_STEPS, resume="extend"
    )
    lr: float = _opt(
        3e-4, "Peak learning rate η_max (--resume: may be lowered, e.g. after a divergence).", above=0.0, resume="lower"
    )
    warmup_steps: int = _opt(20, "Linear warmup: η_t = η_max·min(t/W, 1).", minimum=0, maximum=MAX_STEPS)
    schedule: str = _opt(
        "cosine", "Decay after the warmup.", choices=SCHEDULES, flag="--lr-schedule", aliases=("--schedule",)
    )  # --lr-schedule: the study's name for the same thing
    min_lr_ratio: float = _opt(0.1, "cosine/linear decay ends at this fraction of --lr.", minimum=0.0, maximum=1.0)
    seq_len: int | None = _opt(
        None, "Tokens per sequence (default: min(model context, 512)).", kind="int", minimum=2, maximum=MAX_SEQ_LEN
    )
    batch_size: int = _opt(
        8, "Sequences per optimizer step (the global batch, whatever the processes).", minimum=1, maximum=MAX_BATCH
    )
    grad_accum: int = _opt(
        1, "Micro-batches per optimizer step (the global batch is still --batch-size).", minimum=1, maximum=MAX_BATCH
    )
    seed: int = _opt(0, "Random seed.", recipe=False)
    save_every: int = _opt(
        0,
        "Write a resumable checkpoint every K steps (0: never).",
        minimum=0,
        maximum=MAX_STEPS,
        resume="free",
        recipe=False,
    )
    keep_checkpoints: int = _opt(
        2, "Keep this many newest checkpoints (0: all).", minimum=0, maximum=MAX_KEEP, resume="free", recipe=False
    )
    keep_checkpoints_after_finish: bool = _opt(
        False, "Keep OUT/checkpoints after the final model is written.", resume="free", recipe=False
    )
    eval_every: int = _opt(
        0, "Held-out loss every K steps (always at step 0 and at the end).", minimum=0, maximum=MAX_STEPS
    )
    eval_tokens: int | None = _opt(
        None,
        f"Held-out tokens from the validation split ({EVAL_RULE}).",
        kind="int",
        minimum=1,
        maximum=MAX_EVAL_TOKENS,
    )
    weight_decay: float = _opt(0.01, "AdamW weight decay (never on norms or biases).", minimum=0.0)
    clip_grad: float = _opt(1.0, "Clip the global gradient norm (0: off).", minimum=0.0)
    trainable: str = _opt(
        "all",
        "all parameters, or only the normalisation layers' γ/β (refused when exact conversion folded them away).",
        choices=("all", "norms"),
    )
    distill_from: str | None = _opt(
        None, "Teacher model (e.g. the unconverted source): train toward its token distributions.", kind="str"
    )
    distill_layers: str = _opt(
        "all",
        "Encoders: distil the hidden states of every layer (all) or of the last one (final).",
        choices=("all", "final"),
    )
    keep_centred: bool = _opt(
        True,
        "For an exact conversion: after each step, project the residual-stream writers back to zero mean "
        "(as convert centred them), so the model still equals a LayerNorm model and exports as --format stock; "
        "--no-keep-centred trains them freely (then only --format onnx exports it).",
    )
    eval_data: str | None = _opt(
        None,
        "Held-out set of the eval loss (default: the validation split of --data); when given, a "
        "--data file or directory is trained on whole.",
        kind="str",
        recipe=False,
    )
    distill_alpha: float = _opt(1.0, "Loss = α·KL(teacher‖student) + (1−α)·LM loss.", minimum=0.0, maximum=1.0)
    distill_temperature: float = _opt(1.0, "Softmax temperature of the distillation KL.", above=0.0)
    adam_beta1: float = _opt(0.9, "AdamW β1.", minimum=0.0, below=1.0)
    adam_beta2: float = _opt(0.95, "AdamW β2.", minimum=0.0, below=1.0)
    adam_eps: float = _opt(1e-8, "AdamW ε.", above=0.0)
    dtype: str = _opt(
        "auto",
        "auto: fp32 weights with bf16 autocast on CUDA, fp32 on CPU (float16 is not offered: without loss "
        "scaling it overflows).",
        choices=TRAIN_DTYPES,
    )
    device: str = _opt("auto", "cpu, cuda, cuda:N or auto", resume="free", recipe=False)
    resume: bool = _opt(
        False,
        "Continue the run in OUT from its newest intact checkpoint, with the options recorded in OUT "
        "(options given again must match, except a larger --steps and a lower --lr).",
        resume="free",
        recipe=False,
    )
    force: bool = _opt(False, "Replace OUT if it exists.", resume="free", recipe=False)
    progress: bool | None = _opt(
        None,
        "Progress bar (default: only on an interactive terminal outside CI).",
        kind="bool",
        resume="free",
        recipe=False,
    )

    def recorded(self) -> dict:
        """The options a run records and a resume checks (everything but the free ones)."""
        d = dataclasses.asdict(self)
        return {f.name: d[f.name] for f in dataclasses.fields(self) if f.metadata["resume"] != "free"}


def options() -> list[dataclasses.Field]:
    return declared.options(FinetuneConfig)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def option_errors(values: dict) -> list[tuple[str, str]]:
    """(option name, what is wrong) for each value in ``values`` outside its declared bounds, plus
    the checks that relate two options. Shared by the trainer and the recipe schema."""
    errors = declared.option_errors(FinetuneConfig, values)
    if (
        isinstance(values.get("batch_size"), int)
        and isinstance(values.get("grad_accum"), int)
        and values["grad_accum"] >= 1
    ):
        if values["batch_size"] % values["grad_accum"]:
            errors.append(
                ("batch_size", f"must be divisible by grad_accum ({values['grad_accum']}), got {values['batch_size']}")
            )
    return errors


def recipe_fields() -> dict[str, dict]:
    """The recipe schema's finetune table (see declared.recipe_fields)."""
    return declared.recipe_fields(FinetuneConfig)


def default_eval_tokens(steps: int, batch_size: int, seq_len: int) -> int:
    """Held-out tokens sized to the run (EVAL_RULE): a 3-step run does not read 65,536 tokens twice."""
    return max(EVAL_MIN_BLOCKS * seq_len, min(EVAL_TOKENS_MAX, steps * batch_size * seq_len // 4))
