"""`normswap slice SRC OUT`, end to end: check, (convert,) calibrate, rotate, verify, write, publish.

1. Everything that can be refused is refused first, in one line: the options, OUT, the source (a
   causal LM, a LayerNorm original with a family or a normswap exact conversion), the calibration
   text (tokenised before any weight is read).
2. A LayerNorm original is converted exactly first (``convert_checkpoint``, verified as `convert`
   verifies) into a private temporary directory that is removed afterwards.
3. No model is ever whole in memory (slice/streamed.py): the conversion's files are read tensor
   by tensor as each module runs (convert's Blockwise runner), the calibration blocks run through
   the model one module's weights at a time with Σ gathered at every norm (float64), and the basis
   is fitted (slice/basis.py).
4. The rotation alone (only the all-ones direction deleted) must reproduce the conversion
   (slice/rotation_check.py ``judge``), each rotated tensor computed from the file tensor when its
   module runs: otherwise ``VerificationError`` (exit 1) and nothing is written.
5. The sliced checkpoint is written tensor by tensor into a staging directory in the source's dtype
   (each stream tensor rotated from the conversion's, slice/rotate.py ``rotated_tensor``) with its
   config (``normswap.slice``: the width and the tensors it narrows), the remote code, the
   tokenizer, the manifest, ``slice.json`` (the figures: width, parameters, kept and dropped energy
   per norm) and the model card; the staged files are read back through the class users load and
   must give the sliced model's log-probabilities (before rounding); only then is OUT published.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from normswap.checkpoint import load as ckload
from normswap.checkpoint.card import write_model_card
from normswap.checkpoint.manifest import history_entry, read_manifest, write_manifest
from normswap.checkpoint.shards import parse_size
from normswap.checkpoint.side_files import copy_side_files
from normswap.checkpoint.write import write_config_and_code
from normswap.convert import tensor_match as ckinputs
from normswap.convert.verify import verification_ids
from normswap.errors import NormswapError, VerificationError
from normswap.publish import atomic_write_json, publish_dir, staging_dir
from normswap.slice import auto as auto_search
from normswap.slice import basis as bases
from normswap.slice import in_memory, streamed
from normswap.slice import rotation_check as verification
from normswap.slice.calibrate import block_length, calibration_batches, held_out_batches
from normswap.slice.config import SliceOptions, check_out, is_auto, options_from
from normswap.slice.model import check_fraction, parameter_count
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
    if not is_auto(options):
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
    if options.memory_budget:  # before any weight is read: a budget too small for one layer is refused here
        per = streamed.blocks_per_batch(
            _budget(options.memory_budget), ckinputs.skeleton(config), config, seq_len, most=len(batches[0])
        )
        batches = list(torch.cat(batches).split(per))
    held_out = held_out_batches(tokenizer, options.data, options.eval_tokens, seq_len)
    if is_auto(options) and not held_out[0]:  # before any weight is read
        raise NormswapError(
            f"--fraction auto: {options.data}'s {held_out[1]} split gives no held-out block of {seq_len} tokens "
            f"within --eval-tokens {options.eval_tokens}: nothing to measure the perplexity on"
        )
    with tempfile.TemporaryDirectory(prefix="normswap-slice-") as private:
        if _is_conversion(config):
            converted, conversion = resolved, None
        else:
            from normswap.convert.pipeline import convert_checkpoint

            say(f"{src} is not a normswap conversion: converting it exactly first (verified)")
            converted = Path(private) / "converted"
            try:
                # in float32 whatever the source's dtype: a 16-bit conversion's centred writers, rounded, keep a
                # little of the stream along the all-ones direction that slicing deletes first (a bf16
                # GPT-NeoX moved 0.0117 nats at the rotation-alone check); the slice is written in SRC's dtype
                conversion = convert_checkpoint(
                    resolved, converted, mode="exact", dtype="float32", device=device, progress=progress
                )
            except VerificationError:
                raise
            except NormswapError as e:
                raise NormswapError(f"cannot slice {src}: its exact conversion was refused: {e}") from None
        return _slice_converted(
            src,
            converted,
            out,
            options,
            (batches, held_out),
            tokenizer,
            force=force,
            device=device,
            say=say,
            t0=t0,
            conversion=conversion,
            out_dtype=None if conversion is None else _stored_dtype(config),
        )


def _budget(text) -> int:
    try:
        return parse_size(text)
    except NormswapError:
        raise NormswapError(f"--memory-budget: cannot read {text!r} as a size (e.g. 4GiB, 800MB)") from None


def _stored_dtype(config) -> torch.dtype:
    """The dtype a checkpoint's config says its weights are stored in (float32 where it says none)."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return getattr(torch, str(stored).replace("torch.", ""), torch.float32)


