"""The ending every bench script shares: write SAVE.json and SAVE.md when --save is given, print the markdown."""

import json
from pathlib import Path


def save_and_print(save, result: dict, md: str) -> int:
    if save:
        Path(save + ".json").write_text(json.dumps(result, indent=2) + "\n")
        Path(save + ".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":  # a module, not a script: --help says so, anything else is refused in one line
    import argparse

    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="Imported by the bench scripts' --save ending."
    )
    ap.parse_args()
    ap.error("a module for other bench scripts: nothing to run")
