"""`normswap export OUT DEST --format onnx`: an ONNX graph of a token model, validated by onnxruntime.

torch's ONNX exporter (dynamo, opset 23) traces the model; normswap's RMSNorm module traces as
torch's own ``rms_norm`` while exporting (modules.py), which the exporter writes as one
``RMSNormalization`` node per norm instead of the custom kernel's internals. A stock LayerNorm
model exports the same way (its norms as ``LayerNormalization``): that is the baseline the
converted model is timed against. ``norm_op="simplified"`` (the default) writes the graph
onnxruntime runs fused: each RMSNormalization becomes onnxruntime's contrib
``SimplifiedLayerNormalization`` (the same arithmetic), and each one fed by a residual ``Add``
becomes ``SkipSimplifiedLayerNormalization``, the Add folded in (its sum kept as the op's fourth
output where the residual stream goes on). Why here and not left to onnxruntime: its own
session-time fusion (skip_layer_norm_fusion.cc) matches only LayerNormalization, and only an Add
whose output has a single consumer and whose sequence length is a fixed number, so in a
pre-LN model it fuses just the final norm (GPT-2: 1 of 25 LayerNorms). ``norm_op="rmsnormalization"``
keeps ONNX's own op, for runtimes other than onnxruntime, which no runtime fuses with the Add.

The graph takes ``input_ids`` [batch, sequence] (both dynamic) and returns the model's first
output: ``logits`` for language models, else that output (e.g. ``last_hidden_state``); no
key/value cache. Before DEST is published, onnxruntime on CPU runs convert's probe batch and its
outputs are compared with PyTorch's in float32 (max |Δ log-prob| <= tolerance, 1e-4 by default).

DEST holds ``model.onnx`` (weights in ``model.onnx.data`` beside it above 1.5 GB), the source's
``config.json`` and tokenizer files, and ``normswap_manifest.json`` whose ``export`` record says
what the graph is (``normswap eval speed`` recognises such a directory).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from normswap.checkpoint.manifest import MANIFEST_NAME, history_entry, read_manifest, write_manifest
from normswap.checkpoint.side_files import read_json_inside
from normswap.checkpoint.write import copy_side_files
from normswap.errors import NormswapError, VerificationError
from normswap.export.onnx_graph import (  # noqa: F401 (re-exported: the names export.onnx always had)
    DEFAULT_NORM_OP,
    EXTERNAL_DATA_ABOVE,
    MODEL_FILE,
    MS_DOMAIN,
    NORM_OP_TYPES,
    NORM_OPS,
    OPSET,
    OPTIMIZATION_LEVEL,
    SKIP_OPS,
    FirstOutput,
    export_graph,
    exporter_quiet,
    fuse_residual_adds,
    is_onnx_dir,
    optimised_norm_ops,
    read_export,
    require_packages,
    session,
    use_contrib_norm,
)


def run_session(sess, input_ids: torch.Tensor) -> torch.Tensor:
    """The graph's first output for one forward over ``input_ids`` (a generation graph: from an empty cache)."""
    from normswap.export.onnx_generate import prefill_feed

    return torch.from_numpy(sess.run(None, prefill_feed(sess, input_ids.cpu().numpy()))[0])


def validate(model, path: Path, tokenizer, *, tolerance: float) -> dict:
    """onnxruntime (CPU) against PyTorch on convert's probe batch, float32: max |Δ log-prob| (first output
    for models without an LM head)."""
    from normswap.convert.verify import verification_ids

    ids = verification_ids(tokenizer, model.config)["input_ids"]
    wrapper = FirstOutput(model)
    with torch.no_grad():
        ref = wrapper(ids).double()
    try:
        got = run_session(session(path), ids).double()
    except Exception as e:  # onnxruntime refuses what the exporter wrote (its messages are long: the first line)
        raise NormswapError(
            f"onnxruntime cannot run the graph torch.onnx.export wrote for {type(model).__name__}: "
            f"{str(e).strip().splitlines()[0][:300]}; nothing was written"
        ) from None
    logits = wrapper.name == "logits"
    if logits:
        ref, got = ref.log_softmax(-1), got.log_softmax(-1)
    diff = float((ref - got).abs().max()) if ref.shape == got.shape else float("inf")
    return {
        "metric": "max_abs_logprob_diff" if logits else "max_abs_output_diff",
        "dtype": "float32",
        "runtime": "onnxruntime (CPU)",
        "probe_tokens": int(ids.numel()),
        "max_abs_diff": diff,
        "threshold": tolerance,
        "passed": bool(diff <= tolerance),
    }


