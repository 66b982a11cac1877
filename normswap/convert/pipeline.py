"""`normswap convert SRC OUT`, end to end: check, plan, convert, write, verify, publish."""

from __future__ import annotations

import json
import time

import torch

from normswap import __version__
from normswap.architectures import family_for_config
from normswap.checkpoint import load as ckload
from normswap.checkpoint.card import write_model_card
from normswap.checkpoint.manifest import environment, history_entry, write_manifest
from normswap.checkpoint.write import write_checkpoint_dir
from normswap.convert.apply import check_convertible, convert_model, count_parameters
from normswap.errors import NormswapError, VerificationError
from normswap.publish import check_output_path, publish_dir, staging_dir

DEFAULT_TOLERANCE = 1e-4


def meta_model(config):
    """The source architecture with no storage: enough to plan, check and count."""
    cls = ckload.model_class_for(config)
    with torch.device("meta"):
        if hasattr(cls, "from_config"):
            return cls.from_config(config, trust_remote_code=ckload.remote_code_trusted(config)) if cls.__name__.startswith("Auto") else cls._from_config(config)
        return cls(config)


def preflight(src, out, *, force):
    """Everything that can be refused before a single weight is read."""
    resolved = ckload.resolve(src)
    local = ckload.is_local(resolved)
    out = check_output_path(out, force=force, reads=[resolved] if local else [])
    config = ckload.load_config(resolved)
    skeleton = meta_model(config)
    check_convertible(skeleton, config)
    family = family_for_config(config)
    return resolved, local, out, config, family, skeleton


def convert_checkpoint(src, out, *, mode="auto", gamma=None, beta=None, untie=False, dtype=None, force=False,
                       verify=True, tolerance=DEFAULT_TOLERANCE, max_shard_size="5GB", streaming=None,
                       progress=None) -> dict:
    """Convert SRC into OUT and return the summary that `--json` prints."""
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    resolved, local, out, config, family, skeleton = preflight(src, out, force=force)
    out_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype not in ("auto", None) else None

    use_streaming = False
    if streaming is None or streaming:
        from normswap.convert import streaming as streaming_mod  # optional path, see streaming.py

        use_streaming = streaming_mod.should_stream(resolved, local, streaming)
    if use_streaming:
        return streaming_mod.convert_streaming(
            resolved, out, config=config, family=family, skeleton=skeleton, src_label=str(src), mode=mode, gamma=gamma,
            beta=beta, untie=untie, dtype=out_dtype, force=force, verify=verify, tolerance=tolerance,
            max_shard_size=max_shard_size, progress=say,
        )

    say(f"loading {src}")
    model = ckload.load_model(resolved, dtype="auto", config=config, strict=True)
    params_before = count_parameters(model)
    source_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    say(f"converting ({family.display}, {params_before / 1e6:.1f}M parameters)")
    plan = convert_model(model, mode=mode, gamma=gamma, beta=beta, untie=untie, family=family, dtype=out_dtype)
    params_after = count_parameters(model)
    tokenizer = None if local else _hub_tokenizer(resolved)

    manifest = base_manifest(src, resolved, plan, params_before, params_after, source_dtype,
                             str(out_dtype or next(model.parameters()).dtype).replace("torch.", ""), "in-memory")
    with staging_dir(out) as tmp:
        say(f"writing {out}")
        write_checkpoint_dir(model, tmp, tokenizer=tokenizer, source_dir=resolved if local else None,
                             manifest=manifest, max_shard_size=max_shard_size)
        del model
        finish(tmp, out, resolved, manifest, plan.mode, causal=ckload.is_causal_lm(config), verify=verify,
               tolerance=tolerance, force=force, say=say)
    manifest["seconds"] = round(time.perf_counter() - t0, 3)
    return summary(out, manifest)


def base_manifest(src, resolved, plan, params_before, params_after, source_dtype, out_dtype, path) -> dict:
    return {
        "normswap_version": __version__,
        "conversion": {
            "source": str(src),
            "source_resolved": str(resolved),
            "family": plan.family,
            "mode": plan.mode,
            "placement": plan.placement,
            "options": plan.block["options"],
            "summary": plan.summary(),
            "notes": plan.notes,
            "parameters_before": params_before,
            "parameters_after": params_after,
            "source_dtype": source_dtype,
            "output_dtype": out_dtype,
            "path": path,
        },
        "environment": environment(),
        "history": [history_entry("convert", source=str(src), mode=plan.mode)],
    }


def finish(tmp, out, resolved, manifest, mode, *, causal, verify, tolerance, force, say):
    """Verify the staged checkpoint, record the figures, and move it into place."""
    if verify:
        say("verifying: probe batch through source and converted checkpoint")
        manifest["verification"] = run_verification(resolved, tmp, causal=causal, mode=mode, tolerance=tolerance,
                                                    output_dtype=manifest["conversion"]["output_dtype"])
    else:
        manifest["verification"] = {"skipped": True, "reason": "--no-verify"}
    write_manifest(tmp, manifest)
    write_model_card(tmp, manifest, json.loads((tmp / "config.json").read_text()))
    ver = manifest["verification"]
    if ver.get("passed") is False:
        raise VerificationError(
            f"verification failed: max |Δ log-prob| = {ver['max_abs_diff']:.3g} > {ver['threshold']:.3g} "
            "in exact mode; nothing was written (rerun with --debug for details)"
        )
    publish_dir(tmp, out, force=force)


def run_verification(resolved, staged, *, causal, mode, tolerance, output_dtype) -> dict:
    from normswap.convert.verify import verify as run

    tokenizer = None
    try:
        tokenizer = ckload.load_tokenizer(resolved)
    except NormswapError:
        pass
    source = ckload.load_model(resolved, dtype=torch.float32)
    converted = ckload.load_model(str(staged), dtype=torch.float32)
    result = run(source, converted, tokenizer=tokenizer, causal=causal)
    threshold = tolerance
    if result["noise_floor"] is not None:
        threshold = max(threshold, 4 * result["noise_floor"])
    if output_dtype not in ("float32", "float64"):
        # rounding the weights to 16 bits moves log-probs by itself; measure that floor too
        rounded = ckload.load_model(resolved, dtype=getattr(torch, output_dtype)).float()
        floor16 = run(source, rounded, tokenizer=tokenizer, causal=causal)["max_abs_diff"]
        result["rounding_floor"] = floor16
        threshold = max(threshold, 4 * floor16)
    result["threshold"] = threshold
    result["passed"] = bool(result["max_abs_diff"] <= threshold) if mode == "exact" else None
    return result


def summary(out, manifest) -> dict:
    conv = manifest["conversion"]
    ver = manifest.get("verification", {})
    return {
        "out": str(out),
        "source": conv["source"],
        "family": conv["family"],
        "mode": conv["mode"],
        "placement": conv["placement"],
        "path": conv["path"],
        "norms_replaced": conv["summary"]["norms_replaced"],
        "gamma": conv["summary"]["gamma"],
        "beta": conv["summary"]["beta"],
        "added_biases": conv["summary"]["added_biases"],
        "centered_at_runtime": conv["summary"]["centered_at_runtime"],
        "untied": conv["summary"]["untied"],
        "left_alone": conv["summary"]["left_alone"],
        "parameters_before": conv["parameters_before"],
        "parameters_after": conv["parameters_after"],
        "notes": conv["notes"],
        "verification": ver,
        "seconds": manifest.get("seconds"),
    }


def _hub_tokenizer(resolved):
    try:
        return ckload.load_tokenizer(resolved)
    except NormswapError:
        return None
