"""What kind of model an evaluation holds, and what can be measured on (and compared across) it.

* ``causal-lm``: a model with a next-token head: perplexity, generation, lm-eval tasks;
* ``masked-lm``: an encoder with a masked-LM head (BertForMaskedLM …): fidelity to a reference
  including masked-token agreement;
* ``encoder``: a bare encoder (BertModel, a sentence-embedding model): fidelity of hidden states
  and sentence embeddings to a reference.

Causal LMs compare with each other by perplexity; encoders (with or without a head) with each
other by fidelity to one reference. A list mixing the two groups has nothing in common to report.
"""

from __future__ import annotations

import torch

from normswap.errors import NormswapError

CAUSAL_LM, MASKED_LM, ENCODER = "causal-lm", "masked-lm", "encoder"
GROUP = {CAUSAL_LM: "causal-lm", MASKED_LM: "encoder", ENCODER: "encoder"}


def model_kind(model) -> str:
    from normswap.checkpoint.load import is_causal_lm

    if is_causal_lm(model.config):
        return CAUSAL_LM
    if any(cls.__name__.endswith("ForMaskedLM") for cls in type(model).__mro__):
        return MASKED_LM
    return ENCODER


def common_group(kinds: dict[str, str]) -> str:
    """The comparison group of ``{name: kind}``; one-line error when they cannot be compared."""
    groups = {GROUP[k] for k in kinds.values()}
    if len(groups) > 1:
        causal = [n for n, k in kinds.items() if GROUP[k] == "causal-lm"]
        enc = [n for n, k in kinds.items() if GROUP[k] == "encoder"]
        raise NormswapError(
            f"cannot compare causal LMs ({', '.join(causal)}) with encoders ({', '.join(enc)}): perplexity is not defined for an "
            "encoder and fidelity needs one reference of the same kind; evaluate them in separate reports"
        )
    return groups.pop()


def training_loss(model, ids: torch.Tensor, *, forward=None) -> torch.Tensor:
    """A loss whose backward pass costs what a training step of this kind of model costs (for speed
    and memory measurements): next-token loss, masked-LM loss over every position, or for a bare
    encoder the mean square of its last hidden state. ``forward``: what to call instead of
    ``model`` (e.g. its torch.compile'd form)."""
    kind, run = model_kind(model), forward or model
    if kind == ENCODER:
        return run(input_ids=ids).last_hidden_state.float().pow(2).mean()
    if kind == MASKED_LM:
        return run(input_ids=ids, labels=ids).loss
    return run(input_ids=ids, labels=ids, use_cache=False).loss
