"""The measurements of an evaluation: small functions over all models, each returning typed records.

Every measurement reads one :class:`Run` (the loaded models, the text, the configuration) and
returns ``{model name: record}`` plus the top-level keys it adds to results.json. A record's
``row()`` is its share of the model's results.json row (docs/results-schema.md: those keys are a
contract); a measurement that does not run still contributes its empty record's row, so every row
has the same keys. Which measurements run is chosen by the models' kind (evaluate/kinds.py) and the
configuration (evaluate/config.py); ``evaluate/side_by_side.py`` runs them in :data:`MEASUREMENTS` order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from normswap.evaluate.config import EvalConfig


@dataclass
class Run:
    """What every measurement reads."""

    entries: list  # ModelEntry (evaluate/side_by_side.py), in report order
    config: EvalConfig  # seq_len and stride resolved
    text: str  # the (capped) evaluation text, the same for every model
    group: str  # causal-lm or encoder (kinds.GROUP)
    baseline: str | None
    device: str
    seed: int
    lm_eval_log: Path
    say: Callable[[str], None]
    load_again: Callable | None = None  # ModelEntry -> a second copy of its model, loaded from its spec


class Record:
    def row(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------ perplexity
@dataclass
class PerplexityRecord(Record):
    perplexity: float | None = None
    bits_per_byte: float | None = None
    word_perplexity: float | None = None
    perplexity_detail: dict | None = None  # tokens, nll_nats, windows
    # against the baseline: {perplexity, bits_per_byte: {low, high, level, blocks, method}} of the
    # ratio (evaluate/quality_intervals.py); None for the baseline and without one
    quality_intervals: dict | None = None


def measure_perplexity(run: Run):
    import torch

    from normswap.evaluate.perplexity import perplexity
    from normswap.evaluate.quality_intervals import ratio_intervals

    cfg, out, token_nll = run.config, {}, {}
    for e in run.entries:
        run.say(f"perplexity: {e.name}")
        token_nll[e.name] = []
        p = perplexity(
            e.model,
            e.tokenizer,
            run.text,
            seq_len=cfg.seq_len,
            stride=cfg.stride,
            batch_size=cfg.batch_size,
            token_nll=token_nll[e.name],
        )
        out[e.name] = PerplexityRecord(
            p.perplexity,
            p.bits_per_byte,
            p.word_perplexity,
            {"tokens": p.tokens, "nll_nats": p.nll_nats, "windows": p.windows},
        )
    if run.baseline in token_nll:
        base = torch.cat(token_nll[run.baseline])
        n_bytes = len(run.text.encode("utf-8"))
        for name, pieces in token_nll.items():
            if name != run.baseline:
                out[name].quality_intervals = ratio_intervals(torch.cat(pieces), base, n_bytes=n_bytes)
    return out, {}


# ----------------------------------------------------------------------------- diagnostics
@dataclass
class DiagnosticsRecord(Record):
    diagnostics: dict | None = None  # loss, grad_norm, batch_shape, layers


DIAGNOSTICS_BATCH = 4  # rows of seq_len tokens in the fixed batch


def measure_diagnostics(run: Run):
    from normswap.evaluate.diagnostics import diagnostics, fixed_batch

    out = {}
    for e in run.entries:
        if getattr(e.model, "is_onnx", False):  # a graph has no backward: the empty record (report: not measured)
            out[e.name] = DiagnosticsRecord()
            continue
        run.say(f"diagnostics: {e.name}")
        out[e.name] = DiagnosticsRecord(
            diagnostics(e.model, fixed_batch(e.tokenizer, run.text, DIAGNOSTICS_BATCH, run.config.seq_len))
        )
    return out, {}


# -------------------------------------------------------------------------------- lm-eval
@dataclass
class TasksRecord(Record):
    tasks: dict = field(default_factory=dict)  # {task: {metric: value}}
    task_crosscheck: dict | None = None  # normswap's own number on lm-eval's windows (present when tasks ran)

    def row(self) -> dict:
        return {"tasks": self.tasks} if self.task_crosscheck is None else asdict(self)


def measure_tasks(run: Run):
    from normswap.evaluate.lm_eval_adapter import crosscheck, run_tasks
    from normswap.model_facts import context_length

    cfg, out = run.config, {}
    for e in run.entries:
        if getattr(e.model, "is_onnx", False):  # only where a recipe lets ONNX rows in (side_by_side.evaluate)
            out[e.name] = TasksRecord()
            continue
        run.say(f"lm-eval {','.join(cfg.tasks)}: {e.name} (its output: {run.lm_eval_log})")
        window = context_length(e.model) or 2048  # lm-eval's own default when the config names none
        scores = run_tasks(
            e.model,
            e.tokenizer,
            cfg.tasks,
            batch_size=cfg.batch_size,
            max_length=window,
            limit=cfg.lm_eval_limit,
            device=run.device,
            log_path=run.lm_eval_log,
        )
        # normswap's own number on the very windows lm-eval scored, so the report can show that the
        # two agree (and explain why its headline perplexity differs)
        checks = {
            t: crosscheck(e.model, e.tokenizer, t, window=window, limit=cfg.lm_eval_limit, batch_size=cfg.batch_size)
            for t in cfg.tasks
        }
        out[e.name] = TasksRecord(scores, {t: c for t, c in checks.items() if c is not None})
    return out, {"lm_eval_log": str(run.lm_eval_log)}


# ---------------------------------------------------------------------------------- speed
@dataclass
class SpeedRecord(Record):
    tokens_per_second: dict = field(default_factory=dict)  # forward, train_step, generate, prefill, decode
    norm_time_share: float | None = None
    norm_time: dict | None = None
    speed_setup: dict | None = None  # per model: calls, raw per-repeat samples (present when measured)

    def row(self) -> dict:
        row = asdict(self)
        if self.speed_setup is None:
            del row["speed_setup"]
        return row


NULL_CONTROL_SUFFIX = " (null control)"


def null_control_model(run: Run, entry):
    """A second, separately allocated copy of the baseline: loaded again from its spec (as a second
    run would load it) when the run can, else copied in memory."""
    import copy

    if entry.spec and run.load_again is not None:
        return run.load_again(entry)
    return copy.deepcopy(entry.model)


def measure_speed(run: Run):
    from normswap.evaluate.kinds import SPEED_BY_GROUP
    from normswap.evaluate.throughput import measure_speed_run

    cfg = run.config
    setup = dataclasses.replace(
        cfg.speed_setup, batch_size=cfg.batch_size, seq_len=cfg.seq_len, kinds=SPEED_BY_GROUP[run.group]
    )
    base = next((e for e in run.entries if e.name == run.baseline), None)
    control = None
    if base is not None and setup.null_control:
        run.say(f"speed: loading {base.name} a second time (the null control)")
        control = (base.name + NULL_CONTROL_SUFFIX, null_control_model(run, base))
    run.say("speed: interleaved over models" + (" and the null control" if control else ""))
    measured = measure_speed_run(
        [(e.name, e.model) for e in run.entries], setup, progress=run.say, null_control=control, baseline=run.baseline
    )
    top = {
        "speed_setup": setup.to_dict(),
        "speed_noise": measured["machine"],
        "speed_timing": measured["timing"],  # per kind: the instrument's stop reason, pairs, seconds
    }  # side_by_side.py adds the null control's verdict
    if control is not None:
        top["null_control"] = {"name": control[0], "of": base.name, **measured["null_control"]}
    return {name: SpeedRecord(**m) for name, m in measured["models"].items()}, top


# --------------------------------------------------------------------------------- memory
@dataclass
class MemoryRecord(Record):
    peak_memory_bytes: int | None = None
    memory_detail: dict | None = field(
        default_factory=lambda: {
            "method": "not measured",
            "reason": "not requested (--no-memory, or eval.memory: false in a recipe)",
        }
    )


def measure_memory(run: Run):
    from normswap.evaluate.memory import peak_memory
    from normswap.model_facts import context_length

    cfg, out = run.config, {}
    for e in run.entries:
        if getattr(e.model, "is_onnx", False):
            from normswap.evaluate.onnx_model import NOT_MEASURED

            out[e.name] = MemoryRecord(
                None, {"method": "not measured", "reason": f"ONNX model: {NOT_MEASURED['memory']}"}
            )
            continue
        run.say(f"peak memory: {e.name}")
        seq_len = min(cfg.seq_len, context_length(e.model) or cfg.seq_len)
        detail = peak_memory(e.model, cfg.batch_size, seq_len)
        out[e.name] = MemoryRecord(
            detail.pop("peak_memory_bytes"), {"batch_size": cfg.batch_size, "seq_len": seq_len, **detail}
        )
    return out, {}


# ------------------------------------------------------------------------------- fidelity
@dataclass
class FidelityRecord(Record):
    fidelity: dict | None = None  # hidden/embedding cosines, masked-token loss vs the reference


def measure_fidelity(run: Run):
    from normswap.evaluate.fidelity import fidelity

    reference = run.baseline or run.entries[0].name
    measured, setup = fidelity(
        run.entries,
        reference,
        run.text,
        max_tokens=run.config.fidelity_tokens,
        seq_len=run.config.seq_len,
        seed=run.seed,
        progress=run.say,
    )
    return {name: FidelityRecord(m) for name, m in measured.items()}, {"fidelity_setup": setup}


@dataclass(frozen=True)
class Measurement:
    name: str  # as in kinds.MEASURABLE
    empty: type  # its record when it does not run
    measure: Callable[[Run], tuple[dict[str, Record], dict]]
    reads_text: bool  # needs the evaluation text


# The order they run in: speed after everything that reads weights (its train steps touch optimizer
# state, with lr=0 so the weights stay put anyway), then peak memory.
MEASUREMENTS = (
    Measurement("perplexity", PerplexityRecord, measure_perplexity, True),
    Measurement("diagnostics", DiagnosticsRecord, measure_diagnostics, True),
    Measurement("tasks", TasksRecord, measure_tasks, False),
    Measurement("speed", SpeedRecord, measure_speed, False),
    Measurement("memory", MemoryRecord, measure_memory, False),
    Measurement("fidelity", FidelityRecord, measure_fidelity, True),
)
