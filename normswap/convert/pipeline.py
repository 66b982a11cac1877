"""`normswap convert SRC OUT`, end to end: check, plan, convert, write, verify, publish.

One path for every checkpoint: its weight files (safetensors, or .bin through the restricted
unpickler) become a tensor source; the model its config describes is built without storage and
every file tensor is matched to it (``inputs.match``); the plan is executed tensor by tensor into
the output shards (``execute``); the staged result is verified module by module against the
source (``verify``); only then is OUT published. Memory stays at a few blocks of rows for the
conversion and one module's weights for the verification, whatever the model's size.
"""

from __future__ import annotations

import copy
import json
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from normswap import devices
from normswap.architectures.family_check import resolve_family, resolve_pooled_family
from normswap.checkpoint import load as ckload
from normswap.checkpoint.card import write_model_card
from normswap.checkpoint.manifest import environment, history_entry, write_manifest
from normswap.checkpoint.shards import ShardedCheckpoint
from normswap.checkpoint.side_files import copy_side_files
from normswap.checkpoint.sizes import check_against_weights
from normswap.checkpoint.tensor_source import SafetensorsFiles, local_dir, numel, open_source, weight_files
from normswap.checkpoint.write import write_config_and_code
from normswap.convert import ops
from normswap.convert import tensor_match as ckinputs
from normswap.convert import verify as verification
from normswap.convert.apply import check_convertible
from normswap.convert.config import ConvertOptions, check_out, options_from
from normswap.convert.execute import Conversion, TensorDict, execute, prepare
from normswap.convert.inplace import convert_tiny
from normswap.errors import NormswapError, VerificationError
from normswap.publish import publish_dir, staging_dir
from normswap.version import __version__

MEMORY_MARGIN = 0.9  # refuse verification above this share of the available memory


def convert_checkpoint(
    src, out, options: ConvertOptions | None = None, *, force=False, device="cpu", progress=None, **option_values
) -> dict:
    """Convert SRC into OUT and return the summary that `--json` prints.

    The conversion's options are ``options`` (a ConvertOptions, normswap/convert/config.py) or the
    same fields as keyword arguments (``mode="exact", gamma="keep", verify=False``, ...), not both.
    """
    options = options_from(options, option_values)
    family_file = options.family_file
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    resolved = ckload.resolve(src)
    out = check_out(src, out, force=force, family_file=family_file)
    config = ckload.load_config(resolved)
    directory = local_dir(resolved)
    if directory is None:
        raise NormswapError(f"cannot convert {src}: its files are neither a local directory nor reachable")
    label = str(src)
    source = open_source(directory, label)
    try:
        check_against_weights(config.to_dict(), {k: shape for k, (_, shape) in source.specs.items()}, label)
        load_dtype = ckinputs.load_dtype(config, source)
        config.dtype = load_dtype  # from_pretrained(dtype="auto") records it on the config it is given
        model = ckinputs.skeleton(config, load_dtype)
        check_convertible(model, config)
        declared = None  # which outputs stay exact, where not all do (--exact-outputs pooled)
        if options.exact_outputs == "pooled" and family_file is None:
            family, declared = resolve_pooled_family(config, type(model), convert=convert_tiny)
        else:
            family = resolve_family(config, type(model), family_file, convert=convert_tiny)
        if family_file is not None:
            say(f"using the family file {family_file} (checked by converting a tiny randomised instance)")
        elif family.discovered:
            say(
                f"no family file for model_type {config.model_type!r}: using the plan discovered "
                "from the model itself (checked by converting a tiny randomised instance)"
            )
        matched = ckinputs.match(model, source, label)
        source_config = copy.deepcopy(config)  # prepare() records the conversion on `config`
        out_dtype = None if options.dtype == "auto" else getattr(torch, options.dtype)
        conv = prepare(model, matched, family, options, out_dtype)
        if declared is not None:
            record_declared_outputs(conv, declared)
        causal = ckload.is_causal_lm(config)
        if options.verify:
            check_verification_memory(conv, config)
        # before anything is written: a tokenizer normswap refuses refuses the conversion (it is never carried
        # into OUT, also under --no-verify); none at all is fine (verification then runs on random ids)
        tokenizer = ckload.optional_tokenizer(resolved)

        total = sum(numel(w.shape) * w.dtype.itemsize for w in conv.writes.values())
        say(
            f"converting {len(conv.writes)} tensors ({total / 1e9:.2f} GB) from {len(source.files)} "
            f"{source.kind} file(s) ({family.display}, {conv.parameters_before / 1e6:.1f}M parameters)"
        )
        manifest = base_manifest(label, resolved, conv, source)
        with staging_dir(out) as tmp:
            write_config_and_code(conv.model, tmp)
            with ShardedCheckpoint(tmp, conv.specs, options.max_shard_size) as files:
                execute(conv, files, device=device)
            _write_generation_config(conv.model, directory, tmp)
            copy_side_files(directory, tmp)
            if options.verify:
                say("verifying: probe batch through source and converted checkpoint, one module at a time")
                manifest["verification"] = run_verification(
                    conv,
                    source_config,
                    resolved,
                    tmp,
                    causal=causal,
                    tolerance=options.tolerance,
                    device=device,
                    keys=declared["exact_outputs"] if declared else None,
                    tokenizer=tokenizer,
                )
            else:
                manifest["verification"] = {"skipped": True, "reason": "--no-verify"}
            write_manifest(tmp, manifest)
            write_model_card(tmp, manifest, json.loads((tmp / "config.json").read_text()))
            ver = manifest["verification"]
            if ver.get("passed") is False:
                # causal LMs compare log-probabilities; other models (and --exact-outputs) their outputs
                what = "log-prob" if ver.get("metric") == "max_abs_logprob_diff" else "output"
                raise VerificationError(
                    f"verification failed: {ver['reason']} (max |Δ {what}| float32 vs float32 "
                    f"{ver['max_abs_diff']:.3g}) in exact mode; nothing was written (rerun with --debug for details)"
                )
            publish_dir(tmp, out, force=force)
    finally:
        source.close()
    manifest["seconds"] = round(time.perf_counter() - t0, 3)
    return summary(out, manifest)