def distinct_rms_norms(model) -> int:
    """How many distinct RMSNorm computations one forward of ``model`` makes: one per RMSNorm module, except
    that two of them reading the same tensor with the same ε, γ and β are one computation, which the
    exporter writes as one node (GPT-NeoX's parallel residual: both norms of a block read the same stream,
    and with γ/β folded away they are the same function)."""
    from normswap.model_facts import norm_modules

    seen, hooks, alive = set(), [], []

    def record(module, args, kwargs):
        x = args[0] if args else kwargs.get("x")
        residual = args[1] if len(args) > 1 else kwargs.get("residual")
        alive.append((x, residual))  # held, so that no later tensor takes a freed one's id
        params = tuple(None if p is None else id(p) for p in (module.weight, module.bias))
        seen.add((id(x), id(residual) if residual is not None else None, float(module.eps), params))

    for _, module in norm_modules(model):
        if "RMSNorm" in type(module).__name__:
            hooks.append(module.register_forward_pre_hook(record, with_kwargs=True))
    if not hooks:
        return 0
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 4), dtype=torch.long), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return len(seen)


def _trace(model, path: Path, *, norm_op, with_past, say) -> tuple[dict, bool]:
    """({op type: count}, whether the graph has the cache): the generation graph (onnx_generate.py) where
    ``with_past`` asks for it (None: a causal LM gets it when its cache traces, else the forward alone,
    said on the progress line and in the record), else the forward-only graph."""
    from normswap.export.onnx_generate import export_graph_with_cache, generates

    can, why = generates(model)
    if with_past and not can:
        raise NormswapError(f"cannot export {type(model).__name__} --with-past: {why}; export it with --no-past")
    if with_past is None and can:
        say(f"tracing {type(model).__name__} with its key/value cache (torch.onnx.export, opset {OPSET})")
        try:
            return export_graph_with_cache(model, path, norm_op=norm_op), True
        except NormswapError as e:
            say(f"{e}; exporting the forward without a cache instead (--no-past)")
    elif with_past:
        say(f"tracing {type(model).__name__} with its key/value cache (torch.onnx.export, opset {OPSET})")
        return export_graph_with_cache(model, path, norm_op=norm_op), True
    say(f"tracing {type(model).__name__} with torch.onnx.export (opset {OPSET}; no key/value cache)")
    return export_graph(model, path, norm_op=norm_op), False


def _incoherent(model, rotate: bool, seed: int, say):
    """(the model to trace, the rotation's record): the incoherence rotation before int8
    (slice/incoherence.py) when asked and the stream can take it, else the model itself and why not."""
    from normswap.slice.incoherence import KIND, can_rotate, incoherence_rotate

    if not rotate:
        return model, {"applied": False, "why": "--no-rotate"}
    if not can_rotate(model):
        say("int8 without the incoherence rotation: a LayerNorm model's stream does not commute with a rotation")
        return model, {
            "applied": False,
            "why": "not a normswap exact conversion or sliced model: LayerNorm centres its input, which a rotation "
            "does not commute with (convert it first to rotate)",
        }
    say(f"turning the stream by the incoherence rotation ({KIND}, seed {seed}) before int8")
    return incoherence_rotate(model, seed).eval(), {"applied": True, "kind": KIND, "seed": int(seed)}


def _quantize(model, fp32_path: Path, out_path: Path, tokenizer, say) -> dict:
    """int8 of the checked float32 graph into ``out_path`` (the float32 graph removed), with how far it
    moved from the model on the probe batch (recorded, not gated: int8 is not exact)."""
    from normswap.convert.verify import verification_ids
    from normswap.export.int8 import agreement, quantize_graph

    say("quantizing to int8 with onnxruntime.quantization.quantize_dynamic (per channel)")
    try:
        record = quantize_graph(fp32_path, out_path)
    finally:
        fp32_path.unlink(missing_ok=True)
    ids = verification_ids(tokenizer, model.config)["input_ids"]
    with torch.no_grad():
        ref = FirstOutput(model)(ids)
    record["probe_vs_model"] = agreement(ref, run_session(session(out_path), ids))
    return record


