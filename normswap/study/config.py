"""The study's options, declared once (normswap/declared.py).

``StudyConfig`` generates ``normswap study``'s click options (cli/study_command.py) and the recipe schema's
``study:`` table (recipes/schema.py); both validate with :func:`option_errors`. ``resume="free"``
marks the operational options a ``--resume`` may change; every other option is part of the study
and must match what DIR recorded.

The defaults size the offline study (``normswap study --out DIR``: the shipped kjv-gpt2
architecture, randomly initialised, on the embedded corpus, 3 seeds first, more while a verdict is
open and the budget allows) to finish within 15 minutes on 2 idle CPU cores and to train past the
count-bigram baseline, so that its loss verdicts can be decided; results/study-20261201T1642Z/ holds that run's
output and timing.

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
PRECISIONS = ("fp32", "bf16", "fp16")  # finetune/step.py's, spelled here without importing torch
LR_SCHEDULES = ("cosine", "linear", "constant")  # finetune/schedule.py's SCHEDULES
KERNELS = ("best", "torch", "normswap")
# arm names: what each one is, built in arms.py
ARMS = {
    "layernorm": "the model as given (its LayerNorms, PyTorch's fused layer_norm)",
    "rmsnorm": "every LayerNorm that reads the residual stream replaced by RMSNorm with γ = 1 (β dropped), "
    "every other weight identical",
    "layernorm-control": "a second layernorm arm with the same initial weights but its own data order and "
    "dropout stream: the null control (its differences from layernorm are the noise floor)",
    "layernorm-nobias": "LayerNorm without β on the norms the rmsnorm arm replaces (γ kept): with rmsnorm it "
    "separates mean-centring from the β offset",
    "dyt": "Dynamic Tanh (Zhu et al. 2025) on the norms the rmsnorm arm replaces: γ·tanh(α·x) + β, one "
    "learnable scalar α per norm (initially 0.5), γ and β taken from the LayerNorm",
    "rmsnorm-exact": "normswap's exact conversion of a trained checkpoint (the same function at step 0)",
    "rmsnorm-approx": "normswap's approximate conversion of a trained checkpoint, with convert's defaults "
    "(γ and β folded into the layers that read the norm where possible)",
    "rmsnorm-no-warmup": "the rmsnorm arm trained without the warmup (the rate at its peak from step 1): "
    "ablates the migration rule's linear warmup",
    "rmsnorm-keep-gamma": "from a trained checkpoint, rmsnorm with each LayerNorm's trained γ kept on its "
    "RMSNorm (β dropped): ablates the migration rule's γ = 1",
    "layernorm-planted-lr0.7": "a planted difference: layernorm itself (same initialisation, same data) at 0.7 × "
    "the learning rate. It is not a claim but the study's positive control: its equal-loss test must come out "
    "'different' while layernorm-control's comes out 'equivalent', showing the test can go both ways",
    "layernorm-planted-lr0.5": "a larger planted difference: layernorm at half the learning rate (a positive "
    "control like layernorm-planted-lr0.7, with a handicap that stays visible in short runs of tiny models)",
}
TRAINED_ONLY = ("rmsnorm-exact", "rmsnorm-approx", "rmsnorm-keep-gamma")
TRAINED_DEFAULT = ("rmsnorm-exact", "rmsnorm-approx")  # added to the default arms from a trained checkpoint
# arms trained on a schedule of their own: {arm: the StudyConfig fields it overrides}
ARM_SCHEDULE = {"rmsnorm-no-warmup": {"warmup": 0}}
BASELINE = "layernorm"
CONTROL = "layernorm-control"
# The default planted arm: a handicap the test must find, small enough that the arm still learns past
# the byte bigram by ≥ 0.3 nats like every other arm. Measured on the 300-step default: ×0.5 ended
# 0.15 nats behind layernorm but only 0.28 below the bigram; ×0.7 sits between the two
PLANTED = "layernorm-planted-lr0.7"
PLANTED_LR = {PLANTED: 0.7, "layernorm-planted-lr0.5": 0.5}  # planted arms: layernorm at this multiple of the rate
# The default: the question (rmsnorm against layernorm) and the two arms that show the test works — the
# null control (must come out equivalent) and the planted handicap (must come out different). dyt and
# layernorm-nobias stay one --arms away: four arms × three seeds is what 15 minutes on 2 cores holds.
DEFAULT_ARMS = (BASELINE, "rmsnorm", CONTROL, PLANTED)
TOKENS = ("auto", "bytes", "model")  # study/bytes_model.py
LM_EVAL_OFF = "none"


# Upper bounds no real study comes near. Each count sizes a list, a file or a buffer before anything
# runs (seeds × multipliers × arms units are listed, eval_tokens tokens are held, batch_size ×
# seq_len tokens a step), so an unbounded one turned `seeds: 100000000` in a recipe, on the command
# line or in a resumed study_run.json into a MemoryError after seconds of listing.
MAX_SEEDS = 1000
MAX_STEPS = 1_000_000
MAX_SWEEP = 32  # learning-rate multipliers
MAX_THREADS = 1024
MAX_BATCH = 1 << 16
MAX_SEQ_LEN = 1 << 20  # also bounded by the model's context
MAX_EVAL_TOKENS = 1 << 24


def _opt(default, help, *, resume="match", **declaration):
    return option(default, help, resume=resume, **declaration)


def _list_opt(help, default=(), **declaration):
    """A comma-separated list option (a list in a recipe)."""
    return _opt(list(default), help, kind="list[str]", **declaration)


@dataclass
class StudyConfig:
    out: str = _opt(dataclasses.MISSING, "the study directory", kind="str", recipe=False, cli=False, resume="free")
    model: str = _opt(
        DEFAULT_MODEL, "the model (trained checkpoint) or config to study", kind="str", cli=False, recipe=False
    )
    arms: list[str] = _list_opt(
        "Arms to train, comma-separated (default: " + ",".join(DEFAULT_ARMS) + "; from a trained "
        "checkpoint also rmsnorm-exact,rmsnorm-approx). " + "; ".join(f"{k}: {v}" for k, v in ARMS.items()) + ".",
    )
    arm_lr: list[str] = _list_opt(
        "Per-arm learning-rate multipliers ARM=M, comma-separated (e.g. rmsnorm=2): that arm trains at M × the "
        "rate of the others (to test a migration rule directly, or to plant a known difference).",
    )
    from_scratch: bool = _opt(
        False,
        "Randomly initialise from MODEL's config instead of training on from its weights "
        "(a bare config is always from scratch).",
    )
    tokens: str = _opt(
        "auto",
        "What the model reads. bytes: MODEL's architecture over a 257-entry byte vocabulary (each UTF-8 byte a "
        "token, plus end-of-text; random initialisation), the default study's design: at this budget the "
        "BPE-4096 model never trains past the count bigram, the byte model does (study/bytes_model.py); "
        "model: MODEL's own tokenizer (e.g. the shipped BPE-4096); auto: bytes for the default study "
        "(no MODEL given), model otherwise.",
        choices=TOKENS,
    )
    seeds: int = _opt(
        3,
        "Seeds run first (each its own initialisation and data order, shared by all arms); more follow, up to "
        "--max-seeds, while a verdict is still open and --budget allows.",
        minimum=1,
        maximum=MAX_SEEDS,
    )
    max_seeds: int = _opt(
        8,
        "The most seeds: after each seed beyond --seeds the verdicts are judged again, and another seed runs "
        "only while one of them could still be decided by more seeds (never fewer than --seeds).",
        minimum=1,
        maximum=MAX_SEEDS,
    )
    budget: float = _opt(
        800.0,
        "Seconds of training (all seeds, resumes included) after which no further seed starts; 0: no limit "
        "(--max-seeds alone decides).",
        minimum=0.0,
        maximum=1e9,
        flag="--training-seconds",  # named for what it bounds: a bare --budget would say nothing of that
        aliases=("--budget",),
    )
    steps: int = _opt(300, "Optimizer steps per arm.", minimum=1, maximum=MAX_STEPS)
    warmup: int = _opt(
        30,
        "Linear warmup steps: η_t = η_max·t/T_w up to step T_w (then --lr-schedule).",
        minimum=0,
        maximum=MAX_STEPS,
        flag="--warmup-steps",  # the fine-tune's name for the same thing
        aliases=("--warmup",),
    )
    lr: float = _opt(3e-3, "Peak learning rate η_max of every arm.", above=0.0)
    lr_schedule: str = _opt(
        "cosine",
        "After the warmup: cosine or linear decay to --min-lr-ratio × η_max at the last step, or constant.",
        choices=LR_SCHEDULES,
    )
    min_lr_ratio: float = _opt(
        0.1, "The decayed rate at the last step, as a fraction of η_max (cosine and linear).", minimum=0.0, maximum=1.0
    )
    lr_sweep: list[str] = _list_opt(
        "Learning-rate multipliers, e.g. 0.5,1,2: every arm trains at each --lr × m; the sweep finds each "
        "arm's best rate and tests the gradient-scale migration rule.",
    )
    stability: bool = _opt(
        False,
        "Stability sweep: every arm also trains at --lr × 1, 2, 4, … (--stability-rates rates) until it diverges, "
        "in the training precision; the low-precision stability claim is judged from it (normswap/study/stability.py).",
    )
    stability_rates: int = _opt(6, "Rates of the --stability sweep (--lr × 2^k, k = 0 … N−1).", minimum=2)
    precision: str = _opt(
        "fp32",
        "float32, bfloat16 or float16 (fp32, bf16, fp16): autocast, and every norm computing in that dtype (its "
        "input, γ and β cast to it); float16 adds loss scaling; float32 master weights always.",
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
        32, "Sequences per optimizer step (the global batch, whatever the processes).", minimum=1, maximum=MAX_BATCH
    )
    # 32 × 64 rather than 16 × 128: the same 2,048 tokens a step, twice the independent windows; the
    # byte model is then at 1.94 nats by step 200 instead of 2.23 (seed 0, 400 steps: 1.729 against
    # 1.940 at the end; the bigram 2.28-2.30; results/study-design-20261203T1336Z/), so 300 steps learn
    # past it with room
    seq_len: int = _opt(64, "Tokens per sequence.", minimum=2, maximum=MAX_SEQ_LEN)
    eval_every: int = _opt(
        75,
        "Held-out loss every K steps besides the final evaluations (always at step 0; 0: only those).",
        minimum=0,
        maximum=MAX_STEPS,
    )
    eval_tokens: int = _opt(
        8192,
        "Held-out tokens: blocks spread evenly over the data's validation split (the same for every arm and seed).",
        minimum=1,
        maximum=MAX_EVAL_TOKENS,
    )
    final_evals: int = _opt(
        4,
        "Final quality = the mean held-out loss of this many evaluations ending at the last step, "
        "--final-eval-every steps apart.",
        minimum=1,
        maximum=1000,
    )
    final_eval_every: int = _opt(
        0, "Steps between the final evaluations (0: a twentieth of --steps, at least 1).", minimum=0, maximum=MAX_STEPS
    )
    margin: float = _opt(
        0.03,
        "Equivalence margin in nats of held-out loss: equal loss is reproduced only when the whole 90 % interval "
        "of the paired difference lies within ±margin.",
        above=0.0,
    )
    lm_eval_tasks: list[str] = _list_opt(
        "lm-eval tasks scored on every arm's final model of every seed (normswap's own offline tasks, or any "
        f"lm-eval task by name; paired by seed like the held-out loss); {LM_EVAL_OFF}: skip.",
        default=["normswap_kjv"],
    )
    lm_eval_limit: int = _opt(
        16, "Documents (examples) per lm-eval task (0: all of them).", minimum=0, maximum=1_000_000
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
    speed_seconds: float = _opt(
        30.0,
        "Seconds of the timing phase after training (normswap.timing: interleaved pairs of one training step, "
        "each arm against layernorm, layernorm's second copy as the null control); 0: no timing phase.",
        minimum=0.0,
        maximum=1e6,
    )
    workers: int = _opt(
        0,
        "Training processes: the units (arm × seed × rate) are spread over N processes, each on --threads "
        "thread(s) (0: one per CPU core this process may use, at most the units of a round). Speed is not "
        "read from these runs but from a separate timing phase (study/speed_phase.py).",
        minimum=0,
        maximum=MAX_THREADS,
        resume="free",
    )
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
        self.arm_lr = declared.as_list(self.arm_lr)
        self.lm_eval_tasks = declared.as_list(self.lm_eval_tasks)

    def recorded(self) -> dict:
        d = dataclasses.asdict(self)
        return {f.name: d[f.name] for f in dataclasses.fields(self) if f.metadata["resume"] != "free"}

    def multipliers(self) -> list[float]:
        return [float(m) for m in self.lr_sweep] if self.lr_sweep else [1.0]

    def arm_multipliers(self) -> dict[str, float]:
        """--arm-lr as {arm: multiplier} (arms not named train at 1 × the rate)."""
        return {k: float(v) for k, _, v in (item.partition("=") for item in self.arm_lr)}

    def seed_limit(self) -> int:
        return max(self.seeds, self.max_seeds)

    def final_spacing(self) -> int:
        return self.final_eval_every or max(1, self.steps // 20)

    def final_eval_steps(self) -> list[int]:
        """The steps whose held-out losses are averaged into the final quality (the last one last)."""
        s = self.final_spacing()
        return sorted({max(1, self.steps - i * s) for i in range(self.final_evals)})

    def lm_eval_task_list(self) -> list[str]:
        return [] if self.lm_eval_tasks in ([], [LM_EVAL_OFF]) else list(self.lm_eval_tasks)


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
    named = []
    for item in declared.as_list(values.get("arm_lr")):
        arm, sep, m = str(item).partition("=")
        try:
            ok = bool(sep) and 0 < float(m) < float("inf")
        except ValueError:
            ok = False
        if not ok:
            errors.append(("arm_lr", f"items are ARM=MULTIPLIER such as rmsnorm=2, got {item!r}"))
        elif arm not in ARMS:
            errors.append(("arm_lr", f"has no arm {arm!r} (arms: {', '.join(ARMS)})"))
        elif arm == BASELINE:
            errors.append(("arm_lr", f"cannot move {BASELINE}: every difference is read against its rate"))
        named.append(arm)
    if len(set(named)) != len(named):
        errors.append(("arm_lr", "names an arm twice"))
    tasks = declared.as_list(values.get("lm_eval_tasks"))
    if LM_EVAL_OFF in tasks and len(tasks) > 1:
        errors.append(("lm_eval_tasks", f"{LM_EVAL_OFF} turns lm-eval off: give it alone"))
    return errors


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def recipe_fields() -> dict[str, dict]:
    return declared.recipe_fields(StudyConfig)
