"""The study's options, declared once (normswap/declared.py).

``StudyConfig`` generates ``normswap study``'s click options (cli/study.py) and the recipe schema's
``study:`` table (recipes/schema.py); both validate with :func:`option_errors`. ``resume="free"``
marks the operational options a ``--resume`` may change; every other option is part of the study
and must match what DIR recorded.

The defaults size the offline study (``normswap study --out DIR``: the shipped kjv-gpt2
architecture, randomly initialised, on the embedded corpus, 3 seeds) to finish in under 10 minutes
on 2 CPU cores; docs/study/ holds that run's output and timing.

This module imports neither torch nor click, so that ``--help`` and recipe validation stay fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from normswap import declared
from normswap.declared import option

DEFAULT_MODEL = "normswap:kjv-gpt2"
RUN_FILE = "study_run.json"
RESULTS_FILE = "results.json"
UNITS_DIR = "units"
PRECISIONS = ("fp32", "bf16", "fp16")
KERNELS = ("best", "torch", "normswap")
# arm names: what each one is, built in arms.py
ARMS = {
    "layernorm": "the model as given (its LayerNorms, PyTorch's fused layer_norm)",
    "rmsnorm": "every LayerNorm that reads the residual stream replaced by RMSNorm with γ = 1 (β dropped), "
    "every other weight identical",
    "layernorm-control": "a second, identical layernorm arm: the null control "
    "(its differences from layernorm are the noise floor)",
    "rmsnorm-exact": "normswap's exact conversion of a trained checkpoint (the same function at step 0)",
    "rmsnorm-approx": "normswap's approximate conversion of a trained checkpoint, with convert's defaults "
    "(γ and β folded into the layers that read the norm where possible)",
}
TRAINED_ONLY = ("rmsnorm-exact", "rmsnorm-approx")
BASELINE = "layernorm"
CONTROL = "layernorm-control"


# Upper bounds no real study comes near. Each count sizes a list, a file or a buffer before anything
# runs (seeds × multipliers × arms units are listed, eval_tokens tokens are held, batch_size ×
# seq_len tokens a step), so an unbounded one turned `seeds: 100000000` in a recipe, on the command
# line or in a resumed study_run.json into a MemoryError after seconds of listing (issue #29).
MAX_SEEDS = 1000
MAX_STEPS = 1_000_000
MAX_SWEEP = 32  # learning-rate multipliers
MAX_THREADS = 1024
MAX_BATCH = 1 << 16
MAX_SEQ_LEN = 1 << 20  # also bounded by the model's context
MAX_EVAL_TOKENS = 1 << 24


def _opt(default, help, *, resume="match", **declaration):
    return option(default, help, resume=resume, **declaration)


@dataclass
class StudyConfig:
    out: str = _opt(dataclasses.MISSING, "the study directory", kind="str", recipe=False, cli=False, resume="free")
    model: str = _opt(
        DEFAULT_MODEL, "the model (trained checkpoint) or config to study", kind="str", cli=False, recipe=False
    )
    arms: list[str] = _opt(
        [],
        "Arms to train, comma-separated (default: layernorm,rmsnorm,layernorm-control; from a trained "
        "checkpoint also rmsnorm-exact,rmsnorm-approx). " + "; ".join(f"{k}: {v}" for k, v in ARMS.items()) + ".",
        kind="list[str]",
    )
    from_scratch: bool = _opt(
        False,
        "Randomly initialise from MODEL's config instead of training on from its weights "
        "(a bare config is always from scratch).",
    )
    seeds: int = _opt(
        3,
        "Repeats, each with its own initialisation and data order (shared by all arms).",
        minimum=1,
        maximum=MAX_SEEDS,
    )
    steps: int = _opt(100, "Optimizer steps per arm.", minimum=1, maximum=MAX_STEPS)
    warmup: int = _opt(
        20, "Linear warmup steps: η_t = η_max·min(t/T_w, 1), then constant.", minimum=0, maximum=MAX_STEPS
    )
    lr: float = _opt(2e-3, "Peak learning rate η_max of every arm.", above=0.0)
    lr_sweep: list[str] = _opt(
        [],
        "Learning-rate multipliers, e.g. 0.5,1,2: every arm trains at each --lr × m; the sweep finds each "
        "arm's best rate and tests the gradient-scale migration rule.",
        kind="list[str]",
    )
    stability: bool = _opt(
        False,
        "Stability sweep: every arm also trains at --lr × 1, 2, 4, … (--stability-rates rates) until it diverges, "
        "in the training precision; the low-precision stability claim is judged from it (normswap/study/stability.py).",
    )
    stability_rates: int = _opt(6, "Rates of the --stability sweep (--lr × 2^k, k = 0 … N−1).", minimum=2)
    precision: str = _opt(
        "fp32",
        "fp32, bf16 or fp16: autocast, and every norm computing in that dtype (its input, γ and β cast to "
        "it); fp16 adds loss scaling; fp32 master weights always.",
        choices=PRECISIONS,
    )
    kernels: str = _opt(
        "best",
        "The RMSNorm arms' implementation (LayerNorm always runs PyTorch's fused layer_norm). best: the "
        "fastest here, timed side by side before training (normswap's fused kernel, torch's F.rms_norm, on "
        "CUDA also torch.compile); torch: F.rms_norm; normswap: normswap's RMSNorm kernels. Each unit "
        "records what ran (norm_kernel, norm_kernel_fused: detected).",
        choices=KERNELS,
    )
    batch_size: int = _opt(
        8, "Sequences per optimizer step (the global batch, whatever the processes).", minimum=1, maximum=MAX_BATCH
    )
    seq_len: int = _opt(64, "Tokens per sequence.", minimum=2, maximum=MAX_SEQ_LEN)
    eval_every: int = _opt(
        50,
        "Held-out loss every K steps (always at step 0 and at the end; 0: only those).",
        minimum=0,
        maximum=MAX_STEPS,
    )
    eval_tokens: int = _opt(
        4096, "Held-out tokens (the same for every arm and seed).", minimum=1, maximum=MAX_EVAL_TOKENS
    )
    weight_decay: float = _opt(0.0, "AdamW weight decay (never on norms or biases).", minimum=0.0)
    clip_grad: float = _opt(
        1.0, "Clip the global gradient norm (0: off); the logged norm is the one before clipping.", minimum=0.0
    )
    spike_factor: float = _opt(
        2.0, "A loss spike: a step whose loss exceeds this factor × the median of the previous 20 steps.", above=1.0
    )
    data: str = _opt("embedded", "training and held-out corpus", recipe=False)
    device: str = _opt("auto", "cpu, cuda, cuda:N or auto", resume="free", recipe=False)
    threads: int = _opt(
        1,
        "CPU threads for torch (0: torch's default). One by default: the arms are timed against each other, and "
        "on a shared machine two threads that wait on each other measured 5-30x slower and far noisier than one.",
        minimum=0,
        maximum=MAX_THREADS,
        resume="free",
    )
    resume: bool = _opt(
        False,
        "Continue the study in DIR: finished units are kept, the others run again (options given again must "
        "match the recorded ones).",
        resume="free",
        recipe=False,
    )
    force: bool = _opt(False, "Replace DIR if it holds a study.", resume="free", recipe=False)
    progress: bool | None = _opt(
        None,
        "Progress bar (default: only on an interactive terminal; otherwise a line every 30 s).",
        kind="bool",
        resume="free",
        recipe=False,
    )

    def __post_init__(self):
        self.arms = declared.as_list(self.arms)  # "a,b" from the command line, a list from a recipe
        self.lr_sweep = declared.as_list(self.lr_sweep)

    def recorded(self) -> dict:
        d = dataclasses.asdict(self)
        return {f.name: d[f.name] for f in dataclasses.fields(self) if f.metadata["resume"] != "free"}

    def multipliers(self) -> list[float]:
        return [float(m) for m in self.lr_sweep] if self.lr_sweep else [1.0]


def options() -> list[dataclasses.Field]:
    return declared.options(StudyConfig)


def option_errors(values: dict) -> list[tuple[str, str]]:
    """Bounds of each option (declared), plus what relates options: arm names, sweep multipliers."""
    errors = declared.option_errors(StudyConfig, values)
    if any(name in ("arms", "lr_sweep") for name, _ in errors):
        return errors  # not lists of strings: nothing more to say about their items
    for name in declared.as_list(values.get("arms")):
        if name not in ARMS:
            errors.append(("arms", f"has no arm {name!r} (arms: {', '.join(ARMS)})"))
    sweep = declared.as_list(values.get("lr_sweep"))
    for m in sweep:
        try:
            ok = float(m) > 0 and float(m) < float("inf")
        except ValueError:
            ok = False
        if not ok:
            errors.append(("lr_sweep", f"multipliers are positive numbers such as 0.5,1,2, got {m!r}"))
    if len(set(sweep)) != len(sweep):
        errors.append(("lr_sweep", "lists a multiplier twice"))
    if len(sweep) > MAX_SWEEP:
        errors.append(("lr_sweep", f"lists {len(sweep):,} multipliers; at most {MAX_SWEEP}"))
    arms = declared.as_list(values.get("arms"))
    if len(set(arms)) != len(arms):
        errors.append(("arms", "lists an arm twice"))
    return errors


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def recipe_fields() -> dict[str, dict]:
    return declared.recipe_fields(StudyConfig)
