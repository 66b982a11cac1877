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
    ref = _logprobs(reference, inputs)
    got = _logprobs(candidate, inputs)
    diff = float((ref - got).abs().max())
    result = {
        "metric": "max_abs_logprob_diff",
        "probe_tokens": int(inputs["input_ids"].numel()),
        "max_abs_logprob_diff": diff,
        "max_abs_diff": diff,
        "threshold": float(tolerance),
        "noise_floor": None,
    }
    if diff > tolerance and next(reference.parameters()).dtype != torch.float64:
        try:
            hi = _logprobs(copy.deepcopy(reference).double(), inputs)
            result["noise_floor"] = float((hi - ref).abs().max())
            result["threshold"] = max(result["threshold"], 4 * result["noise_floor"])
        except (RuntimeError, NotImplementedError):  # some modeling code does not run in float64
            result["noise_floor_note"] = "not measured: the model does not run in float64"
    result["passed"] = diff <= result["threshold"]
    return result
