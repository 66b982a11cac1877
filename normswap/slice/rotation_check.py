"""The check before anything is published: the rotation alone reproduces the conversion.

The model rotated by the full basis and kept d − 1 wide (only the all-ones direction deleted, which
an exact conversion's stream never uses) must compute what the conversion computes: every writer,
every reader, every table and the head adapter pass through the same code as the sliced model, so
a wrong rotation of any one of them shows here. The comparison is convert's: per-token
log-probabilities over the whole vocabulary on convert's probe batch (convert/verify.py
``verification_ids``), judged by convert's two-part rule (convert/pass_rule.py): the rotation
computed in float64 run in float64 against the conversion in float64 (is it exact), and the float32
rotated model's drift from that float64 truth, held to the tolerance or to 4× the conversion's own
float32 floor capped at ``pass_rule.FLOOR_CAP`` (no checkpoint widens it).

``judge_outputs`` is the rule on four output tensors, for a pipeline that compares layer by layer;
``compare`` runs whole models in memory; ``check_rotation`` builds the two rotated candidates itself.
"""

from __future__ import annotations

import copy

import torch

from normswap.convert import pass_rule
from normswap.convert.verify import verification_ids


def _logprobs(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits.double().log_softmax(-1).cpu()


def _in_float64(model, inputs) -> torch.Tensor:
    """``model``'s log-probs with float64 as torch's default dtype (modeling code that builds constants
    in the default dtype, XGLM's mask floor, then runs in float64)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _logprobs(model, inputs)
    finally:
        torch.set_default_dtype(previous)


def judge_outputs(ref32, ref64, got32, got64, *, tolerance: float) -> dict:
    """The pass rule on one comparison's outputs (a layer's, or the log-probs): the reference (the
    conversion) in float32 and float64, the candidate (the rotation) in float32 and, computed in
    float64, in float64 (None where it cannot run in float64: the float32 comparison alone decides)."""
    figures = {"max_abs_diff": pass_rule.max_abs(ref32, got32), "noise_floor": None, "exact_float64": None}
    if ref64 is not None:
        figures["noise_floor"] = pass_rule.max_abs(ref32, ref64)
        figures["drift_float32"] = pass_rule.max_abs(got32, ref64)
        if got64 is not None:
            figures["exact_float64"] = pass_rule.max_abs(got64, ref64)
    else:
        figures["drift_float32"] = figures["max_abs_diff"]
    verdict = pass_rule.judge(
        exact_float64=figures["exact_float64"],
        drift_float32=figures["drift_float32"],
        noise_floor=figures["noise_floor"],
        tolerance=tolerance,
    )
    return {**figures, **verdict}


def compare(
    reference, candidate, *, tokenizer=None, tolerance: float, candidate_float64=None, reference_float64=None
) -> dict:
    """{max_abs_logprob_diff, exact_float64, drift_float32, noise_floor, threshold, passed, ...}:
    ``candidate`` against ``reference`` (two causal LMs in memory, same device) on the probe batch.
    ``candidate_float64``: the candidate as computed in float64 (its weights derived in float64, not
    ``candidate`` cast: float32-rounded weights are not the exact rotation); without it the exactness
    question is not asked and the float32 drift alone decides. ``reference_float64``: the reference
    cast to float64 where the caller has it already (else a copy is made here)."""
    device = next(reference.parameters()).device
    inputs = {k: v.to(device) for k, v in verification_ids(tokenizer, reference.config).items()}
    ref32 = _logprobs(reference, inputs)
    got32 = _logprobs(candidate, inputs)
    ref64 = got64 = None
    note = None
    try:
        ref64 = _in_float64(reference_float64 or copy.deepcopy(reference).double(), inputs)
        if candidate_float64 is not None:
            got64 = _in_float64(candidate_float64, inputs)
    except (RuntimeError, NotImplementedError) as e:  # modeling code that does not run in float64 at all
        note = f"not measured: the model does not run in float64 ({str(e)[:120]})"
    result = {
        "metric": "max_abs_logprob_diff",
        "probe_tokens": int(inputs["input_ids"].numel()),
        **judge_outputs(ref32, ref64, got32, got64, tolerance=tolerance),
    }
    result["max_abs_logprob_diff"] = result["max_abs_diff"]
    if note:
        result["noise_floor_note"] = note
    return result


def check_rotation(model, stream, q, *, basis: str, tokenizer=None, tolerance: float) -> dict:
    """The F = 0 check of slice: ``model`` (the conversion) rotated by ``q`` and kept d − 1 wide, built
    in float32 and (from a float64 copy of the conversion, so the rotation's arithmetic is exact) in
    float64, against the conversion (``compare``)."""
    from normswap.slice.model import rotate_model

    d = stream.hidden_size
    candidate = rotate_model(model, stream, q, d - 1, fraction=0.0, basis=basis)
    wide = copy.deepcopy(model).double()
    candidate64 = rotate_model(wide, stream, q.double(), d - 1, fraction=0.0, basis=basis)
    try:
        return compare(
            model,
            candidate,
            tokenizer=tokenizer,
            tolerance=tolerance,
            candidate_float64=candidate64,
            reference_float64=wide,
        )
    finally:
        del candidate, candidate64


def judge(ref: torch.Tensor, got: torch.Tensor, tolerance: float, float64_reference=None) -> dict:
    """The verdict on two log-prob tensors of the probe batch (the streamed pipeline's check): max |Δ|
    held to the pass rule of normswap/convert/pass_rule.py, the float32 question: the tolerance, or
    4x the reference's float32-vs-float64 floor where that is larger, the floor's share capped so that
    no checkpoint can widen it (security S7.3). ``float64_reference()`` gives the reference's log-probs
    in float64 (None: not measurable); it is called only when the difference exceeds the tolerance."""
    diff = pass_rule.max_abs(ref, got)
    floor, note = None, None
    if diff > tolerance and float64_reference is not None:
        try:
            hi = float64_reference()
            if hi is not None:
                floor = pass_rule.max_abs(hi, ref)
        except (RuntimeError, NotImplementedError):  # some modeling code does not run in float64
            note = "not measured: the model does not run in float64"
    verdict = pass_rule.judge(exact_float64=None, drift_float32=diff, noise_floor=floor, tolerance=tolerance)
    result = {
        "metric": "max_abs_logprob_diff",
        "probe_tokens": int(ref.shape[0] * ref.shape[1]),
        "max_abs_logprob_diff": diff,
        "max_abs_diff": diff,
        "noise_floor": floor,
        **verdict,
    }
    if note:
        result["noise_floor_note"] = note
    return result


def reload_tolerance(dtype) -> float:
    """The reload check's tolerance: the sliced model is float32 in memory; a 16-bit checkpoint reloads
    with its weights rounded (used by the streamed and the in-memory path alike)."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 0.5
