"""The evaluation's options, declared once (normswap/declared.py).

``EvalConfig`` (with its nested ``SpeedConfig``) generates the ``normswap eval report|ppl|speed``
click options (cli/eval_command.py picks which of them each command offers) and the recipe schema's
``eval:`` table (recipes/schema.py); both validate with :func:`option_errors`. The defaults below
are the only ones: the commands, recipes and ``evaluate()`` read them from here.

This module imports neither torch nor click, so that ``--help`` and recipe validation stay fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from normswap import declared
from normswap.declared import option

SPLITS = ("test", "validation", "train", "all")
DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
SPEED_KINDS = ("forward", "train_step", "generate", "norm_share")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class SpeedConfig:
    repeats: int = option(
        400,
        "The most interleaved pairs per measured kind, time in norms included (normswap/timing.py; fewer when "
        "every interval reaches --target-halfwidth first or --kind-seconds runs out).",
        minimum=1,
    )
    warmup: int = option(
        1, "Unmeasured warm-up blocks per model and kind.", minimum=0, flag="--warmup-blocks", aliases=("--warmup",)
    )  # blocks, not steps: --warmup-steps is a learning-rate warmup (finetune, study)
    min_time: float = option(
        0.02, "Seconds per timed block (short calls are repeated within a block; pairs of short blocks).", minimum=0.0
    )
    speed_budget: float = option(
        15.0,
        "Seconds of interleaved pairs per measured kind at most (the stop rule's time budget).",
        minimum=0.0,
        flag="--kind-seconds",  # named for what it bounds: a bare --budget would say nothing of that
        aliases=("--speed-budget",),
    )
    target_halfwidth: float = option(
        0.01, "Stop adding pairs once every speed ratio's 95% interval is within this of its median.", above=0.0
    )
    new_tokens: int = option(32, "Tokens generated per generation measurement.", minimum=1)
    compile: bool = option(
        False, "Measure speed with every model under torch.compile (Inductor): compiled original vs compiled converted."
    )
    compile_mode: str = option(
        "default",
        "torch.compile's mode with --compile, the same for every model: reduce-overhead captures each step in CUDA "
        "graphs (a served decode step: the decode's KV cache is cut back to the same length before every step, so "
        "every step replays one graph); max-autotune also tunes Inductor's kernels.",
        choices=COMPILE_MODES,
    )
    null_control: bool = option(
        True,
        "Also time the baseline loaded a second time, interleaved with the rest: what 'no "
        "difference' looks like on this machine; a speed ratio is called a difference only when this "
        "null control is tight (docs/results-schema.md).",
    )
    # set by the evaluation for each run (not options)
    batch_size: int = 8
    seq_len: int = 128
    max_calls: int = 50
    prompt_len: int = 64
    seed: int = 0
    kinds: tuple = SPEED_KINDS

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["kinds"] = list(self.kinds)
        return d


@dataclass
class EvalConfig:
    # A recipe fine-tunes on its data: its evaluation must read the held-out test split even of a
    # file, where the command reads all of a file the user names (data.default_eval_split).
    split: str | None = option(
        None,
        "Held-out split: test for reported numbers, validation for model selection, all for the "
        "whole source (default: test of the embedded corpus or a dataset with splits; all of a file or "
        "directory you name; test in a recipe).",
        kind="str",
        choices=SPLITS,
        recipe_default="test",
    )
    seq_len: int | None = option(
        None, "Window length in tokens (default: min(shortest model context, 512)).", kind="int", minimum=2
    )
    stride: int | None = option(None, "Tokens between window starts (default: seq-len / 2).", kind="int", minimum=1)
    max_tokens: int = option(65536, "Cap on evaluated tokens (0: the whole split); stated in results.", minimum=0)
    batch_size: int = option(8, "Sequences per batch.", minimum=1)
    dtype: str = option("auto", "Compute dtype (auto: bfloat16 on CUDA, float32 on CPU).", choices=DTYPES)
    perplexity: bool | None = option(
        None,
        "Perplexity, bits per byte and word perplexity (default: for causal LMs; not defined for encoders).",
        kind="bool",
    )
    diagnostics: bool = option(True, "Norm-input statistics and the gradient norm on one fixed batch (causal LMs).")
    fidelity: bool | None = option(
        None,
        "Fidelity to the baseline: cosine of last hidden states and sentence embeddings, "
        "masked-token loss (default: for encoders).",
        kind="bool",
    )
    fidelity_tokens: int = option(8192, "Tokens of held-out text the fidelity reads.", minimum=16)
    tasks: list = option([], "Comma-separated lm-eval tasks (normswap_kjv works offline; hub tasks need network).")
    lm_eval_limit: int | None = option(
        None, "lm-eval: documents per task (for quick runs).", kind="int", minimum=1, flag="--limit"
    )
    speed: bool = option(True, "Throughput and time-in-norm measurements.")
    speed_setup: SpeedConfig = field(default_factory=SpeedConfig)
    memory: bool = option(True, "Peak memory of one training step.")


def option_errors(values: dict) -> list[tuple[str, str]]:
    """(option name, what is wrong) for ``values`` (flat names): declared bounds, then relations."""
    errors = declared.option_errors(EvalConfig, values)
    seq_len, stride = values.get("seq_len"), values.get("stride")
    if isinstance(seq_len, int) and isinstance(stride, int) and stride > seq_len:
        errors.append(("stride", f"must be <= seq_len ({seq_len}), got {stride}"))
    return errors


def recipe_fields() -> dict[str, dict]:
    """The recipe schema's eval table (see declared.recipe_fields)."""
    return declared.recipe_fields(EvalConfig)
