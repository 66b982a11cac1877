"""`normswap slice` for the streams the streamed writer cannot build tensor by tensor yet: a stream
that starts from a table computed from other tensors (BLOOM's embedding norm over its table, XGLM's
sinusoidal position table). The conversion is loaded whole in float32, sliced by ``slice_model``,
checked (the rotation alone, both questions of the pass rule: exact in float64, float32 drift),
written and reloaded; the model must fit in memory, which the streamed path does not need. Every
other family goes through slice/sliced_checkpoint.py's streamed path.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from normswap.checkpoint import load as ckload
from normswap.checkpoint.card import write_model_card
from normswap.checkpoint.manifest import write_manifest
from normswap.checkpoint.write import write_checkpoint_dir
from normswap.errors import VerificationError
from normswap.publish import atomic_write_json, publish_dir, staging_dir
from normswap.slice import rotation_check as verification
from normswap.slice.model import slice_model
from normswap.version import __version__


def needs_memory(stream) -> bool:
    """Whether the stream starts from a table computed from others (sliced here, in memory)."""
    return bool(stream.embedding_norm or getattr(stream, "computed_tables", None))


def slice_in_memory(src, converted, out, options, batches, tokenizer, *, force, device, say, out_dtype, finish):
    """Slice the conversion at ``converted`` into ``out``; returns the figures. ``finish(tmp, figures,
    block)`` completes them (the caller's records: the head in words, the options) and returns the
    manifest to write; slice.json is written here, after it."""
    say("its stream starts from a computed table (an embedding norm or sinusoidal positions): sliced in memory")
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
    d = result.hidden_size
    say(f"verifying: the rotation alone (width {d - 1}) against the conversion, in float64 and float32")
    check = verification.check_rotation(
        model, result.stream, result.basis_matrix, basis=options.basis, tokenizer=tokenizer, tolerance=options.tolerance
    )
    if not check["passed"]:
        raise VerificationError(
            f"verification failed: the rotation alone: {check.get('reason') or 'over the threshold'}; nothing was "
            "written (a writer or reader is rotated wrongly)"
        )
    sliced = result.model
    figures = {"normswap_version": __version__, "source": str(src), **result.summary(), "verification": check}
    with staging_dir(out) as tmp:
        written = sliced if out_dtype == torch.float32 else copy.deepcopy(sliced).to(out_dtype)
        write_checkpoint_dir(written, tmp, source_dir=converted, max_shard_size="5GB")
        del written
        say("checking the written checkpoint loads back to the same model")
        reloaded = ckload.load_model(tmp, dtype=torch.float32, device=device, task="causal-lm")
        tolerance = verification.reload_tolerance(out_dtype)
        reload_check = verification.compare(sliced, reloaded, tokenizer=tokenizer, tolerance=tolerance)
        if not reload_check["passed"]:
            raise VerificationError(
                f"the written checkpoint does not reload to the sliced model (max |Δ log-prob| "
                f"{reload_check['max_abs_diff']:.3g}); nothing was written"
            )
        figures["reload_check"] = reload_check
        manifest = finish(tmp, figures, sliced.config.normswap)
        write_manifest(tmp, manifest)
        atomic_write_json(Path(tmp) / "slice.json", figures, indent=2)
        write_model_card(tmp, manifest, json.loads((Path(tmp) / "config.json").read_text()))
        publish_dir(tmp, out, force=force)
    return figures
