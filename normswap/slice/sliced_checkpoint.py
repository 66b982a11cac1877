"""`normswap slice SRC OUT`, end to end: check, (convert,) calibrate, rotate, verify, write, publish.

1. Everything that can be refused is refused first, in one line: the options, OUT, the source (a
   causal LM, a LayerNorm original with a family or a normswap exact conversion), the calibration
   text (tokenised before any weight is read).
2. A LayerNorm original is converted exactly first (``convert_checkpoint``, verified as `convert`
   verifies) into a private temporary directory that is removed afterwards.
3. The conversion is loaded in float32, run over the calibration blocks (slice/calibrate.py), the
   basis fitted (slice/basis.py), and the model rotated and sliced (slice/model.py).
4. The rotation alone (only the all-ones direction deleted) must reproduce the conversion
   (slice/rotation_check.py): otherwise ``VerificationError`` (exit 1) and nothing is written.
5. The sliced model is written into a staging directory in the source's dtype with its config
   (``normswap.slice``: the width and the tensors it narrows), the remote code, the tokenizer, the
   manifest, ``slice.json`` (the figures: width, parameters, kept and dropped energy per norm) and
   the model card; the staged checkpoint is loaded back through the class users load and must
   give the in-memory sliced model's log-probabilities; only then is OUT published.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
from pathlib import Path

import torch

from normswap.checkpoint import load as ckload
from normswap.checkpoint.card import write_model_card
from normswap.checkpoint.manifest import history_entry, read_manifest, write_manifest
from normswap.checkpoint.write import write_checkpoint_dir
from normswap.errors import NormswapError, VerificationError
from normswap.publish import atomic_write_json, publish_dir, staging_dir
from normswap.slice import rotation_check as verification
from normswap.slice.calibrate import block_length, calibration_batches
from normswap.slice.config import SliceOptions, check_out, options_from
from normswap.slice.model import check_fraction, rotate_model, slice_model
from normswap.version import __version__

SLICE_JSON = "slice.json"


def _is_conversion(config) -> bool:
    block = getattr(config, "normswap", None)
    return isinstance(block, dict) and bool(block.get("format_version"))


def slice_checkpoint(
    src, out, options: SliceOptions | None = None, *, force=False, device="cpu", progress=None, **fields
) -> dict:
    """Slice SRC (a LayerNorm original or a normswap exact conversion) into OUT; return the summary
    `--json` prints: the width, the fraction, parameters before and after, the kept energy (total
    and per norm), the verification figures and where the figures are written (slice.json)."""
    options = options_from(options, fields)
    check_fraction(options.fraction, allow_zero=False)
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    out = check_out(src, out, force=force, data=options.data)
    resolved = ckload.resolve(src)
    config = ckload.load_config(resolved)
    if not ckload.is_causal_lm(config):
        raise NormswapError(
            f"cannot slice {src}: slice calibrates on text through a causal language model's forward, "
            f"and {getattr(config, 'model_type', '?')} has none"
        )
    tokenizer = ckload.load_tokenizer(resolved)
    seq_len = block_length(config)
    batches = calibration_batches(tokenizer, options.data, options.calibration_tokens, seq_len, options.seed)
    with tempfile.TemporaryDirectory(prefix="normswap-slice-") as private:
        if _is_conversion(config):
            converted, conversion = resolved, None
        else:
            from normswap.convert.pipeline import convert_checkpoint

            say(f"{src} is not a normswap conversion: converting it exactly first (verified)")
            converted = Path(private) / "converted"
            try:
                conversion = convert_checkpoint(resolved, converted, mode="exact", device=device, progress=progress)
            except VerificationError:
                raise
            except NormswapError as e:
                raise NormswapError(f"cannot slice {src}: its exact conversion was refused: {e}") from None
        return _slice_converted(
            src,
            converted,
            out,
            options,
            batches,
            tokenizer,
            force=force,
            device=device,
            say=say,
            t0=t0,
            conversion=conversion,
        )


def _slice_converted(src, converted, out, options, batches, tokenizer, *, force, device, say, t0, conversion) -> dict:
    stored = ckload.load_config(converted)
    stored_dtype = getattr(stored, "dtype", None) or getattr(stored, "torch_dtype", None) or "float32"
    model = ckload.load_model(converted, dtype=torch.float32, device=device, task="causal-lm")
    result = slice_model(
        model,
        batches,
        options.fraction,
        basis=options.basis,
        seed=options.seed,
        round_to=options.round_to,
        progress=say,
    )
    d, k = result.hidden_size, result.width
    say(f"verifying: the rotation alone (width {d - 1}) against the conversion on the probe batch")
    exact = rotate_model(model, result.stream, result.basis_matrix, d - 1, fraction=0.0, basis=options.basis)
    check = verification.compare(model, exact, tokenizer=tokenizer, tolerance=options.tolerance)
    del exact
    if not check["passed"]:
        raise VerificationError(
            f"verification failed: the rotation alone moves max |Δ log-prob| by {check['max_abs_diff']:.3g} > "
            f"{check['threshold']:.3g}; nothing was written (a writer or reader is rotated wrongly)"
        )
    sliced = result.model
    figures = {
        "normswap_version": __version__,
        "source": str(src),
        **result.summary(),
        "seed": options.seed,
        "round_to": options.round_to,
        "data": options.data,
        "calibration_split": "train",
        "head": _head_record(sliced.config.normswap),
        "verification": check,
    }
    manifest = dict(read_manifest(converted) or {})
    manifest.setdefault("history", [])
    manifest["history"] = list(manifest["history"]) + [
        history_entry("slice", source=str(src), fraction=options.fraction, width=k, basis=options.basis)
    ]
    manifest["slice"] = dict(figures)
    manifest["slice"]["figures"] = SLICE_JSON
    if conversion is not None:
        manifest["slice"]["conversion"] = {"verification": conversion.get("verification")}
    out_dtype = getattr(torch, str(stored_dtype).replace("torch.", ""), torch.float32)
    with staging_dir(out) as tmp:
        say(f"writing the sliced checkpoint ({result.parameters_after:,} parameters, was {result.parameters_before:,})")
        written = sliced if out_dtype == torch.float32 else copy.deepcopy(sliced).to(out_dtype)
        write_checkpoint_dir(written, tmp, source_dir=converted, max_shard_size="5GB")
        del written
        write_manifest(tmp, manifest)
        atomic_write_json(tmp / SLICE_JSON, figures, indent=2)
        say("checking the written checkpoint loads back to the same model")
        reloaded = ckload.load_model(tmp, dtype=torch.float32, device=device, task="causal-lm")
        reload_check = verification.compare(
            sliced, reloaded, tokenizer=tokenizer, tolerance=_reload_tolerance(out_dtype)
        )
        if not reload_check["passed"]:
            raise VerificationError(
                f"the written checkpoint does not reload to the sliced model (max |Δ log-prob| "
                f"{reload_check['max_abs_diff']:.3g}); nothing was written"
            )
        figures["reload_check"] = reload_check
        atomic_write_json(tmp / SLICE_JSON, figures, indent=2)
        write_model_card(tmp, manifest, json.loads((tmp / "config.json").read_text()))
        publish_dir(tmp, out, force=force)
    return {
        **{key: v for key, v in figures.items() if key != "kept_energy"},
        "out": str(out),
        "figures": str(Path(out) / SLICE_JSON),
        "kept_energy": figures["kept_energy"],
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _reload_tolerance(dtype) -> float:
    # the in-memory model is float32; a 16-bit checkpoint reloads with its weights rounded
    return 1e-4 if dtype in (torch.float32, torch.float64) else 0.5


def _head_record(block: dict) -> str:
    """How the head was kept, in words (the model card and the summary say it)."""
    info = block.get("slice", {})
    if info.get("head_adapter"):
        return (
            "tied, with a head adapter (R, g, m): the final norm's γ moved into a k×k matrix after the norm, "
            "its β into a stored logits bias E·β computed from the original table"
        )
    if block.get("tied"):
        return "tied; the norm-width gain kept as the final norm's weight"
    return "untied: the head reads the sliced stream like every other reader"