def _slice_converted(
    src, converted, out, options, texts, tokenizer, *, force, device, say, t0, conversion, out_dtype=None
) -> dict:
    batches, held_out = texts
    parts = Parts()
    with (
        streamed.ConvertedFiles(Path(converted), str(src)) as conv,
        tempfile.TemporaryDirectory(prefix="normswap-slice-rotated-") as private,
    ):
        config = conv.config
        out_dtype = out_dtype or _stored_dtype(config)  # SRC's, where slice converted SRC itself
        stream = streamed.check_stream(conv)
        if in_memory.needs_memory(stream):  # BLOOM, XGLM: the model is loaded whole (slice/in_memory.py)
            figures = in_memory.slice_in_memory(
                src,
                converted,
                out,
                options,
                batches,
                tokenizer,
                force=force,
                device=device,
                say=say,
                out_dtype=out_dtype,
                finish=lambda tmp, figures, block: _finish_in_memory(
                    converted, src, options, figures, block, conversion
                ),
            )
            return _summary(figures, out, t0)
        d = stream.hidden_size
        k = None if is_auto(options) else bases.width_for(d, options.fraction, options.round_to)
        spill, rotated_dir = Path(private) / "moments", Path(private) / "rotated"
        spill.mkdir()
        rotated_dir.mkdir()
        say(f"calibrating on {sum(int(b.numel()) for b in batches):,} tokens, one module's weights at a time")
        with parts.timed("calibration"):
            moments, tokens = streamed.calibrate(
                streamed.skeleton(config),
                conv.fetch,
                batches,
                list(stream.norms),
                dtype=_run_dtype(device),
                device=device,
                say=say,
                spill=spill,
            )
        q = bases.pca_basis(moments.total)[0] if options.basis == "pca" else bases.random_basis(d, options.seed)
        say(f"rotating the residual stream of width {d} ({options.basis} basis, {tokens:,} calibration tokens)")
        with parts.timed("rotation"):
            rotated, spent = streamed.rotate_once(
                conv, stream, q, rotated_dir, streamed.calc_dtype(out_dtype), device=device, say=say
            )
        parts.seconds["rotation_parts"] = {key: round(v, 3) for key, v in spent.items()}
        try:
            probe = verification_ids(tokenizer, config)
            with parts.timed("rotation_check"):
                check = _rotation_alone(conv, rotated, config, stream, q, probe, options, device=device, say=say)
            chosen = {}  # --fraction auto: the search's record and the source's perplexity, measured once
            if k is None:
                with parts.timed("auto"):
                    k, options, chosen = _choose_width(conv, rotated, stream, q, held_out, options, device, say)
            say(f"slicing the residual stream from {d} to {k}")
            sliced_cfg = streamed.sliced_config(config, stream, k, fraction=options.fraction, basis=options.basis)
            weights = streamed.RotatedWeights(conv, rotated, stream, q, sliced_cfg)
            figures = _figures(src, options, conv, sliced_cfg, moments, q, tokens, check, out_dtype)
            if chosen:
                figures["auto"] = chosen["auto"]
            manifest = _manifest(converted, src, options, k, figures, conversion)
            with staging_dir(out) as tmp:
                meta = streamed.skeleton(sliced_cfg, out_dtype, buffers=False)
                say(f"writing the sliced checkpoint ({figures['parameters_after']:,} parameters), tensor by tensor")
                with parts.timed("write"):
                    write_config_and_code(meta, tmp)
                    streamed.write_sliced(tmp, meta, weights, out_dtype, say=say)
                    copy_side_files(Path(converted), tmp)
                    write_manifest(tmp, manifest)
                say("checking the written checkpoint loads back to the same model")
                with parts.timed("reload_check"):
                    figures["reload_check"] = _reload_check(weights, sliced_cfg, tmp, probe, out_dtype, device)
                with parts.timed("perplexity"):
                    figures["perplexity"] = _perplexities(
                        conv, tmp, held_out, options, device=device, say=say, source=chosen.get("source")
                    )
                if conversion is not None:  # the exact conversion, made first into a private directory
                    parts.seconds["convert"] = conversion.get("seconds")
                figures["seconds_parts"] = parts.seconds
                figures["peak_rss_bytes"] = peak_rss_bytes()
                if str(device).startswith("cuda"):  # one layer's weights and one batch there, never the model
                    figures["peak_device_bytes"] = int(torch.cuda.max_memory_allocated())
                atomic_write_json(tmp / SLICE_JSON, figures, indent=2)
                write_model_card(tmp, manifest, json.loads((tmp / "config.json").read_text()))
                publish_dir(tmp, out, force=force)
        finally:
            rotated.close()
    return _summary(figures, out, t0)


