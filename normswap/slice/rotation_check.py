"""The check before anything is published: the rotation alone reproduces the conversion.

The model rotated by the full basis and kept d − 1 wide (only the all-ones direction deleted, which
an exact conversion's stream never uses) must compute what the conversion computes: every writer,
every reader, every table and the head adapter pass through the same code as the sliced model, so
a wrong rotation of any one of them shows here. The comparison is convert's: per-token
log-probabilities over the whole vocabulary on convert's probe batch (convert/verify.py
``verification_ids``), max |Δ| held to the tolerance, or to 4× the reference's own float32-vs-float64
floor where that is larger (measured only when needed).
"""

from __future__ import annotations

import copy

import torch

from normswap.convert.verify import verification_ids


def _logprobs(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits.double().log_softmax(-1).cpu()


def compare(reference, candidate, *, tokenizer=None, tolerance: float) -> dict:
    """{max_abs_logprob_diff, threshold, noise_floor, passed}: ``candidate`` against ``reference`` (two
    causal LMs in memory, same device) on the probe batch."""
    device = next(reference.parameters()).device
    inputs = {k: v.to(device) for k, v in verification_ids(tokenizer, reference.config).items()}

    def float64_reference():
        if next(reference.parameters()).dtype == torch.float64:
            return None
        return _logprobs(copy.deepcopy(reference).double(), inputs)

    return judge(_logprobs(reference, inputs), _logprobs(candidate, inputs), tolerance, float64_reference)


def judge(ref: torch.Tensor, got: torch.Tensor, tolerance: float, float64_reference=None) -> dict:
    """The verdict on two log-prob tensors of the probe batch (float64): max |Δ| held to the
    tolerance, or to 4× the reference's float32-vs-float64 floor where that is larger;
    ``float64_reference()`` gives the reference's log-probs in float64 (None: not measurable), and
    is called only when the difference exceeds the tolerance."""
    diff = float((ref - got).abs().max())
    result = {
        "metric": "max_abs_logprob_diff",
        "probe_tokens": int(ref.shape[0] * ref.shape[1]),
        "max_abs_logprob_diff": diff,
        "max_abs_diff": diff,
        "threshold": float(tolerance),
        "noise_floor": None,
    }
    if diff > tolerance and float64_reference is not None:
        try:
            hi = float64_reference()
            if hi is not None:
                result["noise_floor"] = float((hi - ref).abs().max())
                result["threshold"] = max(result["threshold"], 4 * result["noise_floor"])
        except (RuntimeError, NotImplementedError):  # some modeling code does not run in float64
            result["noise_floor_note"] = "not measured: the model does not run in float64"
    result["passed"] = diff <= result["threshold"]
    return result
