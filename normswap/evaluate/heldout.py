"""Held-out means held out: which part of an evaluation text a model was fine-tuned on.

``normswap finetune`` records in its output's manifest what it trained on (``finetune.training_data``:
the source, its resolved path, the split and how many documents). When a model being evaluated was
fine-tuned by normswap on the very source the evaluation reads, the evaluation's default split
leaves those training documents out: a source without splits of its own (a user's text file) is
read whole by default, which would score the training text, so the ``test`` split is read instead
— the hash split (data/sources.py) sends the same document to the same split every time, so no
test document was ever trained on. A split the user names that overlaps training (``all``,
``train``) is evaluated as asked, but marked as not held-out everywhere it is shown.
"""

from __future__ import annotations

from pathlib import Path

# The split read instead of a whole file that a fine-tune trained on (the same rule as the recipes').
HELD_OUT_SPLIT = "test"


def _resolved(spec) -> str | None:
    path = Path(str(spec)).expanduser()
    return str(path.resolve()) if path.exists() else None


def training_data(model_dir) -> dict | None:
    """``{spec, path, split, documents?}``: what the normswap fine-tune in ``model_dir`` trained on,
    from its manifest (older manifests without ``training_data``: derived from the recorded data
    options by the same rule the fine-tune used); None for a model normswap did not fine-tune."""
    from normswap.checkpoint.manifest import read_manifest
    from normswap.data.sources import finetune_splits

    if not model_dir or not Path(model_dir).is_dir():
        return None
    ft = (read_manifest(model_dir) or {}).get("finetune") or {}
    if ft.get("training_data"):
        return ft["training_data"]
    if not ft.get("data"):
        return None
    return {
        "spec": str(ft["data"]),
        "path": _resolved(ft["data"]),
        "split": finetune_splits(ft["data"], ft.get("eval_data"))[0],
    }


def same_source(data, trained: dict) -> bool:
    """Whether the evaluation's ``data`` is the source a fine-tune trained on (local paths compared
    resolved, anything else by name)."""
    mine = _resolved(data)
    if mine is not None and trained.get("path"):
        return mine == trained["path"]
    return str(data) == str(trained.get("spec"))


def overlaps(split: str, trained_split: str) -> bool:
    return "all" in (split, trained_split) or split == trained_split


def choose_split(data, requested: str | None, default: str, models: dict[str, str | None]) -> tuple[str, list[dict]]:
    """(the split to read, the fine-tunes on this source: ``[{model, split, documents}]``).

    ``models``: {name: local directory or None}. Without ``requested``, a default that overlaps a
    fine-tune's training split becomes :data:`HELD_OUT_SPLIT` (unless a fine-tune trained on all of
    the source: then nothing of it is held out, and the default stays, marked as such)."""
    seen = []
    for name, path in models.items():
        trained = training_data(path)
        if trained is not None and same_source(data, trained):
            seen.append({"model": name, "split": trained["split"], "documents": trained.get("documents")})
    split = requested or default
    if (
        requested is None
        and any(overlaps(default, s["split"]) for s in seen)
        and all(s["split"] != "all" for s in seen)
    ):
        split = HELD_OUT_SPLIT
    return split, seen


def held_out(split: str, seen: list[dict]) -> bool | None:
    """True: no model was fine-tuned on the evaluated documents; False: some were; None: no model
    was fine-tuned by normswap on this source."""
    if not seen:
        return None
    return not any(overlaps(split, s["split"]) for s in seen)


def caption(d: dict) -> str:
    """Exactly what was evaluated, in one line: ``my_text.txt, 250 of 5,000 documents not seen in
    fine-tuning (test split)`` (results.json's ``data`` block)."""
    name = Path(d["spec"]).name if Path(str(d["spec"])).exists() else d["spec"]
    docs, total = d.get("documents"), d.get("documents_available")
    cap = f", capped at {d['max_tokens']:,} tokens" if d.get("truncated") else ""
    seen = d.get("seen_in_finetune") or []
    models = ", ".join(s["model"] for s in seen)
    if d.get("held_out") is True:
        of = f"{docs:,} of {total:,} documents" if docs is not None and total else f"{docs or '?'} documents"
        return (
            f"{name}, {of} not seen in fine-tuning ({d['split']} split{cap}; "
            f"{models} trained on its {seen[0]['split']} split)"
        )
    if d.get("held_out") is False:
        return (
            f"{name}, {d['split']} split ({docs or '?'} documents{cap}): NOT held-out, it includes text {models} "
            f"{'was' if len(seen) == 1 else 'were'} fine-tuned on "
            f"({', '.join(sorted({s['split'] for s in seen}))} split)"
        )
    return f"{name} ({d['split']} split{'' if docs is None else f', {docs:,} documents'}{cap})"
