"""What each evaluated model is: original, converted or fine-tuned, its norm layers, its training curve.

These are the descriptive keys of a results.json model row (docs/results-schema.md), read from the
loaded model, its ``config.normswap`` block, its normswap_manifest.json and, for a model written by
``normswap finetune``, its train_log.jsonl (through the fine-tune's own RunDir reader).
"""

from __future__ import annotations

from pathlib import Path

from normswap.errors import NormswapError
from normswap.evaluate.kinds import model_kind
from normswap.model_facts import hidden_size_of, norm_kind, norm_modules

# the keys of config.normswap (convert/plan.py) a report shows
BLOCK_KEYS = ("mode", "family", "placement", "format_version", "normswap_version")


def model_info(model, path: str | None) -> dict:
    from normswap.checkpoint.manifest import read_manifest

    if getattr(model, "is_onnx", False):
        return onnx_info(model)
    config = model.config
    block = getattr(config, "normswap", None)
    block = dict(block) if isinstance(block, dict) else None
    manifest = None
    if path and Path(path).is_dir():
        try:
            manifest = read_manifest(path)
        except NormswapError:  # unreadable: the model still loads, only its history is unknown
            manifest = None
    curve = finetune_curve(path) if path and Path(path).is_dir() else None
    if (manifest and manifest.get("finetune")) or curve is not None:
        kind = "fine-tuned"
    elif block:
        kind = f"converted ({block.get('mode', '?')})"
    else:
        kind = "original"
    found = norm_modules(model)
    # The usual per-token arithmetic of one norm over d features: LayerNorm ~8d (mean, subtract,
    # square, mean, scale, gamma, beta), RMSNorm ~4d (square, mean, scale, gamma).
    norm_flops = sum((8 if norm_kind(m) == "layer" else 4) * (hidden_size_of(m) or 0) for _, m in found)
    params = int(sum(p.numel() for p in model.parameters()))
    info = {
        "kind": kind,
        "model_kind": model_kind(model),
        "architecture": (getattr(config, "architectures", None) or [type(model).__name__])[0],
        "parameters": params,
        "norm_classes": sorted({type(m).__name__ for _, m in found}),
        "norm_layers": len(found),
        "flops_per_token": {"norms": norm_flops, "model_estimate": 2 * params},
        "normswap": {k: block[k] for k in BLOCK_KEYS if k in block} if block else None,
        "finetune": curve,
    }
    if manifest and manifest.get("finetune"):
        info["finetune_manifest"] = manifest.get("finetune")
    return info


def onnx_info(model) -> dict:
    """The descriptive keys of an ONNX export's row, from its export record."""
    from normswap.evaluate.onnx_model import NOT_MEASURED

    record = model.export
    scheme = (record.get("quantization") or {}).get("scheme")  # int8 (export/int8.py), None for float32
    return {
        "kind": f"onnx{' ' + scheme if scheme else ''} ({'converted' if record.get('converted') else 'original'})",
        "model_kind": model_kind(model),
        "architecture": record.get("architecture"),
        "parameters": None,
        "norm_classes": sorted(record.get("norm_nodes") or {}),
        "norm_layers": sum((record.get("norm_nodes") or {}).values()),
        "flops_per_token": None,
        "normswap": None,
        "finetune": None,
        "onnx": {
            "opset": record.get("opset"),
            "norm_op": record.get("norm_op"),
            "runtime": "onnxruntime (CPU)",
            "quantize": scheme,
            "not_measured": NOT_MEASURED,
        },
    }


def finetune_curve(model_dir, max_points: int = 400) -> dict | None:
    """Loss curve from ``normswap finetune``'s log in ``model_dir``, thinned to ``max_points``. The log
    is read by the fine-tune's bounded reader (a model handed to eval, maybe another user's: its size
    and each row's are capped) and one row at a time, keeping only the numbers the curve shows."""
    from normswap.finetune.run_dir import RunDir, iter_log_rows

    run = RunDir(model_dir)
    if not (run.log_file.is_file() or run.log_file.is_symlink()):
        return None
    train, evals = [], []  # (step, loss, lm_loss, distill_loss), (step, eval_loss)
    for r in iter_log_rows(run.log_file):
        if not isinstance(r, dict) or "step" not in r:
            continue
        if r.get("loss") is not None:
            train.append((r["step"], r["loss"], r.get("lm_loss"), r.get("distill_loss")))
        if r.get("eval_loss") is not None:
            evals.append((r["step"], r["eval_loss"]))
    every = max(1, len(train) // max_points)
    thinned = train[::every]
    if train and thinned[-1] != train[-1]:
        thinned.append(train[-1])
    # With distillation, `loss` is the mixed objective: keep its parts apart (KL and cross-entropy
    # differ by orders of magnitude and must not share an axis).
    parts = {
        key: [row[i] for row in thinned]
        for i, key in ((2, "lm_loss"), (3, "distill_loss"))
        if any(row[i] is not None for row in thinned)
    }
    thinned = [(row[0], row[1]) for row in thinned]
    train_last = train[-1][:2] if train else None
    return {
        "train_log": str(run.log_file),
        "steps": [s for s, _ in thinned],
        "loss": [v for _, v in thinned],
        **parts,
        "eval_steps": [s for s, _ in evals],
        "eval_loss": [v for _, v in evals],
        "final_loss": train_last[1] if train else None,
        "final_eval_loss": evals[-1][1] if evals else None,
        "total_steps": train_last[0] if train else None,
    }
