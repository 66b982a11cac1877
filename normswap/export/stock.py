"""`normswap export OUT DEST --format stock`: a converted checkpoint in its source's stock architecture.

Every RMSNorm becomes the LayerNorm the stock class has there, with γ = 1 and β = 0 where the
conversion folded them (the RMSNorm's own γ/β where it kept them; see below where γ/β move
back). That is the same function: the stream the converted model feeds each norm is zero-mean,
and LayerNorm of a zero-mean vector is RMSNorm with the same ε. The weights are the converted
ones (folded, centred), so a stock transformers, an engine that only knows the stock
architectures or an interpretability tool loads the export with no remote code.

What a converted model does beyond the stock class, and how each is expressed here:
- an output centred at run time (a tied embedding, a norm that writes the stream start): a
  LayerNorm removes the mean of whatever it reads, so the stock model computes the same function
  without the centring. Where the centring can be moved into the weights it is (an untied
  embedding's rows, a linear's output rows), so that the exported stream is zero-mean too, and a
  tool that swaps these LayerNorms for RMSNorm gets the same function again ("rmsnorm-ready").
  A tied embedding cannot be centred without moving the head: ``untie=True`` gives the head its
  own copy of the table (vocab x hidden more parameters) and centres the input table. What stays
  uncentred is listed in the summary (``not_centred``), and verification checks both claims.
- a head untied by the conversion: ``tie_word_embeddings`` false in the stock config.
- a bias the conversion added to a linear that has none in the stock class (β folded into a
  bias-free reader): moved back into the norm's own bias, and γ/β the checkpoint carries for the
  bare model back onto the norm (affine.py); refused, naming the tensor, only where no LayerNorm
  bias reaches it (γ_j = 0 with W_j·β_j ≠ 0).

Approximate (post-LN) conversions are refused: their RMSNorms read a stream that is not
zero-mean, so no LayerNorm computes them (``--format onnx`` exports them as they are).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
from torch import nn

from normswap.checkpoint.manifest import history_entry, read_manifest, write_manifest
from normswap.checkpoint.remote_code import carried_keys
from normswap.checkpoint.shards import ShardedCheckpoint
from normswap.checkpoint.write import copy_side_files
from normswap.convert import tensor_match as ckinputs
from normswap.convert.stream_record import off_centre, stream_writers
from normswap.errors import NormswapError
from normswap.export.affine import AVOID, move_folded_affine
from normswap.export.compare import compare_models
from normswap.export.open_checkpoint import open_checkpoint
from normswap.model_facts import is_layernorm, layout_of


def stock_config(config, block: dict, *, untie: bool):
    """The source's own config class, without the normswap block and auto_map."""
    from transformers import CONFIG_MAPPING

    model_type = block.get("source_model_type") or config.model_type
    d = config.to_dict()
    for key in ("normswap", "auto_map", "transformers_version"):
        d.pop(key, None)
    d["model_type"] = model_type
    d["architectures"] = [block["source_class"]]
    if block.get("untied") or untie:
        d["tie_word_embeddings"] = False
    cfg = CONFIG_MAPPING[model_type].from_dict(d)
    if block.get("untied") or untie:
        cfg.tie_word_embeddings = False
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        text.tie_word_embeddings = False
    return cfg


def _unique_keys(model) -> list[str]:
    """State-dict keys a stock save writes: one per tied group, persistent buffers included."""
    groups = ckinputs.tie_groups(model)
    persistent = ckinputs.persistent_buffers(model)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    out = []
    for key in model.state_dict(keep_vars=True):
        if key not in params and key not in persistent:
            continue
        if groups.get(key, [key])[0] == key:
            out.append(key)
    return out


