"""Evaluate several models side by side and assemble ``results.json`` (docs/results-schema.md).

Check what can be checked without weights (evaluate/preflight.py: options, kinds, the text),
load every model (:func:`plan_entries`, then :func:`load_planned`), then :func:`evaluate`: run each
selected measurement of evaluate/measurements.py over all models, and add the ratios to the baseline.
"""

from __future__ import annotations

import datetime as _dt
import platform
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from normswap.errors import NormswapError
from normswap.evaluate.config import EvalConfig
from normswap.evaluate.kinds import PROBE_INPUT, common_group, model_kind
from normswap.evaluate.measurements import MEASUREMENTS, Run
from normswap.evaluate.model_info import model_info
from normswap.evaluate.speed_intervals import METHOD as RATIO_METHOD
from normswap.evaluate.speed_intervals import SAMPLED, null_intervals, ratio_intervals

_LABEL = re.compile(r"^[A-Za-z0-9_.\- ]+$")


@dataclass
class ModelEntry:
    name: str
    spec: str | None = None
    model: object = None
    tokenizer: object = None
    path: str | None = None


def split_label(arg: str) -> tuple[str | None, str]:
    """``NAME=SPEC`` -> (NAME, SPEC); anything else -> (None, arg)."""
    if "=" in arg and not Path(arg).exists():
        name, spec = arg.split("=", 1)
        if name and spec and _LABEL.match(name):
            return name.strip(), spec
    return None, arg


def default_name(spec: str) -> str:
    if spec.startswith("normswap:"):
        return spec[len("normswap:") :]
    p = Path(spec)
    if p.exists():
        return p.resolve().name
    return spec


