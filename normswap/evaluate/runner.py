"""Evaluate several models side by side and assemble ``results.json`` (docs/results-schema.md).

Order of work: load every model; per model, perplexity, diagnostics and lm-eval tasks; then the
speed measurements for all models together (interleaved, see speed.py); then peak memory. Speed
runs last because its train steps touch optimizer state (with lr=0, so weights stay put anyway).
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from normswap.errors import NormswapError
from normswap.evaluate.kinds import PROBE_INPUT, common_group, model_kind
from normswap.evaluate.norms import hidden_size_of, norm_kind, norm_modules
from normswap.evaluate.perplexity import model_context, truncate_text
from normswap.evaluate.perplexity import perplexity as run_perplexity
from normswap.evaluate.stats import METHOD as RATIO_METHOD
from normswap.evaluate.stats import ratio_intervals

_LABEL = re.compile(r"^[A-Za-z0-9_.\- ]+$")
DEFAULT_MAX_TOKENS = 65536


@dataclass
class ModelEntry:
    name: str
    spec: str | None = None
    model: object = None
    tokenizer: object = None
    path: str | None = None
    info: dict = field(default_factory=dict)


def split_label(arg: str) -> tuple[str | None, str]:
    """``NAME=SPEC`` -> (NAME, SPEC); anything else -> (None, arg)."""
    if "=" in arg and not Path(arg).exists():
        name, spec = arg.split("=", 1)
        if name and spec and _LABEL.match(name):
            return name.strip(), spec
    return None, arg


def default_name(spec: str) -> str:
    if spec.startswith("normswap:"):
        return spec[len("normswap:"):]
    p = Path(spec)
    if p.exists():
        return p.resolve().name
    return spec


def versions() -> dict:
    import transformers

    import normswap

    v = {
        "normswap": normswap.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }
    try:
        from importlib.metadata import version

        v["lm_eval"] = version("lm_eval")
    except Exception:
        v["lm_eval"] = None
    v["cuda"] = torch.version.cuda
    return v


def device_description(device: str) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    cpu = platform.processor() or platform.machine()
    return f"cpu ({cpu}, {torch.get_num_threads()} threads)"


def _model_info(entry: ModelEntry) -> dict:
    """What kind of model this is: original, converted (exact/approx) or fine-tuned, with its log."""
    config = entry.model.config
    block = getattr(config, "normswap", None)
    block = dict(block) if isinstance(block, dict) else None
    manifest = None
    if entry.path and Path(entry.path).is_dir():
        try:
            from normswap.checkpoint.manifest import read_manifest

            manifest = read_manifest(entry.path)
        except ImportError:
            manifest = None
        except NormswapError:
            manifest = None
    finetuned = bool(manifest and manifest.get("finetune")) or bool(entry.path and (Path(entry.path) / "train_log.jsonl").is_file())
    if finetuned:
        kind = "fine-tuned"
    elif block:
        kind = f"converted ({block.get('mode', '?')})"
    else:
        kind = "original"
    found = norm_modules(entry.model)
    norms = sorted({type(m).__name__ for _, m in found})
    # The usual per-token arithmetic of one norm over d features: LayerNorm ~8d (mean, subtract,
    # square, mean, scale, gamma, beta), RMSNorm ~4d (square, mean, scale, gamma).
    norm_flops = sum((8 if norm_kind(m) == "layer" else 4) * (hidden_size_of(m) or 0) for _, m in found)
    params = int(sum(p.numel() for p in entry.model.parameters()))
    info = {
        "kind": kind,
        "model_kind": model_kind(entry.model),
        "architecture": (getattr(config, "architectures", None) or [type(entry.model).__name__])[0],
        "parameters": params,
        "norm_classes": norms,
        "norm_layers": len(found),
        "flops_per_token": {"norms": norm_flops, "model_estimate": 2 * params},
        "normswap": {k: block.get(k) for k in ("mode", "source", "format_version", "version") if k in block} if block else None,
        "finetune": read_train_log(Path(entry.path) / "train_log.jsonl") if entry.path else None,
    }
    if manifest and manifest.get("finetune"):
        info["finetune_manifest"] = manifest.get("finetune")
    return info


def read_train_log(path: Path, max_points: int = 400) -> dict | None:
    """Loss curve from ``normswap finetune``'s train_log.jsonl, thinned to ``max_points``."""
    from normswap.finetune.run_dir import read_log_rows

    if not path.is_file():
        return None
    rows = read_log_rows(path)
    train = [(r["step"], r["loss"]) for r in rows if "step" in r and r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "step" in r and r.get("eval_loss") is not None]
    every = max(1, len(train) // max_points)
    thinned = train[::every]
    if train and thinned[-1] != train[-1]:
        thinned.append(train[-1])
    # With distillation, `loss` is the mixed objective: keep its parts apart (KL and cross-entropy
    # differ by orders of magnitude and must not share an axis).
    by_step = {r["step"]: r for r in rows if "step" in r}
    parts = {key: [by_step[s].get(key) for s, _ in thinned] for key in ("lm_loss", "distill_loss")
             if any(by_step[s].get(key) is not None for s, _ in thinned)}
    return {
        "train_log": str(path),
        "steps": [s for s, _ in thinned],
        "loss": [v for _, v in thinned],
        **parts,
        "eval_steps": [s for s, _ in evals],
        "eval_loss": [v for _, v in evals],
        "final_loss": train[-1][1] if train else None,
        "final_eval_loss": evals[-1][1] if evals else None,
        "total_steps": train[-1][0] if train else None,
    }


def _ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def ratios(model: dict, base: dict) -> dict:
    """model / baseline for every number that has one (>1: higher than the baseline)."""
    tps_m = model.get("tokens_per_second") or {}
    tps_b = base.get("tokens_per_second") or {}
    return {
        "perplexity": _ratio(model.get("perplexity"), base.get("perplexity")),
        "bits_per_byte": _ratio(model.get("bits_per_byte"), base.get("bits_per_byte")),
        "word_perplexity": _ratio(model.get("word_perplexity"), base.get("word_perplexity")),
        "tokens_per_second": {k: _ratio(tps_m.get(k), tps_b.get(k)) for k in ("forward", "train_step", "generate", "prefill", "decode")},
        "peak_memory_bytes": _ratio(model.get("peak_memory_bytes"), base.get("peak_memory_bytes")),
        "norm_time_share": _ratio(model.get("norm_time_share"), base.get("norm_time_share")),
    }


def plan_entries(specs, baseline=None) -> tuple[list[tuple[str, str]], str | None]:
    """(name, spec) of every model to load, and the baseline's name; nothing is loaded.

    ``baseline`` is one of the MODELs (by name or spec) or another spec, which is added first. A
    baseline that is neither, but close to a MODEL's name, is a typo: refused with a hint.
    """
    from normswap.checkpoint.load import resolve

    labelled = [split_label(s) for s in specs]
    if not labelled:
        raise NormswapError("give at least one model to evaluate")
    given = [label or default_name(spec) for label, spec in labelled]
    baseline_name = None
    if baseline is not None:
        b_label, b_spec = split_label(baseline)
        for label, spec in labelled:
            if baseline in (label, spec) or (b_label and b_label == label) or b_spec == spec:
                baseline_name = label or default_name(spec)
                break
        else:
            if not (b_spec.startswith("normswap:") or Path(b_spec).expanduser().exists()):
                import difflib

                close = difflib.get_close_matches(b_spec, given, n=1, cutoff=0.6)
                what = f"--baseline {baseline} names none of the MODELs ({', '.join(given)})"
                if close:
                    raise NormswapError(f"{what}; did you mean --baseline {close[0]}?")
                try:
                    resolve(b_spec)
                except NormswapError as e:
                    raise NormswapError(f"{what}, and as a model of its own: {e}") from None
            labelled.insert(0, (b_label or "baseline", b_spec))
            baseline_name = b_label or "baseline"
    names = [label or default_name(spec) for label, spec in labelled]
    for i, name in enumerate(names):
        if name in names[:i]:  # a silent rename would make --baseline and the report ambiguous
            first = labelled[names.index(name)][1]
            raise NormswapError(f"two models are named {name!r} ({first} and {labelled[i][1]}); give each its own label as NAME=SPEC")
    return [(name, spec) for name, (_, spec) in zip(names, labelled)], baseline_name


def load_entries(specs, *, baseline=None, device="cpu", dtype=torch.float32, progress=None) -> tuple[list[ModelEntry], str | None]:
    """Load ``specs`` (``SPEC`` or ``NAME=SPEC``); add ``baseline`` when it is not one of them."""
    import normswap
    from normswap.checkpoint.load import is_causal_lm, is_local, load_config, resolve

    planned, baseline_name = plan_entries(specs, baseline)
    entries = []
    for name, spec in planned:
        if progress:
            progress(f"loading {name} ({spec})")
        resolved = resolve(spec)
        # a causal LM as its LM-head class; anything else (an encoder) as the class it names
        task = "causal-lm" if is_causal_lm(load_config(resolved)) else "auto"
        model = normswap.load_model(spec, dtype=dtype, device=device, task=task)
        # image / audio models are compared on probe inputs: a tokenizer is neither needed nor always there
        tok = None if model_kind(model) == PROBE_INPUT else normswap.load_tokenizer(spec)
        entries.append(ModelEntry(name=name, spec=spec, model=model, tokenizer=tok,
                                  path=str(Path(resolved).resolve()) if is_local(resolved) else resolved))
        common_group({e.name: model_kind(e.model) for e in entries})  # refuse a mixed list before loading the rest
    return entries, baseline_name


def evaluate(entries: list[ModelEntry], *, data="embedded", split="test", text=None, baseline_name=None, tasks=None,
             device="cpu", dtype=torch.float32, seq_len=None, stride=None, batch_size=8, max_tokens=DEFAULT_MAX_TOKENS,
             perplexity=True, diagnostics=True, speed=True, speed_options=None, memory=True, diagnostics_batch=4,
             lm_eval_limit=None, fidelity=None, fidelity_tokens=8192, seed=0, progress=None, lm_eval_log=None) -> dict:
    """Run every measurement on ``entries`` and return the results dict (schema: docs/results-schema.md).

    Encoders (no causal-LM head) get fidelity to the baseline (or the first model) instead of
    perplexity, diagnostics and lm-eval tasks; ``fidelity`` None means: for encoders only.
    """
    from normswap.evaluate.diagnostics import diagnostics as run_diagnostics
    from normswap.evaluate.diagnostics import fixed_batch
    from normswap.evaluate.lm_eval_adapter import crosscheck, default_log, parse_tasks, run_tasks
    from normswap.evaluate.memory import peak_memory
    from normswap.evaluate.speed import SpeedConfig, measure_speed

    say = progress or (lambda msg: None)
    if not entries:
        raise NormswapError("give at least one model to evaluate")
    lm_eval_log = Path(lm_eval_log) if lm_eval_log else default_log()
    kinds = {e.name: model_kind(e.model) for e in entries}
    group = common_group(kinds)
    if group == PROBE_INPUT:
        # images / audio in, no text: fidelity to the reference on probe inputs is what is defined
        if parse_tasks(tasks):
            raise NormswapError(f"lm-eval tasks need text; these models read images or audio ({', '.join(kinds)}): drop --tasks")
        perplexity = diagnostics = speed = memory = False  # speed and memory runs feed token ids
        fidelity = True
    encoders = group == "encoder"
    if encoders:
        if parse_tasks(tasks):
            raise NormswapError("lm-eval tasks score causal LMs; these models are encoders (drop --tasks)")
        perplexity = diagnostics = False  # not defined without a next-token head
        speed_options = dict(speed_options or {}, kinds=("forward", "train_step", "norm_share"))  # nothing to generate
    if fidelity is None:
        fidelity = encoders
    contexts = [c for c in (model_context(e.model) for e in entries) if c]
    max_ctx = min(contexts) if contexts else None
    if seq_len is None:
        seq_len = min(max_ctx or 512, 512)
    if max_ctx is not None and seq_len > max_ctx:
        raise NormswapError(f"--seq-len {seq_len} is longer than the shortest model context ({max_ctx} tokens)")
    if stride is None:
        stride = max(seq_len // 2, 1)
    need_text = (perplexity or diagnostics or fidelity) and group != PROBE_INPUT
    if text is None and need_text:
        from normswap.data import load_text

        say(f"loading {data} ({split} split)")
        text = load_text(data, split)
    full_chars = len(text or "")
    # The cap is applied once, in characters, with the baseline's (or first model's) tokenizer,
    # so every model reads exactly the same text.
    cap_entry = next((e for e in entries if e.name == baseline_name), entries[0])
    text, truncated = truncate_text(text or "", cap_entry.tokenizer, max_tokens) if need_text and group != PROBE_INPUT else (None, False)
    dtype_name = str(dtype).replace("torch.", "")
    results = {
        "schema_version": 1,
        "device": device_description(device),
        "dtype": dtype_name,
        "data": None if not need_text else {
            "spec": str(data),
            "split": split,
            "characters": len(text),
            "characters_available": full_chars,
            "bytes": len(text.encode("utf-8")),
            "words": len(text.split()),
            "max_tokens": max_tokens or None,
            "truncated": truncated,
            "cap_tokenizer_of": cap_entry.name if truncated else None,
            "seq_len": seq_len,
            "stride": stride,
            "batch_size": batch_size,
        },
        "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "versions": versions(),
        "baseline": baseline_name,
        "models": [],
    }
    rows = []
    for e in entries:
        row = {"name": e.name, "path": e.path, "spec": e.spec}
        row.update(_model_info(e))
        row.update({"perplexity": None, "bits_per_byte": None, "word_perplexity": None, "perplexity_detail": None})
        if perplexity:
            say(f"perplexity: {e.name}")
            ppl = run_perplexity(e.model, e.tokenizer, text, seq_len=seq_len, stride=stride, batch_size=batch_size)
            row.update({
                "perplexity": ppl.perplexity,
                "bits_per_byte": ppl.bits_per_byte,
                "word_perplexity": ppl.word_perplexity,
                "perplexity_detail": {"tokens": ppl.tokens, "nll_nats": ppl.nll_nats, "windows": ppl.windows},
            })
        row["diagnostics"] = None
        if diagnostics:
            say(f"diagnostics: {e.name}")
            row["diagnostics"] = run_diagnostics(e.model, fixed_batch(e.tokenizer, text, diagnostics_batch, seq_len))
        row["tasks"] = {}
        if parse_tasks(tasks):
            say(f"lm-eval {tasks}: {e.name} (its output: {lm_eval_log})")
            window = model_context(e.model) or 2048  # lm-eval's own default when the config names none
            row["tasks"] = run_tasks(e.model, e.tokenizer, tasks, batch_size=batch_size, max_length=window,
                                     limit=lm_eval_limit, device=device, log_path=lm_eval_log)
            results["lm_eval_log"] = str(lm_eval_log)
            # normswap's own number on the very windows lm-eval scored, so the report can show
            # that the two agree (and explain why its headline perplexity differs).
            checks = {t: crosscheck(e.model, e.tokenizer, t, window=window, limit=lm_eval_limit, batch_size=batch_size)
                      for t in parse_tasks(tasks)}
            row["task_crosscheck"] = {t: c for t, c in checks.items() if c is not None}
        rows.append(row)
    if speed:
        cfg = SpeedConfig(batch_size=batch_size, seq_len=seq_len, **(speed_options or {}))
        say("speed: interleaved over models")
        measured = measure_speed([(e.name, e.model) for e in entries], cfg, progress=say)
        results["speed_setup"] = cfg.to_dict()
        for row in rows:
            row.update(measured[row["name"]])
    else:
        for row in rows:
            row.update({"tokens_per_second": {}, "norm_time_share": None, "norm_time": None})
    for e, row in zip(entries, rows):
        row["peak_memory_bytes"] = None
        row["memory_detail"] = None
        if not memory:
            row["memory_detail"] = {"method": "not measured", "reason": "not requested (--no-memory, or eval.memory: false in a recipe)"}
            continue
        say(f"peak memory: {e.name}")
        mem_seq = min(seq_len, model_context(e.model) or seq_len)
        detail = peak_memory(e.model, batch_size, mem_seq)
        row["peak_memory_bytes"] = detail.pop("peak_memory_bytes")
        row["memory_detail"] = {"batch_size": batch_size, "seq_len": mem_seq, **detail}
    if fidelity:
        from normswap.evaluate.fidelity import fidelity as run_fidelity

        reference = baseline_name or entries[0].name
        measured, info = run_fidelity(entries, reference, text, max_tokens=fidelity_tokens, seq_len=seq_len, seed=seed, progress=say)
        results["fidelity_setup"] = info
        for row in rows:
            row["fidelity"] = measured[row["name"]]
    base = next((r for r in rows if r["name"] == baseline_name), None)
    for row in rows:
        row["ratios"] = ratios(row, base) if base is not None else None
        row["ratio_intervals"] = ratio_intervals(row, base) if base is not None and speed else None
    if base is not None and speed:
        results["ratio_method"] = RATIO_METHOD
    results["models"] = rows
    return results


def dumps(results: dict) -> str:
    return json.dumps(results, indent=2, sort_keys=False, default=_json_default)


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, torch.dtype):
        return str(o).replace("torch.", "")
    if hasattr(o, "item"):
        return o.item()
    return str(o)

