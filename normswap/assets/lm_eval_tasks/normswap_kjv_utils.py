"""Documents for the normswap_kjv tasks, built from normswap's embedded corpus at load time.

lm-eval calls ``load_kjv(**metadata, **dataset_kwargs)``; it must return something indexable by
split name whose items are ``{"text": ...}`` rows. Building a ``datasets.Dataset`` in memory
needs neither the network nor the datasets cache, so the task runs with HF_DATASETS_OFFLINE=1.
"""

from __future__ import annotations


def load_kjv(**kwargs):
    import datasets

    from normswap.data import load_documents

    limit = kwargs.get("max_documents")
    out = {}
    for split in ("validation", "test"):
        docs = [d.strip() for d in load_documents("embedded", split) if d.strip()]
        if limit:
            docs = docs[: int(limit)]
        out[split] = datasets.Dataset.from_dict({"text": docs})
    return datasets.DatasetDict(out)
