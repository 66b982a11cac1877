"""Greedy decode through the KV cache, timed: the loop the bench drivers that compare models'
per-token decode share (bench/cpu_models_attribution.py, bench/weights_alignment.py, bench/decode_profile.py)."""

import time

import torch


def decode_seconds(model, prompt: torch.Tensor, steps: int) -> float:
    """Seconds for ``steps`` greedy steps after ``prompt`` (the prompt's own forward is not timed)."""
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True)
        token, cache = out.logits[:, -1:].argmax(-1), out.past_key_values
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, use_cache=True, past_key_values=cache)
            token, cache = out.logits[:, -1:].argmax(-1), out.past_key_values
        return time.perf_counter() - t0
