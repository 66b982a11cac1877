"""Two checkpoints side by side on convert's probe batch (convert/verify.py), one module's weights
resident at a time: the check every export passes before it is published."""

from __future__ import annotations

import torch

from normswap.architectures.probes import complete_inputs
from normswap.convert import verify as verification


def probe(opened) -> tuple[dict, torch.Tensor]:
    """(model inputs, input ids) of convert's probe for ``opened``'s model."""
    skel = opened.build()
    inputs = verification.verification_ids(opened.tokenizer(), skel.config)
    ids = inputs["input_ids"]
    return complete_inputs(skel, inputs), ids


def compare_models(reference, candidate, *, tolerance: float, transform=None, dtype=None) -> dict:
    """Max |Δ| of log-probs (causal LMs) or first outputs between two ``Opened`` checkpoints, in float64
    where both models run in it (else float32). ``transform``: applied to the candidate's skeleton
    before it runs (e.g. its norms swapped)."""
    inputs, ids = probe(reference)
    causal = reference.causal
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtypes = [dtype] if dtype is not None else [torch.float64, torch.float32]
    last = None
    for dt in dtypes:
        try:
            ref = verification.outputs(
                lambda dt=dt: reference.build(dt), reference.fetch, dt, inputs, causal, resident_ok=True
            )
            skel = candidate.build(dt)
            got = verification.outputs(
                lambda skel=skel: transform(skel) if transform else skel,
                candidate.fetch,
                dt,
                inputs,
                causal,
                resident_ok=True,
            )
            break
        except (RuntimeError, NotImplementedError) as e:  # some modeling code does not run in float64
            last = e
    else:
        raise last
    diff = float((ref - got).abs().max()) if ref.shape == got.shape else float("inf")
    return {
        "metric": "max_abs_logprob_diff" if causal else "max_abs_output_diff",
        "dtype": str(dt).replace("torch.", ""),
        "probe_tokens": int(ids.numel()),
        "max_abs_diff": diff,
        "threshold": tolerance,
        "passed": bool(diff <= tolerance),
    }