def record_declared_outputs(conv: Conversion, declared: dict) -> None:
    """Record in the converted config's normswap block (and so the manifest and model card) which
    outputs the conversion keeps exact and which move: the raw stream, by its per-token mean."""
    conv.plan.block["exact_outputs"] = list(declared["exact_outputs"])
    conv.plan.block["shifted_outputs"] = list(declared["shifted_outputs"])
    conv.plan.notes.append(
        f"--exact-outputs pooled: exact outputs {', '.join(declared['exact_outputs'])}; "
        f"{', '.join(declared['shifted_outputs'])} moves by its per-token mean (the raw residual stream)"
    )


def check_verification_memory(conv: Conversion, config) -> None:
    """Refuse up front a verification whose peak (``verify.peak_bytes``) would not fit."""
    need = verification.peak_bytes(conv.inputs.model, config, rounding=conv.output_dtype not in ("float32", "float64"))
    have = available_memory()
    if need > MEMORY_MARGIN * have:
        raise NormswapError(
            f"verification needs ~{need / 1e9:.1f} GB (the largest module's weights in float64 and the probe's "
            f"activations) but only {have / 1e9:.1f} GB of memory is available: rerun with --no-verify"
        )


def available_memory() -> int:
    return devices.available_memory("cpu")


def run_verification(
    conv: Conversion, source_config, resolved, staged, *, causal, tolerance, device="cpu", keys=None, tokenizer=None
) -> dict:
    """Source (its files) against the staged output (its files), one module at a time; on the outputs
    named in ``keys`` where given (``--exact-outputs pooled``); on text through ``tokenizer`` where the
    source has one (else random ids)."""
    staged_config = ckload.load_config(str(staged))
    staged_files = SafetensorsFiles(staged, weight_files(staged)[1])
    try:
        out_skeleton = ckinputs.skeleton(staged_config, torch.float32)
        staged_inputs = ckinputs.match(out_skeleton, staged_files, f"the converted checkpoint {staged.name}")
        whole = 8 * max(conv.parameters_before, conv.parameters_after)
        sixteen = conv.output_dtype not in ("float32", "float64")
        # weights are read (and recomputed) row block by row block on a thread each, torch's own
        # threads off meanwhile; the forwards between them keep torch's threads
        pool = ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()))

        def on_blocks(fetch):
            def fetch_blocks(key, dtype, out=None):
                with ops.intra_op_threads(1):
                    return fetch(key, dtype, out=out, pool=pool)

            return fetch_blocks

        def unrounded(key, dtype, out=None, pool=None):
            return unrounded_tensor(conv, staged_inputs.disk_key(key), device, out=out, pool=pool).to(dtype)

        def in_float64(key, dtype, out=None, pool=None):  # the conversion's arithmetic carried out in float64
            value = unrounded_tensor(conv, staged_inputs.disk_key(key), device, out=out, pool=pool, calc=torch.float64)
            return value.to(dtype)

        with pool:
            result = verification.verify(
                (lambda: ckinputs.skeleton(source_config, torch.float32, buffers=True), on_blocks(conv.inputs.read_as)),
                (
                    lambda: ckinputs.skeleton(staged_config, torch.float32, buffers=True),
                    on_blocks(staged_inputs.read_as),
                ),
                exact=on_blocks(in_float64) if conv.plan.mode == "exact" else None,
                unrounded=on_blocks(unrounded) if sixteen else None,
                tokenizer=tokenizer,
                causal=causal,
                device=device,
                resident_ok=whole < 0.5 * available_memory(),
                tolerance=tolerance,
                keys=keys,
            )
    finally:
        staged_files.close()
    if conv.plan.mode != "exact":
        result["passed"] = None
    return result