def versions() -> dict:
    import transformers

    from normswap.version import __version__

    v = {
        "normswap": __version__,
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


def _ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def ratios(model: dict, base: dict) -> dict:
    """model / baseline for every number that has one (>1: higher than the baseline)."""
    tps_m = model.get("tokens_per_second") or {}
    tps_b = base.get("tokens_per_second") or {}
    # a throughput timed in pairs (normswap/timing.py): the median of its per-pair ratios, the
    # number its interval and verdict are about, rather than a ratio of two separate medians
    paired = (model.get("speed_setup") or {}).get("paired") or {}
    speed = {k: paired[k]["ratio"] if k in paired else _ratio(tps_m.get(k), tps_b.get(k)) for k in SAMPLED}
    return {
        "perplexity": _ratio(model.get("perplexity"), base.get("perplexity")),
        "bits_per_byte": _ratio(model.get("bits_per_byte"), base.get("bits_per_byte")),
        "word_perplexity": _ratio(model.get("word_perplexity"), base.get("word_perplexity")),
        "tokens_per_second": speed,
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
            raise NormswapError(
                f"two models are named {name!r} ({first} and {labelled[i][1]}); give each its own label as NAME=SPEC"
            )
    return [(name, spec) for name, (_, spec) in zip(names, labelled)], baseline_name


def load_planned(planned, *, device="cpu", dtype=torch.float32, progress=None) -> list[ModelEntry]:
    """Load each (name, spec): a causal LM as its LM-head class, anything else (an encoder) as the
    class it names; a list mixing the two is refused before the rest loads."""
    from normswap.checkpoint.load import is_causal_lm, is_local, load_config, load_model, load_tokenizer, resolve
    from normswap.evaluate.onnx_model import OnnxModel
    from normswap.export.onnx import is_onnx_dir

    entries = []
    for name, spec in planned:
        if progress:
            progress(f"loading {name} ({spec})")
        resolved = resolve(spec)
        if is_onnx_dir(resolved):  # `normswap export --format onnx`: run in onnxruntime (evaluate/onnx_model.py)
            if str(device) != "cpu" or dtype != torch.float32:
                raise NormswapError(
                    f"{name} is an ONNX export: it runs in onnxruntime on the CPU in float32 "
                    "(give --device cpu and no other --dtype)"
                )
            model = OnnxModel(resolved)
            entries.append(
                ModelEntry(
                    name=name,
                    spec=str(spec),
                    model=model,
                    tokenizer=load_tokenizer(spec),  # the one export copied beside the graph (perplexity reads it)
                    path=str(Path(resolved).resolve()),
                )
            )
            continue
        task = "causal-lm" if is_causal_lm(load_config(resolved)) else "auto"
        model = load_model(spec, dtype=dtype, device=device, task=task)
        # image / audio models are compared on probe inputs: a tokenizer is neither needed nor always there
        tok = None if model_kind(model) == PROBE_INPUT else load_tokenizer(spec)
        entries.append(
            ModelEntry(
                name=name,
                spec=str(spec),
                model=model,
                tokenizer=tok,
                path=str(Path(resolved).resolve()) if is_local(resolved) else resolved,
            )
        )
        common_group({e.name: model_kind(e.model) for e in entries})
    return entries


def evaluate(
    entries: list[ModelEntry],
    config: EvalConfig | None = None,
    *,
    data="embedded",
    baseline_name=None,
    device="cpu",
    dtype=torch.float32,
    seed=0,
    progress=None,
    lm_eval_log=None,
    prepared=None,
    onnx_rows_unmeasured=False,
) -> dict:
    """Run the measurements ``config`` selects on ``entries``; the results dict (docs/results-schema.md).

    Causal LMs get perplexity (and diagnostics, lm-eval tasks); encoders get fidelity to the
    baseline (or the first model) instead: evaluate/kinds.py says what each kind defines.
    ``prepared``: evaluate/preflight.py's checks, already run before the models loaded (the
    commands do that, so a bad option or too little text fails before any weights load); without
    it they run here. ``onnx_rows_unmeasured``: an ONNX row beside PyTorch ones (a recipe's served variant)
    gets what ONNX can be measured by and empty records, reported as not measured, for the rest (lm-eval
    tasks); without it, a run asking an ONNX export for those is refused.
    """
    from normswap.evaluate.lm_eval_adapter import default_log
    from normswap.evaluate.onnx_model import MEASURED as ONNX_MEASURED
    from normswap.evaluate.preflight import facts_of, prepare

    cfg = config or EvalConfig()
    say = progress or (lambda msg: None)
    if not entries:
        raise NormswapError("give at least one model to evaluate")
    kinds = {e.name: model_kind(e.model) for e in entries}
    group = common_group(kinds)
    if prepared is None or prepared.group != group or any(prepared.kinds.get(n, k) != k for n, k in kinds.items()):
        # not prepared, or a kind the weightless skeleton could not tell: checked on the loaded models
        prepared = prepare(facts_of(entries), cfg, data=data, baseline_name=baseline_name, progress=say)
    cfg, chosen, text = prepared.config, prepared.chosen, prepared.text
    onnx = [e.name for e in entries if getattr(e.model, "is_onnx", False)]
    unmeasurable = sorted(set(chosen) - set(ONNX_MEASURED) - {"diagnostics"})  # diagnostics: on by default
    if onnx and unmeasurable and not onnx_rows_unmeasured:
        raise NormswapError(
            f"{', '.join(onnx)}: an ONNX export is measured by `normswap eval ppl` and `normswap eval speed` only "
            f"(perplexity, forward tokens/s), not by {', '.join(unmeasurable)}"
        )
    results = {
        "schema_version": 1,
        "device": device_description(device),
        "dtype": str(dtype).replace("torch.", ""),
        "data": prepared.data,
        "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "versions": versions(),
        "baseline": baseline_name,
        # thin evidence said out loud (evaluate/quality_intervals.py) and what was skipped; the report shows them first
        "warnings": list(prepared.notes),
        "models": [],
    }
    run = Run(
        entries=entries,
        config=cfg,
        text=text,
        group=group,
        baseline=baseline_name,
        device=device,
        seed=seed,
        lm_eval_log=Path(lm_eval_log) if lm_eval_log else default_log(),
        say=say,
        load_again=lambda e: load_planned([(e.name, e.spec)], device=device, dtype=dtype)[0].model,
    )
    rows = [{"name": e.name, "path": e.path, "spec": e.spec, **model_info(e.model, e.path)} for e in entries]
    for m in MEASUREMENTS:
        records, top = m.measure(run) if m.name in chosen else ({}, {})
        results.update(top)
        for row in rows:
            row.update(records.get(row["name"], m.empty()).row())
    speed = "speed" in chosen
    base = next((r for r in rows if r["name"] == baseline_name), None)
    null_row = results.get("null_control")
    null = null_intervals(null_row, base) if base is not None and null_row else None
    for row in rows:
        row["ratios"] = ratios(row, base) if base is not None else None
        row["ratio_intervals"] = ratio_intervals(row, base, null) if base is not None and speed else None
    if base is not None and speed:
        results["ratio_method"] = RATIO_METHOD
        if null_row is not None:
            null_row["ratios"], null_row["ratio_intervals"] = ratios(null_row, base), null
        results["speed_noise"] = speed_noise(null, results.get("speed_noise"))
    results["models"] = rows
    _warn_thin_evidence(results, rows, baseline_name)
    return results


def _warn_thin_evidence(results: dict, rows: list[dict], baseline_name) -> None:
    """The scored token count into the data block, and a warning where the evidence is thin."""
    scored = next((r for r in rows if r["name"] == baseline_name and r.get("perplexity_detail")), None) or next(
        (r for r in rows if r.get("perplexity_detail")), None
    )
    if scored is None:
        return
    from normswap.evaluate.quality_intervals import thin_evidence

    tokens = int(scored["perplexity_detail"]["tokens"])
    data_block = results.get("data") or {}
    if data_block:
        data_block["eval_tokens"] = tokens  # what was really scored, whatever --max-tokens allowed
    # the cap counts only in the tokens it was counted in (the model whose tokenizer cut the text)
    cut_by_scored = data_block.get("truncated") and data_block.get("cap_tokenizer_of") == scored["name"]
    cap = data_block.get("max_tokens") if cut_by_scored else None
    results["warnings"] += thin_evidence(rows, baseline_name, tokens, capped_at=cap)


def speed_noise(null: dict | None, machine: dict | None) -> dict:
    """results.json's ``speed_noise``: how busy the machine was and whether the null control says a
    speed ratio can be told from noise, per measured kind (normswap/stats/verdicts.py states the rule)."""
    from normswap.stats.verdicts import MIN_REPEATS, NULL_BAND, judged, null_is_tight

    spreads = {}
    if null is not None:
        spreads = {k: iv for k, iv in (null.get("tokens_per_second") or {}).items() if iv}
        if null.get("norm_ms_per_forward"):
            spreads["norm_ms_per_forward"] = null["norm_ms_per_forward"]
    return {
        "null_control": null is not None,
        "delta": NULL_BAND,
        "min_repeats": MIN_REPEATS,
        "null_spread": {
            k: {key: iv[key] for key in ("low", "high", "repeats", "pairs", "stop_reason") if key in iv}
            for k, iv in spreads.items()
        },
        # None: fewer repeats than a verdict needs, so nothing is judged either way
        "tight": {k: null_is_tight(iv) if judged(iv) else None for k, iv in spreads.items()},
        **(machine or {}),
    }
