"""A tokenizer's largest id, bounded by what the model's weights back, before any library builds it.

The tokenizers library builds tables as long as a vocabulary's largest id, not as long as it has
entries: a ``tokenizer.json`` of 4,096 tokens, one of them numbered 4,294,967,000, loads, and the
first copy or save of it (``finetune`` saves the tokenizer with the model) asks for an 8 GB table
and aborts the process from Rust (signal 6), with no line normswap could print. No id a model can
use is larger than its embedding has rows, so the ids every tokenizer file declares (the model's
vocabulary, the added tokens of ``tokenizer.json``, ``added_tokens.json``, ``tokenizer_config.json``'s
``added_tokens_decoder``, a slow tokenizer's ``vocab.json``) are bounded by the largest dimension of
any stored weight (what backs the embedding's rows) with a margin (:func:`id_limit`: twice that, plus
:data:`ID_MARGIN`, for tokenizers that grew a few tokens past an embedding never resized), read from
the files' headers: nothing is allocated for the check.
"""

from __future__ import annotations

import json
from pathlib import Path

from normswap.errors import NormswapError

ID_MARGIN = 1024  # added tokens a tokenizer may carry past its embedding's rows (never resized)


def id_limit(rows: int) -> int:
    """The largest token id accepted beside an embedding of at most ``rows`` rows, plus one."""
    return 2 * rows + ID_MARGIN


def _ints(values):
    return (v for v in values if isinstance(v, int) and not isinstance(v, bool))


def _largest(name: str, data) -> int | None:
    """The largest id the file ``name`` (parsed) declares, or None when it declares none."""
    ids: list[int] = []
    if name == "tokenizer.json" and isinstance(data, dict):
        model = data.get("model")
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if isinstance(vocab, dict):
            ids += _ints(vocab.values())
        elif isinstance(vocab, list) and vocab:  # Unigram: ids are the positions
            ids.append(len(vocab) - 1)
        added = data.get("added_tokens")
        ids += _ints(t.get("id") for t in added if isinstance(t, dict)) if isinstance(added, list) else []
    elif name in ("added_tokens.json", "vocab.json") and isinstance(data, dict):
        ids += _ints(data.values())
    elif name == "tokenizer_config.json" and isinstance(data, dict):
        decoder = data.get("added_tokens_decoder")
        ids += (int(k) for k in decoder if str(k).lstrip("-").isdigit()) if isinstance(decoder, dict) else []
    return max(ids, default=None)


ID_FILES = ("tokenizer.json", "added_tokens.json", "tokenizer_config.json", "vocab.json")


def check_token_ids(directory, label: str) -> None:
    """Refuse, in one line, a tokenizer in ``directory`` declaring an id no stored weight backs
    (module doc). Each file is read by the side-file rule (a regular file inside the model
    directory, within its size cap)."""
    from normswap.checkpoint.side_files import open_inside, size_cap
    from normswap.checkpoint.sizes import weight_shapes

    directory = Path(directory)
    present = [n for n in ID_FILES if (directory / n).exists()]
    if not present:
        return
    shapes = weight_shapes(directory)
    rows = max((int(d) for shape in shapes.values() for d in shape), default=0)
    if not rows:
        return  # no weights to measure by: the loader refuses the model itself
    for name in present:
        f = open_inside(directory, name)
        if f is None:
            continue
        with f:
            data = f.read(size_cap(name) + 1)
        try:
            largest = _largest(name, json.loads(data))
        except (ValueError, RecursionError):
            continue  # not JSON: the tokenizer library says so in its own words
        if largest is not None and (largest < 0 or largest >= id_limit(rows)):
            raise NormswapError(
                f"{directory / name} declares token id {largest:,}, but no weight of {label} has more than "
                f"{rows:,} rows (ids up to {id_limit(rows) - 1:,} are accepted): the tokenizer does not belong "
                "to this model; nothing was built from it"
            )
