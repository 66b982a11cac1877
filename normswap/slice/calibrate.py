"""Calibration: token blocks from the training split, and the stream's second moments at every norm.

The rotation is fitted on text the model will not be judged on: the *training* split of ``--data``
(the same sources and split a fine-tune trains on, normswap/data; the embedded corpus's test books
are never read). The converted model runs over those blocks with a forward pre-hook on every norm
that reads the stream, adding xᵀx of the norm's input (every token of every block) to a d × d
float64 sum: the uncentred second moments Σ that PCA diagonalises.
"""

from __future__ import annotations

import torch

from normswap.errors import NormswapError
from normswap.model_facts import context_length

CALIBRATION_SPLIT = "train"
DEFAULT_SEQ_LEN = 256  # tokens per calibration block (at most the model's context)
PROGRESS_LINES = 8  # calibration reports this many times, whatever the batch count
POOL_FACTOR = 4  # blocks are drawn (seeded) from the first POOL_FACTOR × as many as needed


def calibration_batches(
    tokenizer, data_spec: str, tokens: int, seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0, *, batch_size: int = 8
) -> list[torch.Tensor]:
    """Calibration input: about ``tokens`` tokens of ``data_spec``'s training split as a list of
    LongTensor batches, each [≤ batch_size, seq_len].

    The blocks are packed in corpus order (normswap.data.pack_tokens: documents joined with EOS),
    and ``seed`` draws which of the first POOL_FACTOR × needed blocks are used, so another seed
    fits the rotation on other text while memory stays bounded by POOL_FACTOR × ``tokens``. At
    least one full block is needed: fewer tokens than ``seq_len`` is a one-line refusal."""
    from normswap.data import load_documents, pack_tokens

    if tokens < 1 or seq_len < 1:
        raise NormswapError(f"calibration needs a positive token count and block length, got {tokens} and {seq_len}")
    want = max(1, tokens // seq_len)
    pool = []
    try:
        for block in pack_tokens(tokenizer, load_documents(data_spec, CALIBRATION_SPLIT), seq_len):
            pool.append(block)
            if len(pool) >= POOL_FACTOR * want:
                break
    except NormswapError as e:  # a missing source, an empty split: said as what slice lacks
        raise NormswapError(f"no calibration text: {e}") from None
    if not pool:
        raise NormswapError(
            f"no calibration text: the {CALIBRATION_SPLIT} split of {data_spec!r} holds fewer than {seq_len} tokens"
        )
    gen = torch.Generator().manual_seed(int(seed))
    chosen = sorted(torch.randperm(len(pool), generator=gen)[:want].tolist())
    blocks = torch.stack([pool[i] for i in chosen])
    return list(blocks.split(batch_size))


def held_out_batches(tokenizer, data_spec: str, tokens: int, seq_len: int, *, batch_size: int = 2):
    """(batches, split): the first ``tokens`` // ``seq_len`` blocks of ``data_spec``'s held-out split
    (the test split of a corpus with splits, all of a user's file), for the perplexity slice reports;
    ([], split) when ``tokens`` is 0 or the split is shorter than one block."""
    from normswap.data import default_eval_split, load_documents, pack_tokens

    split = default_eval_split(data_spec)
    want = tokens // seq_len
    blocks = []
    if want:
        for block in pack_tokens(tokenizer, load_documents(data_spec, split), seq_len):
            blocks.append(block)
            if len(blocks) >= want:
                break
    return (list(torch.stack(blocks).split(batch_size)) if blocks else []), split


def block_length(config, requested: int = DEFAULT_SEQ_LEN) -> int:
    """The calibration block length: ``requested``, at most the model's context length."""
    ctx = context_length(config)
    return max(1, min(int(requested), int(ctx))) if ctx else int(requested)


class SecondMoments:
    """Σ = Σ xᵀx (float64, d × d) of every listed norm's input, accumulated by forward pre-hooks
    while the model runs; ``tokens`` counts what each norm saw."""

    def __init__(self, model, norm_names):
        self.sums: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}
        self._handles = []
        modules = dict(model.named_modules())
        for name in norm_names:
            module = modules.get(name)
            if module is None:
                raise NormswapError(f"norm {name} is not in the model")
            self._handles.append(module.register_forward_pre_hook(self._hook(name), with_kwargs=True))

    def _hook(self, name):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
            if not isinstance(x, torch.Tensor):
                return None
            flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
            acc = self.sums.get(name)
            if acc is None:
                acc = self.sums[name] = torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float64, device=x.device)
            acc.addmm_(flat.T, flat)
            self.tokens[name] = self.tokens.get(name, 0) + flat.shape[0]
            return None

        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def collect_moments(model, batches, norm_names, *, progress=None) -> tuple[dict[str, torch.Tensor], int]:
    """({norm name: Σ on the CPU, float64}, tokens seen): ``model`` run over ``batches`` (token id
    tensors, moved to the model's device) with no gradient and no key/value cache."""
    say = progress or (lambda msg: None)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tokens = 0
    try:
        with SecondMoments(model, norm_names) as moments, torch.no_grad():
            for i, batch in enumerate(batches):
                batch = batch.to(device)
                model(input_ids=batch, use_cache=False)
                tokens += int(batch.numel())
                if (i + 1) % max(1, len(batches) // PROGRESS_LINES) == 0 or i + 1 == len(batches):
                    say(f"calibration: batch {i + 1}/{len(batches)}, {tokens:,} tokens")
    finally:
        model.train(was_training)
    missing = [n for n in norm_names if n not in moments.sums]
    if missing:
        raise NormswapError(f"calibration: norm {missing[0]} never ran; slice cannot fit a rotation for it")
    return {name: s.cpu() for name, s in moments.sums.items()}, tokens