def _summary(figures, out, t0) -> dict:
    return {
        **{key: v for key, v in figures.items() if key != "kept_energy"},
        "out": str(out),
        "figures": str(Path(out) / SLICE_JSON),
        "kept_energy": figures["kept_energy"],
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _finish_in_memory(converted, src, options, figures, block, conversion) -> dict:
    """The in-memory path's figures completed as the streamed path's are; returns the manifest."""
    figures.update(
        seed=options.seed,
        round_to=options.round_to,
        data=options.data,
        calibration_split="train",
        head=_head_record(block),
        peak_rss_bytes=peak_rss_bytes(),
    )
    return _manifest(converted, src, options, figures["width"], figures, conversion)


class Parts:
    """Seconds spent in each named part of the run (the summary's ``seconds_parts``)."""

    def __init__(self):
        self.seconds: dict = {}

    @contextmanager
    def timed(self, name):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - t0, 3)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports kilobytes)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _figures(src, options, conv, sliced_cfg, moments, q, tokens, check, out_dtype) -> dict:
    d, k = int(sliced_cfg.normswap["slice"]["hidden_size"]), int(sliced_cfg.normswap["slice"]["width"])
    kept_total = bases.kept_energy(moments.total, q[:, :k])
    return {
        "normswap_version": __version__,
        "source": str(src),
        "width": k,
        "hidden_size": d,
        "fraction": options.fraction,
        "basis": options.basis,
        "parameters_before": parameter_count(conv.meta),
        "parameters_after": parameter_count(streamed.skeleton(sliced_cfg, out_dtype, buffers=False)),
        "calibration_tokens": tokens,
        "kept_energy_total": kept_total,
        "dropped_energy_total": 1.0 - kept_total,
        "kept_energy": {name: bases.kept_energy(s, q[:, :k]) for name, s in moments.items()},
        "seed": options.seed,
        "round_to": options.round_to,
        "data": options.data,
        "calibration_split": "train",
        "head": _head_record(sliced_cfg.normswap),
        "verification": check,
    }


def _choose_width(conv, rotated, stream, q, held_out, options, device, say):
    """--fraction auto (slice/auto.py): the source's held-out perplexity once, then each width the
    bisection tries read as a prefix of the one rotation (nothing written); (width, the options
    with the chosen fraction, {"auto": the search's record, "source": the source's perplexity})."""
    batches, split = held_out
    dtype, d = _run_dtype(device), stream.hidden_size
    say(f"auto: perplexity on {sum(int(b.numel()) for b in batches):,} held-out tokens ({split} split), the source")
    source = streamed.perplexity(streamed.skeleton(conv.config), conv.fetch, batches, dtype=dtype, device=device)

    def evaluate(width):
        cfg = streamed.sliced_config(
            conv.config, stream, width, fraction=auto_search.fraction_of(width, d), basis=options.basis
        )
        weights = streamed.RotatedWeights(conv, rotated, stream, q, cfg)
        return streamed.perplexity(streamed.skeleton(cfg), weights.fetch, batches, dtype=dtype, device=device)

    widths = auto_search.width_grid(d, options.round_to)
    record = auto_search.search(widths, d, source, evaluate, options.max_ppl_increase, say=say)
    width = record["chosen"]["width"]
    return (
        width,
        dataclasses.replace(options, fraction=record["chosen"]["fraction"]),
        {"auto": record, "source": source},
    )