def write_onnx(
    src: Path,
    tmp: Path,
    *,
    tolerance=1e-4,
    norm_op=DEFAULT_NORM_OP,
    with_past=None,
    say=None,
    quantize=None,
    rotate=True,
    seed=0,
) -> dict:
    """Export the checkpoint ``src`` (converted or not) into the empty directory ``tmp`` and validate it.
    ``with_past``: True, the generation graph (refused in one line where the model cannot have one);
    False, the forward alone; None, the generation graph for a causal LM whose cache traces.
    ``quantize="int8"``: the validated float32 graph (turned first by the incoherence rotation when
    ``rotate`` and the model's stream can take it) quantized by onnxruntime (export/int8.py)."""
    from normswap.architectures.probes import takes_text_only
    from normswap.checkpoint.load import load_model, optional_tokenizer

    require_packages()
    say = say or (lambda m: None)
    t0 = time.perf_counter()
    model = load_model(str(src), dtype=torch.float32)
    if not takes_text_only(model):
        raise NormswapError(
            f"cannot export {src} as ONNX: it takes more than token ids (images, audio or decoder "
            "inputs); --format onnx exports token models"
        )
    traced, rotation = model, None
    if quantize:
        traced, rotation = _incoherent(model, rotate, seed, say)
    graph_path = tmp / (MODEL_FILE + ".float32.onnx" if quantize else MODEL_FILE)
    ops, past = _trace(traced, graph_path, norm_op=norm_op, with_past=with_past, say=say)
    rms = distinct_rms_norms(model)
    norm_nodes = {op: ops.get(op, 0) for op in NORM_OP_TYPES}
    expected = NORM_OPS[norm_op]
    written = norm_nodes[expected] + norm_nodes.get(SKIP_OPS.get(expected), 0)  # a fused norm is still one norm
    if rms and written != rms:  # the kernel traced into its internals (or a norm was missed)
        raise NormswapError(f"internal error: the graph has {written} {expected} nodes for {rms} RMSNorm computations")
    say("validating: onnxruntime (CPU) against PyTorch on the probe batch")
    tokenizer = optional_tokenizer(str(src))  # a refused one refuses the export
    # against the model as loaded: a rotated graph must compute what the unrotated model computes
    check = validate(model, graph_path, tokenizer, tolerance=tolerance)
    if not check["passed"]:
        raise VerificationError(
            f"ONNX validation failed: onnxruntime and PyTorch differ by {check['max_abs_diff']:.3g} > "
            f"{tolerance:.3g} ({check['metric']})"
            + (" after the incoherence rotation" if rotation else "")
            + "; nothing was written"
        )
    # generation is checked on the float32 graph (exact); int8 is measured, not gated (bench serve)
    generation = _check_generation(model, tmp, tokenizer, tolerance, say, graph_path.name) if past else None
    quantization = _quantize(model, graph_path, tmp / MODEL_FILE, tokenizer, say) if quantize else None
    # written from the config read by the side-file rule, never copied by path: a config.json swapped for a
    # link after the weights were read is refused instead of followed into OUT
    config = read_json_inside(src, "config.json")
    if not isinstance(config, dict):
        raise NormswapError(f"{src}/config.json is no longer a JSON object; nothing was written")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(src, tmp)
    if past:
        from normswap.export.onnx_generate import io_names, write_genai_config

        write_genai_config(tmp, model, MODEL_FILE)
    record = {
        "format": "onnx",
        "source": str(src),
        "architecture": (getattr(model.config, "architectures", None) or [type(model).__name__])[0],
        "converted": bool(getattr(model.config, "normswap", None)),
        "opset": OPSET,
        "norm_op": expected if rms else "LayerNormalization",
        "norm_nodes": {k: v for k, v in norm_nodes.items() if v},
        "with_past": past,
        "inputs": io_names(_layers(model))[0] if past else ["input_ids"],
        "outputs": io_names(_layers(model))[1] if past else [FirstOutput(model).name],
        "nodes": sum(ops.values()),
        "verification": check,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if generation is not None:
        record["generation"] = generation
    if quantize:
        record["verification"]["what"] = "the float32 graph before quantization against the model as loaded"
        record["quantization"] = quantization
        record["incoherence_rotation"] = rotation
    manifest = copy.deepcopy(read_manifest(src) or {})
    manifest.setdefault("history", []).append(history_entry("export", format="onnx", source=str(src)))
    manifest["export"] = record
    write_manifest(tmp, manifest)
    return record


def _layers(model) -> int:
    from normswap.export.onnx_generate import cache_geometry

    return cache_geometry(model.config)["layers"]


# greedy generation checked at export: this many new tokens (fewer where the context is shorter)
GENERATION_CHECK_TOKENS = 64


def _check_generation(model, tmp: Path, tokenizer, tolerance: float, say, model_file=None) -> dict:
    """Greedy tokens through the graph's cache against PyTorch's generate, on the probe's two rows cut to a
    16-token prompt; raises VerificationError (nothing written) when they differ other than at a tie."""
    from normswap.convert.verify import verification_ids
    from normswap.export.onnx_generate import check_generation
    from normswap.model_facts import context_length

    context = context_length(model.config) or 2048
    prompt = verification_ids(tokenizer, model.config)["input_ids"][:, :16]
    new = max(1, min(GENERATION_CHECK_TOKENS, context - prompt.shape[1]))
    say(f"validating: {new} greedy tokens through the key/value cache against PyTorch's generate")
    gen = check_generation(model, tmp, prompt, new, tie=tolerance, model_file=model_file)
    if not gen["passed"]:
        where = gen["first_difference"]
        raise VerificationError(
            f"ONNX generation check failed: greedy tokens differ from PyTorch's at new token {where['new_token']} "
            f"of row {where['row']} (PyTorch's top-2 log-prob gap there {where['top2_logprob_gap']:.3g} > "
            f"{tolerance:.3g}); nothing was written"
        )
    return gen


__all__ = [
    "write_onnx",
    "export_graph",
    "use_contrib_norm",
    "fuse_residual_adds",
    "session",
    "read_export",
    "optimised_norm_ops",
    "run_session",
    "is_onnx_dir",
    "require_packages",
    "MANIFEST_NAME",
]
