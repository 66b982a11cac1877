"""The ending every bench driver shares: write SAVE.json and SAVE.md when --save is given, print the markdown."""

import json
from pathlib import Path


def save_and_print(save, result: dict, md: str) -> int:
    if save:
        Path(save + ".json").write_text(json.dumps(result, indent=2) + "\n")
        Path(save + ".md").write_text(md)
    print(md)
    return 0
