"""What kind of model an evaluation holds, and what can be measured on (and compared across) it.

* ``causal-lm``: a model with a next-token head: perplexity, generation, lm-eval tasks;
* ``masked-lm``: an encoder with a masked-LM head (BertForMaskedLM …): fidelity to a reference
  including masked-token agreement;
* ``encoder``: a bare encoder (BertModel, a sentence-embedding model): fidelity of hidden states
  and sentence embeddings to a reference;
* ``probe-input``: a model whose forward needs more than token ids (a ViT or CLIP tower on images,
  Whisper on audio features plus decoder ids): fidelity of every output to a reference on the same
  seeded probe inputs of the right shape (architectures/probes.py); there is no text to read.

Causal LMs compare with each other by perplexity; encoders (with or without a head) with each
other by fidelity to one reference. A list mixing the two groups has nothing in common to report.
"""

from __future__ import annotations

import torch

from normswap.errors import NormswapError
from normswap.evaluate.config import SPEED_KINDS

CAUSAL_LM, MASKED_LM, ENCODER, PROBE_INPUT = "causal-lm", "masked-lm", "encoder", "probe-input"
GROUP = {CAUSAL_LM: "causal-lm", MASKED_LM: "encoder", ENCODER: "encoder", PROBE_INPUT: "probe-input"}


def model_kind(model) -> str:
    from normswap.architectures.probes import takes_text_only
    from normswap.checkpoint.load import is_causal_lm

    if not takes_text_only(model):
        return PROBE_INPUT
    if is_causal_lm(model.config):
        return CAUSAL_LM
    if any(cls.__name__.endswith("ForMaskedLM") for cls in type(model).__mro__):
        return MASKED_LM
    return ENCODER


def common_group(kinds: dict[str, str]) -> str:
    """The comparison group of ``{name: kind}``; one-line error when they cannot be compared."""
    groups = {GROUP[k] for k in kinds.values()}
    if len(groups) > 1:
        parts = [
            f"{GROUP_NAMES[g]} ({', '.join(n for n, k in kinds.items() if GROUP[k] == g)})"
            for g in GROUP_NAMES
            if g in groups
        ]
        raise NormswapError(
            f"cannot compare {' with '.join(parts)}: perplexity is not defined for an "
            "encoder and fidelity needs one reference of the same kind; evaluate them in separate reports"
        )
    return groups.pop()


def training_loss(model, ids: torch.Tensor, *, forward=None) -> torch.Tensor:
    """A loss whose backward pass costs what a training step of this kind of model costs (for speed
    and memory measurements): next-token loss, masked-LM loss over every position, or for a bare
    encoder the mean square of its last hidden state. ``forward``: what to call instead of
    ``model`` (e.g. its torch.compile'd form, which refuses ``bool()``: hence ``is None``)."""
    kind, run = model_kind(model), model if forward is None else forward
    if kind == ENCODER:
        return run(input_ids=ids).last_hidden_state.float().pow(2).mean()
    if kind == MASKED_LM:
        return run(input_ids=ids, labels=ids).loss
    return run(input_ids=ids, labels=ids, use_cache=False).loss


# What each comparison group can measure (evaluate/measurements.py). The three-state options
# (perplexity, fidelity: None when not given) run where they are the group's headline number.
# Image/audio models get fidelity on probe inputs only: speed and memory runs feed token ids.
GROUP_NAMES = {"causal-lm": "causal LMs", "encoder": "encoders", "probe-input": "image/audio models"}
MEASURABLE = {
    "causal-lm": ("perplexity", "diagnostics", "tasks", "speed", "memory", "fidelity"),
    "encoder": ("speed", "memory", "fidelity"),
    "probe-input": ("fidelity",),
}
HEADLINE = {"causal-lm": "perplexity", "encoder": "fidelity", "probe-input": "fidelity"}
READS_TEXT = {"causal-lm": True, "encoder": True, "probe-input": False}  # probe-input models get seeded probe inputs
SPEED_BY_GROUP = {
    "causal-lm": SPEED_KINDS,
    "encoder": tuple(k for k in SPEED_KINDS if k != "generate"),
}  # encoders generate nothing
# asked for explicitly where they are not defined: refused (anything else on by default is skipped)
NOT_DEFINED = {
    "perplexity": "perplexity is not defined for {group} ({models}); `normswap eval report` measures their fidelity "
    "to a --baseline",
    "tasks": "lm-eval tasks score causal LMs; these models are {group} ({models}): drop --tasks",
}


def measurements_for(group: str, wanted: dict[str, bool | None], models: list[str]) -> list[str]:
    """The measurements to run on a group, from ``wanted`` (name -> on, off or None: the group's
    headline only); a one-line error for one asked for that the group does not define."""
    chosen = []
    for name, on in wanted.items():
        if on is None:
            on = name == HEADLINE[group]
        if not on:
            continue
        if name not in MEASURABLE[group]:
            if name in NOT_DEFINED:
                raise NormswapError(NOT_DEFINED[name].format(group=GROUP_NAMES[group], models=", ".join(models)))
            continue
        chosen.append(name)
    return chosen
