"""Training diagnostics on one fixed batch: loss, gradient norm, and the statistics of the
activations entering every norm layer.

The batch is the first ``batch_size`` x ``seq_len`` tokens of the evaluation text, so the same
text (and, with a shared tokenizer, the same ids) feeds every model. Dropout is off (eval mode)
so the numbers are deterministic. Per norm layer, over all tokens of the batch:
- ``rms``: sqrt(mean x^2) - the scale RMSNorm divides by;
- ``mean``: mean of x - the centring LayerNorm removes and RMSNorm does not;
- ``token_mean_abs``: mean over tokens of |mean over features of x| - how far each token's
  vector is from zero-mean; exact conversion centres the residual stream so this is ~0 after.
"""

from __future__ import annotations

import math

import torch

from normswap.evaluate.perplexity import encode, model_device
from normswap.model_facts import context_length, norm_modules


def fixed_batch(tokenizer, text: str, batch_size: int, seq_len: int) -> torch.LongTensor:
    ids = encode(tokenizer, text)
    if len(ids) < seq_len:
        # A short text: one row of what there is, rather than padding (every position is text).
        return torch.tensor(ids, dtype=torch.long).view(1, -1)
    rows = min(batch_size, len(ids) // seq_len)
    return torch.tensor(ids[: rows * seq_len], dtype=torch.long).view(rows, seq_len)


def diagnostics(model, batch: torch.LongTensor) -> dict:
    device = model_device(model)
    batch = batch.to(device)
    context = context_length(model)
    if context is not None and batch.shape[1] > context:
        batch = batch[:, :context]
    stats: dict[str, dict] = {}
    handles = []

    def hook(name):
        def pre(_module, args):
            x = args[0].detach().float()
            token_means = x.mean(-1)
            stats[name] = {
                "rms": float(x.pow(2).mean().sqrt()),
                "mean": float(x.mean()),
                "token_mean_abs": float(token_means.abs().mean()),
            }

        return pre

    norms = norm_modules(model)
    for name, module in norms:
        handles.append(module.register_forward_pre_hook(hook(name)))
    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    try:
        with torch.enable_grad():
            out = model(input_ids=batch, labels=batch, use_cache=False)
            out.loss.backward()
        sq = 0.0
        for p in model.parameters():
            if p.grad is not None:
                sq += float(p.grad.detach().double().pow(2).sum())
        loss = float(out.loss.detach())
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return {
        "loss": loss,
        "grad_norm": math.sqrt(sq),
        "batch_shape": list(batch.shape),
        "layers": [{"name": name, "class": type(module).__name__, **stats.get(name, {})} for name, module in norms],
    }
