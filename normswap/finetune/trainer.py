"""The warmup fine-tune that heals a converted model (or trains any causal LM a little further).

One code path for one process, DDP and FSDP: the model and optimizer go through 🤗 accelerate,
everything else (data sharding, schedule, logging, checkpoints) is ours so that its semantics do
not depend on the launcher:

* ``batch_size`` is the *global* batch (sequences per optimizer step). Each optimizer step reads
  ``batch_size`` blocks from one deterministic stream; with W processes and A accumulation steps,
  process r takes rows ``[r·m, (r+1)·m)`` of every micro-batch of ``batch_size/A`` rows
  (m = batch_size/(A·W)). The averaged gradient is therefore the one-process gradient of the same
  global batch, and the loss curve matches a one-process run up to float summation order.
* Only process 0 writes files. Every log row carries ``world_size`` and each process' checksum of
  the rows it trained on (``data_fingerprint``), which shows that the processes split the batch.
* Checkpoints (``OUT/checkpoints/step-K``) hold weights, optimizer, scheduler, every process' RNG
  (``accelerator.save_state``) and the data position; they are written to a temporary directory
  and renamed, so a kill at any moment leaves only complete checkpoints. ``resume`` restores the
  newest one and replays the same trajectory (bitwise on CPU).
* A non-finite loss or gradient norm stops the run before the optimizer step, keeps the last good
  checkpoint and exits non-zero (``TrainingDiverged``). SIGINT/SIGTERM finish the current step,
  save a checkpoint and stop (``TrainingInterrupted``, exit 130).

Test hooks (environment variables, read once per run; real code paths, used by the test-suite):
``NORMSWAP_FINETUNE_INJECT_NAN_AT=K`` multiplies the loss of step K by NaN, exercising the
divergence guard end to end; ``NORMSWAP_FINETUNE_STEP_DELAY=S`` sleeps S seconds after each step
so that a test can kill a run between two checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from normswap.errors import NormswapError
from normswap.finetune.data import TrainStream, eval_blocks, fingerprint
from normswap.finetune.losses import distill_loss, lm_loss
from normswap.finetune.schedule import SCHEDULES, make_scheduler

RUN_FILE = "finetune_run.json"
LOG_FILE = "train_log.jsonl"
CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"

# Options that define the trajectory: a resume must use the same values.
TRAJECTORY_KEYS = (
    "model", "data", "steps", "lr", "warmup_steps", "schedule", "min_lr_ratio", "seq_len", "batch_size",
    "grad_accum", "seed", "weight_decay", "clip_grad", "trainable", "distill_from", "distill_alpha",
    "distill_temperature", "dtype", "adam_beta1", "adam_beta2", "adam_eps",
)


class TrainingDiverged(NormswapError):
    """The loss or gradient became NaN/inf; the run stopped and kept its last good checkpoint."""

    exit_code = 1


class TrainingInterrupted(NormswapError):
    """SIGINT/SIGTERM: the run saved a checkpoint and stopped; ``--resume`` continues it."""

    exit_code = 130


@dataclass
class FinetuneConfig:
    model: str
    out: str
    data: str = "embedded"
    steps: int = 200
    lr: float = 3e-4
    warmup_steps: int = 20
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    seq_len: int | None = None
    batch_size: int = 8
    grad_accum: int = 1
    seed: int = 0
    save_every: int = 0
    keep_checkpoints: int = 2
    eval_every: int = 0
    eval_tokens: int = 65536
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    trainable: str = "all"
    distill_from: str | None = None
    distill_alpha: float = 1.0
    distill_temperature: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    dtype: str = "auto"
    device: str = "auto"
    resume: bool = False
    force: bool = False
    progress: bool | None = None  # None: a bar only on an interactive terminal outside CI
    keep_checkpoints_after_finish: bool = False
    extra: dict = field(default_factory=dict)

    def trajectory(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: d[k] for k in TRAJECTORY_KEYS}


# ----------------------------------------------------------------------------------------------
# validation


def _validate(cfg: FinetuneConfig) -> None:
    def bad(msg):
        raise NormswapError(msg)

    if cfg.steps < 1:
        bad(f"--steps must be >= 1, got {cfg.steps}")
    if not cfg.lr >= 0 or not math.isfinite(cfg.lr):
        bad(f"--lr must be a finite number >= 0, got {cfg.lr}")
    if cfg.warmup_steps < 0:
        bad(f"--warmup-steps must be >= 0, got {cfg.warmup_steps}")
    if cfg.schedule not in SCHEDULES:
        bad(f"--schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        bad(f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if cfg.batch_size < 1 or cfg.grad_accum < 1:
        bad("--batch-size and --grad-accum must be >= 1")
    if cfg.seq_len is not None and cfg.seq_len < 2:
        bad(f"--seq-len must be >= 2 (a sequence predicts its next tokens), got {cfg.seq_len}")
    if cfg.save_every < 0 or cfg.eval_every < 0:
        bad("--save-every and --eval-every must be >= 0 (0 = never / only at start and end)")
    if cfg.weight_decay < 0 or cfg.clip_grad < 0:
        bad("--weight-decay and --clip-grad must be >= 0 (--clip-grad 0 disables clipping)")
    if cfg.trainable not in ("all", "norms"):
        bad(f"--trainable must be all or norms, got {cfg.trainable}")
    if not 0.0 <= cfg.distill_alpha <= 1.0:
        bad(f"--distill-alpha must be in [0, 1], got {cfg.distill_alpha}")
    if cfg.distill_temperature <= 0:
        bad(f"--distill-temperature must be > 0, got {cfg.distill_temperature}")
    if cfg.dtype == "float16":
        bad("--dtype float16 trains without loss scaling and overflows; use --dtype auto (bf16 autocast on CUDA, fp32 master weights)")
    if cfg.dtype not in ("auto", "float32", "bfloat16", "float64"):
        bad(f"--dtype must be auto, float32, bfloat16 or float64, got {cfg.dtype}")
    if cfg.eval_tokens < 1:
        bad("--eval-tokens must be >= 1")


def _check_out_path(cfg: FinetuneConfig, model_dir: str | None) -> None:
    out = Path(cfg.out).resolve()
    if model_dir is not None:
        src = Path(model_dir).resolve()
        if out == src or out in src.parents:
            raise NormswapError(f"OUT {cfg.out} is (or contains) the source model; choose another directory")
    if cfg.distill_from:
        from normswap.checkpoint.load import is_local, resolve

        t = resolve(cfg.distill_from)
        if is_local(t) and (out == Path(t).resolve() or out in Path(t).resolve().parents):
            raise NormswapError(f"OUT {cfg.out} is (or contains) the teacher model; choose another directory")


# ----------------------------------------------------------------------------------------------
# files (process 0 only)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _checkpoints(out: Path) -> list[tuple[int, Path]]:
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit() and (p / TRAINER_STATE).is_file():
            found.append((int(p.name[5:]), p))
    return sorted(found)


def _read_log(out: Path) -> list[dict]:
    return read_log_rows(out / LOG_FILE)


def read_log_rows(path: Path) -> list[dict]:
    """The rows of a train_log.jsonl; a torn last line (a killed run) and what follows are dropped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line from a kill: everything after it is not trusted
    return rows


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o).__name__)


