"""No path of a local directory in a published checkpoint's own files (security.md S7.8).

A config loaded from a directory carries ``_name_or_path`` (slice loads its conversion from a private
working directory, convert its source), and the manifest, model card and slice.json record the source
a command was given. Published, those name directories on the machine that made the checkpoint
(a user's home, a private temp folder). At publication every file normswap itself writes into a
checkpoint is rewritten with ``_name_or_path`` dropped and every absolute local path reduced to its
last component: the provenance (the source's name) stays, the directory tree does not. A hub id
(``owner/name``) is not absolute and stays as it is.

One place, called by ``publish.publish_dir`` for any output that is a checkpoint (it has a
config.json), so every command that publishes one (convert, slice, finetune, export, save) is covered.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# the files normswap writes into a checkpoint; the source's own side files (tokenizer, ...) are the
# source's and are copied as they are
OWN_JSON = ("config.json", "normswap_manifest.json", "slice.json", "generation_config.json")
OWN_TEXT = ("README.md",)
# an absolute path of two or more components, not inside a word or a fraction ("γ/β", "float32/64")
_ABSOLUTE = re.compile(r"(?<![\w.)\]/|])(?:~|[A-Za-z]:)?(?:/[\w.+@%=,-]+){2,}/?")


def _last(match: re.Match) -> str:
    return Path(match.group(0).rstrip("/")).name


def public_text(text: str) -> str:
    """``text`` with every absolute local path reduced to its last component."""
    return _ABSOLUTE.sub(_last, text)


def public_value(value):
    """A JSON value with ``_name_or_path`` dropped and every string made ``public_text``."""
    if isinstance(value, dict):
        return {k: public_value(v) for k, v in value.items() if k != "_name_or_path"}
    if isinstance(value, list):
        return [public_value(v) for v in value]
    if isinstance(value, str):
        return public_text(value)
    return value


def scrub_checkpoint_dir(directory) -> None:
    """Rewrite normswap's own files in the staging ``directory`` of a checkpoint with no local path."""
    directory = Path(directory)
    for name in OWN_JSON:
        path = directory / name
        if path.is_file() and not path.is_symlink():
            raw = path.read_text(encoding="utf-8")
            try:
                data = json.loads(raw)
            except ValueError:
                continue  # not normswap's JSON (it always writes valid JSON): left as it is
            # a fine-tune's own record keeps its paths: `eval` reads them to leave the training
            # documents out of what it scores (evaluate/heldout.py), which a bare file name cannot do
            kept = data.pop("finetune", None) if name == "normswap_manifest.json" and isinstance(data, dict) else None
            clean = public_value(data)
            if kept is not None:
                data["finetune"], clean["finetune"] = kept, kept
            if clean != data:
                path.write_text(json.dumps(clean, indent=2, sort_keys=name == "config.json") + "\n", encoding="utf-8")
    for name in OWN_TEXT:
        path = directory / name
        if path.is_file() and not path.is_symlink():
            raw = path.read_text(encoding="utf-8")
            clean = public_text(raw)
            if clean != raw:
                path.write_text(clean, encoding="utf-8")
