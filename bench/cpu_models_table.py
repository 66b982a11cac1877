#!/usr/bin/env python3
"""The goal table of a bench/cpu_models.sh run: converted ÷ original throughput per size, kind
and mode, from the JSON files in the run directory (nothing typed in by hand)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

KINDS = ("forward", "train_step", "decode")
GOAL = 0.98


def main(run_dir: str) -> int:
    d = Path(run_dir)
    lines = [f"# CPU: converted (exact) vs original, {d.name}", "",
             "Throughput ratio converted ÷ original (≥ 1: converted faster), medians of interleaved repeats; "
             f"goal ≥ {GOAL}. Commands and load averages: commands.txt.", "",
             "| size | mode | " + " | ".join(KINDS) + " | original tokens/s (fwd, train, decode) |", "|---|---|" + "---|" * (len(KINDS) + 1)]
    for f in sorted(d.glob("*.json")):
        size, mode = f.stem.rsplit("-", 1)
        data = json.loads(f.read_text())
        models = {m["name"]: m for m in data["models"]}
        o, c = models["original"]["tokens_per_second"], models["exact"]["tokens_per_second"]
        cells = []
        for k in KINDS:
            r = c[k] / o[k] if o.get(k) and c.get(k) else None
            cells.append("—" if r is None else f"{r:.3f}{'' if r >= GOAL else ' ✗'}")
        lines.append(f"| {size} | {mode} | " + " | ".join(cells) + " | "
                     + ", ".join(f"{o[k]:.0f}" if o.get(k) else "—" for k in KINDS) + " |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