def unrounded_tensor(conv: Conversion, key, device="cpu", out=None, pool=None, calc=None) -> torch.Tensor:
    """Output tensor ``key`` as the conversion computes it before rounding to a 16-bit dtype: the same
    arithmetic (``ops.compute_dtype`` of the output dtype, or ``calc`` throughout: float64 gives the
    conversion's exact value) stopped before the final cast.
    ``out``: a tensor of ``calc`` and the output's shape to fill instead of a fresh one; ``pool``: threads
    for its row blocks (``ops.run``)."""
    w = conv.writes[key]
    op = conv.plan.derivations.get(w.value_key)
    calc = calc or ops.compute_dtype(w.dtype)
    if out is not None and (out.dtype != calc or tuple(out.shape) != tuple(w.shape)):
        out = None  # not a buffer for this tensor: computed into a fresh one
    if op is None:  # passed through: its value in the load dtype (what execute writes), as float32
        value = conv.inputs.read(w.value_key)
        return out.copy_(value) if out is not None else value.to(calc if calc == torch.float64 else torch.float32)
    sink = TensorDict({key: (calc, w.shape)}, {key: out} if out is not None else None)
    ops.run(
        op,
        w.shape,
        conv.inputs.read,
        lambda k: conv.inputs.specs[k][1],
        lambda t, row: sink.write(key, t, row),
        calc,
        compute=calc,
        device=device,
        pool=pool,
    )
    return sink.tensors[key]


def base_manifest(src, resolved, conv: Conversion, source) -> dict:
    plan = conv.plan
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
            "parameters_before": conv.parameters_before,
            "parameters_after": conv.parameters_after,
            "source_dtype": conv.source_dtype,
            "output_dtype": conv.output_dtype,
            "source_format": source.kind,
            "source_files": len(source.files),
        },
        "environment": environment(),
        "history": [history_entry("convert", source=str(src), mode=plan.mode)],
    }


def summary(out, manifest) -> dict:
    conv = manifest["conversion"]
    ver = manifest.get("verification", {})
    return {
        "out": str(out),
        "source": conv["source"],
        "family": conv["family"],
        "mode": conv["mode"],
        "placement": conv["placement"],
        "source_format": conv["source_format"],
        "norms_replaced": conv["summary"]["norms_replaced"],
        "gamma": conv["summary"]["gamma"],
        "beta": conv["summary"]["beta"],
        "added_biases": conv["summary"]["added_biases"],
        "centered_at_runtime": conv["summary"]["centered_at_runtime"],
        "untied": conv["summary"]["untied"],
        "logits_bias": conv["summary"].get("logits_bias", {}),
        "left_alone": conv["summary"]["left_alone"],
        "parameters_before": conv["parameters_before"],
        "parameters_after": conv["parameters_after"],
        "notes": conv["notes"],
        "verification": ver,
        "seconds": manifest.get("seconds"),
    }


def _write_generation_config(model, src_dir, tmp) -> None:
    """What from_pretrained + save_pretrained would leave: the source's generation config, re-saved.

    Like ``GenerationMixin.adjust_generation_fn``: generation_config.json when the source has
    one, else one built from the source's config.json.
    """
    gen = getattr(model, "generation_config", None)
    if getattr(model, "can_generate", lambda: False)():
        try:
            from transformers import GenerationConfig

            if (src_dir / "generation_config.json").is_file():
                gen = GenerationConfig.from_pretrained(str(src_dir))
            else:
                gen = GenerationConfig.from_pretrained(
                    str(src_dir), config_file_name="config.json", _from_model_config=True
                )
        except Exception:
            pass
    if gen is not None and not (tmp / "generation_config.json").exists():
        try:
            gen.save_pretrained(tmp)
        except Exception:  # an invalid generation config must not lose the weights
            pass