def _centring_of(module):
    """How to centre ``module``'s output in its weights: {param: dim to subtract the mean over}, or None."""
    if isinstance(module, nn.Embedding):
        return {"weight": -1}
    if not (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"):
        return None
    layout = layout_of(module)
    if layout == "conv1d":
        return {"weight": -1, "bias": -1}
    if layout == "linear":
        return {"weight": 0, "bias": -1}
    return None


class StockPlan:
    """Per stock tensor: where its value comes from, and what the conversion's extras became."""

    def __init__(self, opened, *, untie: bool):
        block, label = opened.block, opened.path.name
        self.block = block
        self.config = stock_config(opened.config, block, untie=untie)
        self.model = ckinputs.skeleton(self.config, opened.dtype)
        src_groups = ckinputs.tie_groups(opened.inputs.model)
        stock_groups = ckinputs.tie_groups(self.model)
        self.keys = _unique_keys(self.model)
        specs = dict(self.model.state_dict(keep_vars=True))
        self.specs = {k: (specs[k].dtype, tuple(specs[k].shape)) for k in self.keys}
        self.fill: dict = {}  # key -> "ones" / "zeros" (γ = 1, β = 0 of a norm that folded them)
        norms = block.get("norms", {})
        for name, rec in norms.items():
            module = _get(self.model, name)
            if module is None:
                continue
            if not is_layernorm(module):
                raise NormswapError(
                    f"cannot export {label} as stock: {name} is a {type(module).__name__} in the stock "
                    f"{block['source_class']}, not a LayerNorm"
                )
            if float(getattr(module, "eps", rec["eps"])) != float(rec["eps"]):
                raise NormswapError(
                    f"cannot export {label} as stock: {name} has ε {rec['eps']} but the stock config gives {module.eps}"
                )
            for pname, kept, value in (("weight", rec["weight"], "ones"), ("bias", rec["bias"], "zeros")):
                if not kept and getattr(module, pname, None) is not None:
                    self.fill[f"{name}.{pname}"] = value
        # β folded into a reader the stock class gives no bias moves back into the norm's bias, and
        # γ/β the checkpoint carries for the bare model go back onto the norm (affine.py)
        self.moved = move_folded_affine(opened, self.model, self.keys, block, _get, label)
        for key in self.moved.values:
            self.fill.pop(key, None)
        # every converted tensor needs a place in the stock class, and every stock tensor a value
        carried = carried_keys(block)  # γ/β copies for the bare model: back on the norm or not needed
        for key in _unique_keys(opened.inputs.model):
            if key in carried or key in self.moved.absorbed:
                continue
            if not any(k in self.keys for k in src_groups.get(key, [key])):
                raise NormswapError(
                    f"cannot export {label} as stock: the stock {block['source_class']} has no place for {key} "
                    + (
                        f"(a bias the conversion added to a linear that has none: β was folded into it); {AVOID}"
                        if key.endswith(".bias")
                        else "(the conversion added it)"
                    )
                )
        missing = [
            k
            for k in self.keys
            if k not in self.fill and k not in self.moved.values and opened.inputs.disk_key(k) is None
        ]
        if missing:
            raise NormswapError(
                f"cannot export {label} as stock: the stock {block['source_class']} needs {missing[0]}, "
                "which the converted checkpoint does not have"
            )
        # run-time centring: into the weights where a module's own parameters can carry it
        self.centre: dict = {}  # key -> dim
        self.not_centred: list[dict] = []
        for name in block.get("centered_outputs", []):
            module = _get(self.model, name)
            how = _centring_of(module) if module is not None else None
            tied = module is not None and len(stock_groups.get(f"{name}.weight", [])) > 1
            if how is None or tied:
                why = (
                    "tied to the output head (export with --untie to centre it)"
                    if tied
                    else f"a {type(module).__name__}'s output is not a function of its own weights alone"
                )
                self.not_centred.append({"module": name, "reason": why})
                continue
            for pname, dim in how.items():
                if getattr(module, pname, None) is not None:
                    self.centre[f"{name}.{pname}"] = dim
        for name in block.get("centered_inputs", []):
            self.not_centred.append(
                {"module": name, "reason": "the stream start is computed in the forward, not by a module's weights"}
            )

    def value(self, opened, key) -> torch.Tensor:
        dtype, shape = self.specs[key]
        if key in self.fill:
            return (torch.ones if self.fill[key] == "ones" else torch.zeros)(shape, dtype=dtype)
        if key in self.moved.values:
            t = self.moved.values[key]  # float64, cast once below
        else:
            t = opened.inputs.read(key)  # a head untied here reads the table it was tied to (Inputs.disk_key)
        if key in self.centre:
            dim = self.centre[key]
            t64 = t.double()
            t = (t64 - t64.mean(dim=dim, keepdim=True)).to(dtype)
        return t.to(dtype).contiguous()


class _Unrounded:
    """The stock export with the values moved into its norms and readers as computed (float64, before
    their rounding to the checkpoint's dtype): what rounding alone changes, measured against it."""

    def __init__(self, stock, values):
        self.stock, self.values = stock, values
        self.causal, self.build, self.tokenizer = stock.causal, stock.build, stock.tokenizer

    def fetch(self, key, dtype, out=None):
        if key in self.values:
            return self.values[key].to(dtype)
        return self.stock.fetch(key, dtype, out=out)


def _get(model, name):
    from normswap.checkpoint.remote_code import local_name

    local = local_name(model, name)
    return model.get_submodule(local) if local is not None else None


def _check_still_centred(conv, src) -> None:
    """Refuse, in one line and before any work, an exact conversion whose stream writers are no
    longer zero-mean (fine-tuned with --no-keep-centred): its RMSNorms then read a stream that is not
    zero-mean, so no LayerNorm computes them, and verification could only fail."""
    record = stream_writers(conv.block)
    if not record:
        return  # not recorded (an older conversion): verification is the check
    tensors = {k: conv.inputs.read(k) for k in record.get("zero_mean", {}) if conv.inputs.disk_key(k) is not None}
    worst = off_centre(tensors, record)
    if worst is None:
        return
    finetune = (read_manifest(src) or {}).get("finetune") or {}
    why = " (fine-tuned with --no-keep-centred)" if finetune.get("keep_centred") is False else ""
    raise NormswapError(
        f"cannot export {src} as stock: its residual-stream writers are no longer zero-mean{why}, e.g. "
        f"{worst[0]} has a mean of {worst[1]:.2g} x its rms, so its RMSNorms are not LayerNorms; "
        "--format onnx exports it as it is"
    )


def rms_swapped(model, block):
    """``model`` with each converted norm position computing RMSNorm (its own γ/β, same ε): what a tool
    that swaps the export's LayerNorms for RMSNorm runs."""
    for name, rec in block.get("norms", {}).items():
        module = _get(model, name)
        if module is None:
            continue

        def forward(x, m=module, eps=float(rec["eps"])):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            y = y * m.weight if m.weight is not None else y
            return y + m.bias if m.bias is not None else y

        module.forward = forward
    return model


def write_stock(src: Path, tmp: Path, *, untie=False, max_shard_size="5GB", tolerance=1e-4, say=None) -> dict:
    """Write the stock export of the converted checkpoint ``src`` into the empty directory ``tmp``
    and verify it; returns the export record (raises VerificationError when it differs)."""
    say = say or (lambda m: None)
    t0 = time.perf_counter()
    with open_checkpoint(src, f"the checkpoint {src}") as conv:
        block = conv.block
        if not block:
            raise NormswapError(
                f"{src} is not a checkpoint normswap converted (its config.json has no normswap block): "
                "--format stock exports a converted checkpoint in its source's stock architecture; "
                "a stock checkpoint already is one"
            )
        if block.get("slice"):
            raise NormswapError(
                f"cannot export {src} as stock: it is sliced (its residual stream is {block['slice'].get('width')} "
                f"wide, its attention {block['slice'].get('hidden_size')}), and no stock class has a stream narrower "
                "than its attention; --format onnx exports it as it is"
            )
        if block.get("mode") != "exact":
            raise NormswapError(
                f"cannot export {src} as stock: it was converted approximately ({block.get('placement')}-LN), "
                "so its RMSNorms read a stream that is not zero-mean and no LayerNorm computes them; "
                "--format onnx exports it as it is"
            )
        _check_still_centred(conv, src)
        plan = StockPlan(conv, untie=untie)
        say(
            f"writing {len(plan.keys)} tensors in the stock {block['source_class']} layout"
            + (f" ({len(plan.fill)} norm γ/β set to 1/0)" if plan.fill else "")
        )
        with ShardedCheckpoint(tmp, plan.specs, max_shard_size, variant=None) as files:
            for key in plan.keys:
                files.write(key, plan.value(conv, key))
        plan.config.dtype = conv.dtype
        plan.config.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        if "auto_map" in cfg or "normswap" in cfg:  # a stock loader must find nothing to run
            raise NormswapError("internal error: the stock config still names remote code")
        copy_side_files(src, tmp)
        say(
            "verifying: the converted checkpoint and the stock export side by side (float64 where the model runs in it)"
        )
        with open_checkpoint(tmp, "the stock export", files_only=True) as stock:
            check = compare_models(conv, stock, tolerance=tolerance)
            if not check["passed"] and plan.moved.values and stock.dtype.itemsize < 4:
                # γ/β moved back into the norms were computed in float64 and rounded to the 16-bit dtype,
                # which moves the outputs by itself: the threshold is 4x that rounding floor (convert's rule)
                floor = compare_models(_Unrounded(stock, plan.moved.values), stock, tolerance=tolerance)
                check["rounding_floor"] = floor["max_abs_diff"]
                check["threshold"] = max(tolerance, 4 * floor["max_abs_diff"])
                check["passed"] = bool(check["max_abs_diff"] <= check["threshold"])
            tolerance = check["threshold"]
            swapped = compare_models(
                conv, stock, tolerance=tolerance, transform=lambda m: rms_swapped(m, block), dtype=check["dtype"]
            )
    check["rmsnorm_ready"] = {"max_abs_diff": swapped["max_abs_diff"], "passed": swapped["passed"]}
    record = {
        "format": "stock",
        "source": str(src),
        "architecture": block["source_class"],
        "model_type": plan.config.model_type,
        "norms_as_layernorm": len(block.get("norms", {})),
        "gamma_beta_set": len(plan.fill),
        "folded_affine_moved": dict(plan.moved.norms),
        "untied": bool(block.get("untied") or untie),
        "centred_in_weights": sorted(plan.centre),
        "not_centred": plan.not_centred,
        "rmsnorm_ready": bool(swapped["passed"]),
        "verification": check,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if not check["passed"]:
        from normswap.errors import VerificationError

        raise VerificationError(
            f"stock export verification failed: max |Δ| = {check['max_abs_diff']:.3g} > "
            f"{check['threshold']:.3g} ({check['dtype']}); nothing was written (--format onnx exports it as it is)"
        )
    if not plan.not_centred and not swapped["passed"]:
        from normswap.errors import VerificationError

        raise VerificationError(
            f"stock export verification failed: its stream should be zero-mean but RMSNorm in place of "
            f"its LayerNorms differs by {swapped['max_abs_diff']:.3g}; nothing was written"
        )
    manifest = copy.deepcopy(read_manifest(src) or {})
    manifest.setdefault("history", []).append(history_entry("export", format="stock", source=str(src)))
    manifest["export"] = record
    write_manifest(tmp, manifest)
    return record
