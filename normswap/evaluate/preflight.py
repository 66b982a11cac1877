"""Everything an evaluation can check from its options, the models' configs and tokenizers, and the
data — before any model's weights are loaded or anything is timed.

A long evaluation must not fail after minutes for a reason its inputs already showed (a missing
``--data`` file, a split too short for the encoder fidelity's 510-token rows, lm-eval tasks asked of
an encoder, a ``--seq-len`` longer than a model's context). :func:`describe` reads each model's
config and tokenizer (seconds, not the weights) and finds its kind from a weightless skeleton on
the meta device; :func:`prepare` resolves the configuration, chooses the measurements, reads and
caps the text, and checks it suffices for each chosen measurement. ``evaluate()`` then runs on the
:class:`Prepared` result, so the text is read once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from normswap.errors import NormswapError
from normswap.evaluate.config import EvalConfig
from normswap.evaluate.kinds import PROBE_INPUT, READS_TEXT, common_group, measurements_for


@dataclass
class ModelFacts:
    """What the pre-flight knows of a model without its weights."""

    name: str
    config: object  # transformers config
    tokenizer: object | None
    kind: str | None  # evaluate/kinds.py; None when no skeleton could be built (checked after loading)
    path: str | None  # local directory (its manifest says whether normswap fine-tuned it)


@dataclass
class Prepared:
    config: EvalConfig  # seq_len and stride resolved
    group: str
    chosen: list[str]
    text: str
    data: dict | None  # results.json's data block (None: no text read)
    kinds: dict  # {name: kind} the choice was made from
    notes: list = dataclasses.field(default_factory=list)  # what was asked for but skipped, and why


def _skeleton_kind(config, task: str) -> str | None:
    """The model's kind from an instance on the meta device (no weights, no memory); None if the
    class cannot be built that way (the kind is then checked once the model has loaded)."""
    import torch

    from normswap.checkpoint.load import model_class_for, remote_code_trusted
    from normswap.evaluate.kinds import model_kind

    try:
        cls = model_class_for(config, task)
        with torch.device("meta"):
            if hasattr(cls, "from_config"):  # an Auto class
                model = cls.from_config(config, trust_remote_code=remote_code_trusted(config))
            else:
                model = cls(config)
        return model_kind(model)
    except Exception:  # noqa: BLE001 - any failure only postpones the check to the loaded model
        return None


def describe(planned, progress=None) -> list[ModelFacts]:
    """:class:`ModelFacts` of each (name, spec): config, tokenizer and kind, no weights."""
    from normswap.checkpoint.load import (
        check_buildable,
        is_causal_lm,
        is_local,
        load_config,
        load_tokenizer,
        resolve,
    )

    facts = []
    for name, spec in planned:
        if progress:
            progress(f"checking {name} ({spec})")
        resolved = resolve(spec)
        config = load_config(resolved)
        check_buildable(resolved, config, str(spec))  # before the skeleton below is built from it
        kind = _skeleton_kind(config, "causal-lm" if is_causal_lm(config) else "auto")
        tokenizer = None if kind == PROBE_INPUT else load_tokenizer(spec)
        facts.append(
            ModelFacts(name, config, tokenizer, kind, str(Path(resolved).resolve()) if is_local(resolved) else None)
        )
    return facts


def facts_of(entries) -> list[ModelFacts]:
    """:class:`ModelFacts` of loaded entries (evaluate/side_by_side.py's ModelEntry)."""
    from normswap.evaluate.kinds import model_kind

    return [
        ModelFacts(
            e.name,
            e.model.config,
            e.tokenizer,
            model_kind(e.model),
            e.path if e.path and Path(e.path).is_dir() else None,
        )
        for e in entries
    ]


def prepare(
    facts: list[ModelFacts], cfg: EvalConfig, *, data="embedded", baseline_name=None, progress=None
) -> Prepared:
    """Resolve ``cfg`` against the models, choose the measurements, read the text and check that it
    suffices for each of them; one-line NormswapError otherwise. Nothing here loads weights."""
    from normswap.evaluate.measurements import MEASUREMENTS
    from normswap.model_facts import context_length

    say = progress or (lambda msg: None)
    if not facts:
        raise NormswapError("give at least one model to evaluate")
    kinds = {f.name: f.kind for f in facts if f.kind is not None}
    group = common_group(kinds) if kinds else "causal-lm"
    wanted = {
        "perplexity": cfg.perplexity,
        "diagnostics": cfg.diagnostics,
        "tasks": bool(cfg.tasks),
        "speed": cfg.speed,
        "memory": cfg.memory,
        "fidelity": cfg.fidelity,
    }
    chosen = measurements_for(group, wanted, list(kinds) or [f.name for f in facts])
    notes = _skip_lm_eval(chosen, cfg, say)
    contexts = [c for c in (context_length(f.config) for f in facts) if c]
    max_ctx = min(contexts) if contexts else None
    seq_len = cfg.seq_len or min(max_ctx or 512, 512)
    if max_ctx is not None and seq_len > max_ctx:
        raise NormswapError(f"--seq-len {seq_len} is longer than the shortest model context ({max_ctx} tokens)")
    cfg = dataclasses.replace(cfg, seq_len=seq_len, stride=cfg.stride or max(seq_len // 2, 1))
    need_text = READS_TEXT[group] and any(m.reads_text for m in MEASUREMENTS if m.name in chosen)
    if not need_text:
        return Prepared(cfg, group, chosen, "", None, kinds, notes)
    text, block = read_text(facts, cfg, data, baseline_name, say)
    check_text(facts, cfg, chosen, text, block, baseline_name)
    return Prepared(cfg, group, chosen, text, block, kinds, notes)


def _skip_lm_eval(chosen: list[str], cfg: EvalConfig, say) -> list[str]:
    """lm-eval is optional: where it cannot run, the tasks leave ``chosen`` and a one-line note says so
    (shown with the report's warnings) instead of the evaluation failing once the models are loaded."""
    from normswap.evaluate.lm_eval_adapter import unavailable

    missing = unavailable() if "tasks" in chosen else None
    if missing is None:
        return []
    chosen.remove("tasks")
    note = f"lm-eval tasks {', '.join(cfg.tasks)} not scored: {missing}"
    say(note)
    return [note]


def read_text(facts, cfg: EvalConfig, data, baseline_name, say) -> tuple[str, dict]:
    """The evaluation text (held-out split chosen, capped once) and results.json's ``data`` block."""
    from normswap.data import default_eval_split, load_documents
    from normswap.evaluate import heldout
    from normswap.evaluate.perplexity import held_out_text

    split, seen = heldout.choose_split(data, cfg.split, default_eval_split(str(data)), {f.name: f.path for f in facts})
    if seen and split != (cfg.split or default_eval_split(str(data))):
        say(
            f"{', '.join(s['model'] for s in seen)} fine-tuned on {data}: "
            f"reading its {split} split, which fine-tuning never saw"
        )
    say(f"loading {data} ({split} split)")
    documents = 0

    def counted(docs):
        nonlocal documents
        for doc in docs:
            documents += 1
            yield doc

    # The cap is applied once, in characters, with the baseline's (or first model's) tokenizer,
    # so every model reads exactly the same text.
    cap = next((f for f in facts if f.name == baseline_name), facts[0])
    text, truncated, full_chars = held_out_text(counted(load_documents(data, split)), cap.tokenizer, cfg.max_tokens)
    held = heldout.held_out(split, seen)
    if held is False:
        say(
            f"WARNING: the {split} split of {data} includes text "
            f"{', '.join(s['model'] for s in seen)} was fine-tuned on: "
            "not held-out (drop --split for the part fine-tuning never saw)"
        )
    available = sum(1 for _ in load_documents(data, "all")) if seen else None
    block = {
        "spec": str(data),
        "split": split,
        "characters": len(text),
        "characters_available": full_chars,
        "bytes": len(text.encode("utf-8")),
        "words": len(text.split()),
        "max_tokens": cfg.max_tokens or None,
        "truncated": truncated,
        "cap_tokenizer_of": cap.name if truncated else None,
        "seq_len": cfg.seq_len,
        "stride": cfg.stride,
        "batch_size": cfg.batch_size,
        "documents": documents,
        "documents_available": available,
        "held_out": held,
        "seen_in_finetune": seen,
    }
    block["caption"] = heldout.caption(block)
    return text, block


def check_text(facts, cfg: EvalConfig, chosen, text: str, block: dict, baseline_name) -> None:
    """Enough text for every chosen measurement, counted with the tokenizer that will read it."""
    from normswap.evaluate.fidelity import require_fidelity_text

    where = f"{block['spec']} ({block['split']} split{', capped' if block['truncated'] else ''})"
    if not text.strip():
        raise NormswapError(f"{where} holds no text to evaluate")
    if "fidelity" in chosen:
        ref = next((f for f in facts if f.name == baseline_name), facts[0])
        if ref.kind != PROBE_INPUT and ref.tokenizer is not None:
            require_fidelity_text(ref.tokenizer, text, max_tokens=cfg.fidelity_tokens, seq_len=cfg.seq_len, where=where)