# ----------------------------------------------------------------------------------------------
# model helpers


def _norm_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """Normalisation layers: normswap's RMSNorm, nn.LayerNorm and the families' own *Norm classes."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Norm") or isinstance(m, torch.nn.LayerNorm)]


def _select_trainable(model, trainable: str) -> int:
    """Freeze what is not trained; return the number of trainable parameters.

    ``norms`` trains the parameters of the normalisation layers only: for a converted model, the
    new RMSNorm γ (and β where convert kept it; convert with ``--gamma keep``); for an unconverted
    model, its LayerNorms' γ and β. Folding (exact conversion, or approx with γ folded) leaves the
    RMSNorms without γ: we refuse rather than silently add γ = 1 parameters that the converted
    checkpoint format (and its modeling file) would not know about. We refuse as soon as one norm
    was folded: an exact conversion keeps only the final norm's γ (for a tied head), and training
    that one norm alone is not what "norms" promises.
    """
    if trainable == "all":
        for p in model.parameters():
            p.requires_grad_(True)
        return sum(p.numel() for p in model.parameters())
    norms = _norm_modules(model)
    folded = [n for n, m in norms if type(m).__name__ == "RMSNorm" and getattr(m, "weight", None) is None]
    if folded:
        raise NormswapError(
            f"--trainable norms: {len(folded)} of the model's {len(norms)} norms have no γ (conversion folded it into the next "
            f"layers, e.g. {folded[0]}); convert with --gamma keep to train the norms alone, or use --trainable all"
        )
    norm_params = {id(p) for _, m in norms for p in m.parameters(recurse=False)}
    if not norm_params:
        raise NormswapError("--trainable norms: the model's norm layers have no parameters; use --trainable all")
    n = 0
    for p in model.parameters():
        train = id(p) in norm_params
        p.requires_grad_(train)
        n += p.numel() if train else 0
    return n


def _param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices (and embeddings) only, never on norms or biases."""
    norm_params = {id(p) for _, m in _norm_modules(model) for p in m.parameters(recurse=False)}
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # named_parameters de-duplicates tied weights
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or id(p) in norm_params else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _context_length(config) -> int | None:
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length", "max_sequence_length"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0]) if model.get_output_embeddings() is not None else int(model.config.vocab_size)


