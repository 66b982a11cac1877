#!/usr/bin/env python3
"""The perplexities of bench/slice_heal.sh's run side by side, with the healing goal (the healed model
within 1 % of the original's perplexity on the held-out test books).

    python bench/slice_heal_summary.py OUT kjv-gpt2 kjv-neox
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="bench/slice_heal.sh's output folder")
    ap.add_argument("models", nargs="+", help="the shipped models it sliced and healed")
    args = ap.parse_args(argv)
    out, models = args.out, args.models
    for m in models:
        sliced = json.loads((out / f"{m}-slice.json").read_text())
        ft = json.loads((out / f"{m}-finetune.json").read_text())
        ppl = [r["perplexity"] for r in json.loads((out / f"{m}-ppl.json").read_text())["models"]]
        original, before, healed = ppl
        steps = ft.get("steps_done", ft.get("steps"))
        print(
            f"{m}: width {sliced['hidden_size']} -> {sliced['width']} ({sliced['fraction']:.0%}), parameters "
            f"{sliced['parameters_before']:,} -> {sliced['parameters_after']:,}; held-out perplexity: original "
            f"{original:.3f}, sliced {before:.3f} (x{before / original:.4f}), healed after {steps} steps "
            f"{healed:.3f} (x{healed / original:.4f}): goal within 1% of the original "
            f"{'met' if healed <= 1.01 * original else 'NOT met'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
