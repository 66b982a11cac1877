"""Greedy decode through the KV cache, timed: the loop the bench scripts that compare models'
per-token decode share (bench/cpu_models_attribution.py, bench/weights_alignment.py)."""

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


if __name__ == "__main__":  # a module, not a script: --help says so, anything else is refused in one line
    import argparse

    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Imported by bench/cpu_models_attribution.py and bench/weights_alignment.py.",
    )
    ap.parse_args()
    ap.error("a module for other bench scripts: nothing to run")