def _source_dtype(config):
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


# ----------------------------------------------------------------------------------------------
# evaluation


def heldout_loss(model, blocks: torch.Tensor, *, micro_batch: int = 8, accelerator=None, autocast=None) -> float:
    """Mean next-token cross-entropy of ``model`` over ``blocks`` ([n, seq_len]).

    With an accelerator the blocks are shared out across processes (every process runs the same
    number of forward passes, padding with zero-weight repeats, as FSDP needs) and the sums are
    reduced, so the value does not depend on the number of processes beyond float rounding.
    """
    import torch.nn.functional as F

    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    n = blocks.shape[0]
    mine = list(range(rank, n, world))
    per_rank = -(-n // world)
    chunks = -(-per_rank // micro_batch)
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    ctx = autocast if autocast is not None else contextlib.nullcontext
    with torch.no_grad():
        for c in range(chunks):
            idx = mine[c * micro_batch:(c + 1) * micro_batch]
            weight = 1.0
            if not idx:  # keep the forward-pass count equal across processes
                idx, weight = [0], 0.0
            ids = blocks[idx].to(device)
            with ctx():
                logits = model(input_ids=ids, use_cache=False).logits
            pred = logits[:, :-1, :].float()
            ce = F.cross_entropy(pred.reshape(-1, pred.size(-1)), ids[:, 1:].reshape(-1), reduction="sum")
            total[0] += ce.double() * weight
            total[1] += weight * ids[:, 1:].numel()
    if accelerator is not None and world > 1:
        total = accelerator.reduce(total, reduction="sum")
    if was_training:
        model.train()
    return float(total[0] / total[1])


# ----------------------------------------------------------------------------------------------
# the run


class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop checks it (agreed across processes) after each step."""

    def __init__(self):
        self.signal = None
        self._old = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            # a second Ctrl-C means "now": fall back to the default behaviour
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


def _make_accelerator(cfg: FinetuneConfig):
    from accelerate import Accelerator

    from normswap.cli.options import resolve_device

    device = resolve_device(cfg.device) if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    on_cpu = not device.startswith("cuda")
    if not on_cpu and ":" in device and "LOCAL_RANK" not in os.environ:
        torch.cuda.set_device(int(device.split(":", 1)[1]))
    # Under `accelerate launch` the launcher's config (e.g. FSDP's mixed precision) decides.
    if "ACCELERATE_MIXED_PRECISION" in os.environ:
        mixed = None
    else:
        mixed = "bf16" if (not on_cpu and cfg.dtype == "auto") else "no"
    # cpu=True is what makes a CPU-only multi-process launch (torchrun, gloo) see its real world
    # size; without it each rank believes it is alone.
    return Accelerator(cpu=on_cpu, mixed_precision=mixed)


def run_finetune(cfg: FinetuneConfig, *, echo=None) -> dict:
    """Fine-tune ``cfg.model`` into ``cfg.out``; return the summary (same on every process)."""
    from normswap.checkpoint.load import is_local, load_config, load_model, load_tokenizer, resolve

    _validate(cfg)
    try:  # the final write needs it: fail before training, not after
        from normswap.checkpoint.write import save_checkpoint  # noqa: F401
    except ImportError as e:
        raise NormswapError(f"this normswap build cannot write checkpoints ({e}); reinstall normswap") from None
    echo = echo or (lambda msg: print(msg, file=sys.stderr))
    inject_nan_at = int(os.environ.get("NORMSWAP_FINETUNE_INJECT_NAN_AT", "0") or 0)
    step_delay = float(os.environ.get("NORMSWAP_FINETUNE_STEP_DELAY", "0") or 0)

    resolved = resolve(cfg.model)
    _check_out_path(cfg, resolved if is_local(resolved) else None)
    out = Path(cfg.out)

    accelerator = _make_accelerator(cfg)
    rank, world, main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    A = cfg.grad_accum
    if cfg.batch_size % (A * world):
        raise NormswapError(
            f"--batch-size {cfg.batch_size} (the global batch) must be divisible by processes ({world}) × --grad-accum ({A})"
        )
    micro = cfg.batch_size // (A * world)

    # ---- OUT: fresh, forced or resumed (every process decides the same; process 0 acts) ----
    run_file = out / RUN_FILE
    resume_from = None
    if out.exists():
        if cfg.resume:
            if not run_file.is_file():
                raise NormswapError(f"cannot resume: {cfg.out} is not a normswap finetune run (no {RUN_FILE}); choose another OUT")
            saved = json.loads(run_file.read_text())
            if saved.get("status") == "finished":
                raise NormswapError(f"{cfg.out} already holds a finished fine-tune; use --force to run again")
            cfg_seq = cfg.seq_len
            mine = cfg.trajectory()
            theirs = saved.get("config", {})
            if cfg_seq is None:  # the default was resolved and recorded by the first run
                mine["seq_len"] = theirs.get("seq_len")
            diff = [k for k in TRAJECTORY_KEYS if k in theirs and theirs[k] != mine[k]]
            if diff:
                k = diff[0]
                raise NormswapError(
                    f"cannot resume: --{k.replace('_', '-')} is {mine[k]!r} but the run in {cfg.out} used {theirs[k]!r} (resume with the same options)"
                )
            cks = _checkpoints(out)
            resume_from = cks[-1] if cks else None
        elif cfg.force:
            pass
        else:
            raise NormswapError(f"{cfg.out} exists: pass --resume to continue the fine-tune in it, or --force to replace it")

    config = load_config(resolved)
    ctx_len = _context_length(config)
    seq_len = cfg.seq_len or min(ctx_len or 512, 512)
    if ctx_len is not None and seq_len > ctx_len:
        raise NormswapError(f"--seq-len {seq_len} is longer than the model's context ({ctx_len})")
    cfg = dataclasses.replace(cfg, seq_len=seq_len)

    tokenizer = load_tokenizer(resolved)
    # Everything that can fail on bad input is checked before OUT is touched.
    eval_set = eval_blocks(tokenizer, cfg.data, seq_len, cfg.eval_tokens)

    # ---- model and teacher (before OUT is touched: a refused option leaves no trace) ----
    from accelerate.utils import set_seed

    set_seed(cfg.seed + rank)
    param_dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[cfg.dtype]
    model = load_model(resolved, dtype=param_dtype, device="cpu", task="causal-lm", config=config)
    n_trainable = _select_trainable(model, cfg.trainable)
    n_params = sum(p.numel() for p in model.parameters())

    teacher = None
    if cfg.distill_from:
        teacher = load_model(cfg.distill_from, dtype=param_dtype, device="cpu", task="causal-lm")
        if _vocab_size(teacher) != _vocab_size(model):
            raise NormswapError(
                f"--distill-from {cfg.distill_from}: its vocabulary ({_vocab_size(teacher)}) differs from the model's ({_vocab_size(model)}); distillation needs the same tokenizer"
            )
        teacher.requires_grad_(False)
        teacher.eval()
        teacher.to(accelerator.device)

    accelerator.wait_for_everyone()
    if main:
        if out.exists() and cfg.force and not cfg.resume:
            shutil.rmtree(out)
        if not out.exists() or resume_from is None and not run_file.is_file():
            out.mkdir(parents=True, exist_ok=True)
            (out / CHECKPOINTS).mkdir(exist_ok=True)
            _atomic_write_text(run_file, json.dumps({"status": "running", "config": cfg.trajectory(), "world_size": world}, indent=2, default=_json_default))
            (out / LOG_FILE).write_text("")
        elif resume_from is None:
            (out / LOG_FILE).write_text("")  # nothing was checkpointed: start the log again
        else:
            kept = [r for r in _read_log(out) if r.get("step", 0) <= resume_from[0]]
            _atomic_write_text(out / LOG_FILE, "".join(json.dumps(r) + "\n" for r in kept))
        # leftovers of a checkpoint or final write interrupted by a kill
        for p in list((out / CHECKPOINTS).glob(".tmp-*")) + list(out.parent.glob(f".{out.name}.final-*")):
            shutil.rmtree(p, ignore_errors=True)
    accelerator.wait_for_everyone()

    optimizer = torch.optim.AdamW(
        _param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    # The scheduler stays outside prepare(): accelerate's wrapper would step it once per process.
    scheduler = make_scheduler(optimizer, total_steps=cfg.steps, warmup_steps=cfg.warmup_steps, schedule=cfg.schedule, min_ratio=cfg.min_lr_ratio)
    accelerator.register_for_checkpointing(scheduler)

    start_step, position = 0, 0
    if resume_from is not None:
        step_k, ck = resume_from
        state = json.loads((ck / TRAINER_STATE).read_text())
        if state.get("world_size") != world:
            raise NormswapError(
                f"cannot resume: {ck} was written by {state.get('world_size')} processes, this launch has {world}; relaunch with the same number"
            )
        accelerator.load_state(str(ck))
        start_step, position = int(state["step"]), int(state["data_position"])
        if main:
            echo(f"normswap finetune: resuming from {ck} (step {start_step}/{cfg.steps})")

    stream = TrainStream(tokenizer, cfg.data, seq_len, cfg.seed, position=position)

    def autocast():
        return accelerator.autocast()

    log_path = out / LOG_FILE
    log_f = open(log_path, "a") if main else None

    def log(row: dict):
        if log_f is not None:
            log_f.write(json.dumps(row) + "\n")
            log_f.flush()

    prior_rows = _read_log(out) if resume_from is not None else []
    initial_eval = next((r.get("eval_loss") for r in prior_rows if r.get("step") == 0), None)
    t_start = time.perf_counter()
    if start_step == 0:
        initial_eval = heldout_loss(model, eval_set, micro_batch=max(micro, 1), accelerator=accelerator, autocast=autocast)
        log({"step": 0, "loss": None, "lr": 0.0, "grad_norm": None, "tokens_per_second": None, "world_size": world,
             "eval_loss": initial_eval, "eval_perplexity": math.exp(min(initial_eval, 700))})

    def save_checkpoint_state(step: int) -> Path:
        final = out / CHECKPOINTS / f"step-{step}"
        tmp = out / CHECKPOINTS / f".tmp-step-{step}"
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        # accelerate warns on every save that tied weights are stored once; they are re-tied on load
        quiet = logging.getLogger("accelerate.utils.other")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            accelerator.save_state(str(tmp))
        finally:
            quiet.setLevel(level)
        accelerator.wait_for_everyone()
        if main:
            _atomic_write_text(tmp / TRAINER_STATE, json.dumps({"step": step, "data_position": stream.position, "world_size": world, "epoch": stream.epoch}))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for _, old in _checkpoints(out)[:-cfg.keep_checkpoints] if cfg.keep_checkpoints > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return final

    def last_good() -> str:
        cks = _checkpoints(out)
        return str(cks[-1][1]) if cks else "none (no checkpoint was written yet)"

    show_bar = cfg.progress if cfg.progress is not None else (sys.stderr.isatty() and not os.environ.get("CI"))
    bar = None
    if main and show_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=start_step, desc="finetune", unit="step", dynamic_ncols=True, file=sys.stderr)

    params = [p for p in model.parameters() if p.requires_grad]
    clip = cfg.clip_grad if cfg.clip_grad > 0 else float("inf")
    tokens_per_step = cfg.batch_size * seq_len
    last_row = None
    model.train()
    try:
        with _StopFlag() as stop:
            for step in range(start_step + 1, cfg.steps + 1):
                t0 = time.perf_counter()
                lr_now = optimizer.param_groups[0]["lr"]
                sums = torch.zeros(5, dtype=torch.float64, device=accelerator.device)  # loss, lm, kd, stop, -
                prints = []
                for a in range(A):
                    rows = stream.take(cfg.batch_size // A)
                    ids = rows[rank * micro:(rank + 1) * micro].to(accelerator.device)
                    prints.append(fingerprint(rows[rank * micro:(rank + 1) * micro]))
                    sync = contextlib.nullcontext() if a == A - 1 else accelerator.no_sync(model)
                    with sync:
                        logits = model(input_ids=ids, use_cache=False).logits
                        lm = lm_loss(logits, ids)
                        if teacher is not None:
                            with torch.no_grad(), autocast():
                                t_logits = teacher(input_ids=ids, use_cache=False).logits
                            kd = distill_loss(logits, t_logits, cfg.distill_temperature)
                            loss = cfg.distill_alpha * kd + (1.0 - cfg.distill_alpha) * lm
                        else:
                            kd = None
                            loss = lm
                        if inject_nan_at and step == inject_nan_at:
                            loss = loss * float("nan")
                        accelerator.backward(loss / A)
                    sums[0] += loss.detach().double() / A
                    sums[1] += lm.detach().double() / A
                    if kd is not None:
                        sums[2] += kd.detach().double() / A
                grad_norm = accelerator.clip_grad_norm_(params, clip)
                grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
                sums[3] = 1.0 if stop.signal is not None else 0.0
                if world > 1:
                    sums = accelerator.reduce(sums, reduction="sum")
                    sums[:3] /= world
                    fp = accelerator.gather(torch.tensor([sum(prints) % 2_147_483_647], device=accelerator.device)).tolist()
                else:
                    fp = [sum(prints) % 2_147_483_647]
                loss_v, lm_v, kd_v = (float(x) for x in sums[:3])
                if not (math.isfinite(loss_v) and math.isfinite(grad_norm)):
                    what = "loss" if not math.isfinite(loss_v) else "gradient norm"
                    optimizer.zero_grad(set_to_none=True)
                    raise TrainingDiverged(
                        f"{what} is {loss_v if what == 'loss' else grad_norm} at step {step}: stopped before updating the weights; "
                        f"last good checkpoint: {last_good()} (lower --lr and run again, or --resume)"
                    )
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                dt = time.perf_counter() - t0
                row = {"step": step, "loss": loss_v, "lr": lr_now, "grad_norm": grad_norm,
                       "tokens_per_second": tokens_per_step / dt if dt > 0 else None, "world_size": world,
                       "tokens": step * tokens_per_step, "data_fingerprint": fp, "epoch": stream.epoch}
                if teacher is not None:
                    row["lm_loss"], row["distill_loss"] = lm_v, kd_v
                if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
                    ev = heldout_loss(model, eval_set, micro_batch=max(micro, 1), accelerator=accelerator, autocast=autocast)
                    row["eval_loss"], row["eval_perplexity"] = ev, math.exp(min(ev, 700))
                log(row)
                last_row = row
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss_v:.4f}", lr=f"{lr_now:.2e}")
                if cfg.save_every and step % cfg.save_every == 0:
                    save_checkpoint_state(step)
                if float(sums[3]) > 0:
                    ck = _checkpoints(out)[-1][1] if (cfg.save_every and step % cfg.save_every == 0) else save_checkpoint_state(step)
                    raise TrainingInterrupted(f"interrupted at step {step}/{cfg.steps}: saved {ck}; continue with --resume")
                if step_delay:
                    time.sleep(step_delay)
    finally:
        if bar is not None:
            bar.close()
        if log_f is not None:
            log_f.close()

    wall = time.perf_counter() - t_start
    rows = _read_log(out) if main else []
    if last_row is None:  # resumed at the last step: nothing left to train
        last_row = next((r for r in reversed(rows) if r.get("step") == cfg.steps), None) or {}
        if "eval_loss" not in last_row:
            ev = heldout_loss(model, eval_set, micro_batch=max(micro, 1), accelerator=accelerator, autocast=autocast)
            last_row = dict(last_row, eval_loss=ev)
    final_eval = last_row["eval_loss"]
    summary = {
        "model": cfg.model, "out": str(out), "data": cfg.data, "steps": cfg.steps, "world_size": world,
        "distributed": accelerator.distributed_type.value if hasattr(accelerator.distributed_type, "value") else str(accelerator.distributed_type),
        "global_batch": cfg.batch_size, "seq_len": seq_len, "tokens": cfg.steps * tokens_per_step,
        "trainable": cfg.trainable, "trainable_parameters": n_trainable, "parameters": n_params,
        "distill_from": cfg.distill_from, "resumed_from_step": start_step if resume_from is not None else None,
        "initial_eval_loss": initial_eval, "final_eval_loss": final_eval,
        "initial_perplexity": math.exp(min(initial_eval, 700)) if initial_eval is not None else None,
        "final_perplexity": math.exp(min(final_eval, 700)),
        "final_train_loss": last_row.get("loss"), "wall_seconds": wall,
    }

    # ---- final output: the model in convert's format, written beside and moved in atomically ----
    accelerator.wait_for_everyone()
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        state = accelerator.get_state_dict(model)
        final_model = None
        if main:
            final_model = load_model(resolved, dtype=param_dtype, device="cpu", task="causal-lm", config=config)
            final_model.load_state_dict(state)
    else:
        final_model = accelerator.unwrap_model(model) if main else None
    if main:
        final_model = final_model.to("cpu")
        src_dtype = _source_dtype(config)
        if cfg.dtype == "auto" and src_dtype in (torch.float16, torch.bfloat16):
            final_model = final_model.to(src_dtype)  # keep the source's storage dtype
        for p in final_model.parameters():
            p.requires_grad_(True)
        record = dict(cfg.trajectory(), world_size=world, distributed=summary["distributed"], save_every=cfg.save_every, eval_every=cfg.eval_every,
                      eval_tokens=cfg.eval_tokens, log=LOG_FILE,
                      final_metrics={k: summary[k] for k in ("initial_eval_loss", "final_eval_loss", "initial_perplexity",
                                                             "final_perplexity", "final_train_loss", "tokens", "wall_seconds",
                                                             "trainable_parameters")})
        _write_final(final_model, tokenizer, out, {"finetune": record})
        saved = json.loads(run_file.read_text())
        saved.update(status="finished", summary=summary)
        _atomic_write_text(run_file, json.dumps(saved, indent=2, default=_json_default))
        # only now: a kill before the status is written must still find checkpoints to resume from
        if not cfg.keep_checkpoints_after_finish:
            shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    accelerator.wait_for_everyone()
    return summary


def _write_final(model, tokenizer, out: Path, manifest_updates: dict) -> None:
    """Write the model with save_checkpoint into a fresh sibling directory, then move its files into
    OUT (which already holds the log and run file), ``config.json`` last: a loader never sees a
    half-written model, and a kill during the move leaves no config.json, so --resume redoes it."""
    from normswap.checkpoint.write import save_checkpoint

    staging = out.parent / f".{out.name}.final-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    save_checkpoint(model, staging, tokenizer=tokenizer, manifest_updates=manifest_updates)
    names = sorted(p.name for p in staging.iterdir())
    for name in [n for n in names if n != "config.json"] + (["config.json"] if "config.json" in names else []):
        dest = out / name
        if dest.is_dir():
            shutil.rmtree(dest)
        os.replace(staging / name, dest)
    shutil.rmtree(staging, ignore_errors=True)
