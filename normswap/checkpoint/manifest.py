"""normswap_manifest.json: what was done to a checkpoint, by which command, with what result."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import sys
from pathlib import Path

MANIFEST_NAME = "normswap_manifest.json"


def read_manifest(directory) -> dict | None:
    """The manifest of the model in ``directory``, or None (absent, not JSON, not an object). Read
    by the side-file rule (checkpoint.side_files.open_inside): a manifest linked from outside the
    model directory is refused in one line, never read, so a link to the user's credentials is
    not republished with an export or a fine-tune."""
    from normswap.checkpoint.side_files import read_json_inside

    manifest = read_json_inside(directory, MANIFEST_NAME)
    return manifest if isinstance(manifest, dict) else None


def write_manifest(directory, manifest: dict) -> Path:
    path = Path(directory) / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False, default=str) + "\n")
    return path


def environment() -> dict:
    import torch
    import transformers

    from normswap.version import __version__

    return {
        "normswap": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def history_entry(step: str, **fields) -> dict:
    return {
        "step": step,
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["normswap"] + sys.argv[1:]) if sys.argv and "normswap" in sys.argv[0] else None,
        **fields,
    }