def _perplexities(conv, staged, held_out, options, *, device, say, source=None) -> dict:
    """The conversion's (the source's: an exact conversion computes what it computes; ``source`` when
    already measured) and the written checkpoint's perplexity on the held-out blocks, both streamed
    one module at a time."""
    batches, split = held_out
    record = {"data": options.data, "split": split, "tokens": sum(int(b.numel()) for b in batches)}
    if not batches:
        return {**record, "source": None, "sliced": None, "note": "not measured (--eval-tokens 0 or no held-out text)"}
    dtype = _run_dtype(device)
    say(f"perplexity on {record['tokens']:,} held-out tokens ({split} split): the conversion, then the sliced model")
    before = source
    if before is None:
        before = streamed.perplexity(streamed.skeleton(conv.config), conv.fetch, batches, dtype=dtype, device=device)
    with streamed.ConvertedFiles(Path(staged), "the written checkpoint") as written:
        after = streamed.perplexity(
            streamed.skeleton(written.config), written.fetch, batches, dtype=dtype, device=device
        )
    return {**record, "source": before, "sliced": after, "ratio": after / before}


def _run_dtype(device) -> torch.dtype:
    # on a GPU the forwards run in bfloat16 (Σ still sums in float64); on the CPU in float32
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def _rotation_alone(conv, rotated, config, stream, q, probe, options, *, device, say) -> dict:
    """The rotation alone (only u deleted, width d − 1) against the conversion on the probe batch,
    both run one module at a time; VerificationError (nothing written) when it moves the log-probs."""
    d = stream.hidden_size
    say(f"verifying: the rotation alone (width {d - 1}) against the conversion on the probe batch")
    ref = streamed.logprobs(streamed.skeleton(config), conv.fetch, probe, device=device)
    exact_cfg = streamed.sliced_config(config, stream, d - 1, fraction=0.0, basis=options.basis)
    exact = streamed.RotatedWeights(conv, rotated, stream, q, exact_cfg)
    got = streamed.logprobs(streamed.skeleton(exact_cfg), exact.fetch, probe, device=device)

    def float64_reference():
        return streamed.logprobs(
            streamed.skeleton(config, torch.float64), conv.fetch, probe, dtype=torch.float64, device=device
        )

    check = verification.judge(ref, got, options.tolerance, float64_reference)
    if not check["passed"]:
        raise VerificationError(
            f"verification failed: the rotation alone moves max |Δ log-prob| by {check['max_abs_diff']:.3g} > "
            f"{check['threshold']:.3g}; nothing was written (a writer or reader is rotated wrongly)"
        )
    return check


def _reload_check(weights, sliced_cfg, tmp, probe, out_dtype, device) -> dict:
    """The staged checkpoint, read back through the class users load, against the sliced model as
    computed before its rounding to the output dtype; VerificationError when they differ."""
    ref = streamed.logprobs(streamed.skeleton(sliced_cfg), weights.fetch, probe, device=device)
    with streamed.ConvertedFiles(Path(tmp), "the written checkpoint") as written:
        got = streamed.logprobs(streamed.skeleton(written.config), written.fetch, probe, device=device)
    check = verification.judge(ref, got, verification.reload_tolerance(out_dtype))
    if not check["passed"]:
        raise VerificationError(
            f"the written checkpoint does not reload to the sliced model (max |Δ log-prob| "
            f"{check['max_abs_diff']:.3g}); nothing was written"
        )
    return check


def _manifest(converted, src, options, k, figures, conversion) -> dict:
    manifest = dict(read_manifest(converted) or {})
    manifest.setdefault("history", [])
    manifest["history"] = list(manifest["history"]) + [
        history_entry("slice", source=str(src), fraction=options.fraction, width=k, basis=options.basis)
    ]
    manifest["slice"] = dict(figures)
    manifest["slice"]["figures"] = SLICE_JSON
    if conversion is not None:
        manifest["slice"]["conversion"] = {"verification": conversion.get("verification")}
    return manifest


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
