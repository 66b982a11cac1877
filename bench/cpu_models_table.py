#!/usr/bin/env python3
"""The goal table of a bench/cpu_models.sh run: converted ÷ original throughput per size, kind
and mode, from the JSON files in the run directory (nothing typed in by hand). Each cell is the
median paired ratio with its [min, max] over the interleaved repeats (normswap.stats.verdicts);
"met" needs the median ≥ the goal, and the verdict says whether the repeats tell the two apart."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from normswap.stats.verdicts import NO_DIFFERENCE  # noqa: E402

KINDS = ("forward", "train_step", "decode")
GOAL = 0.98


def cell(o: dict, c: dict, iv: dict | None, kind: str) -> tuple[str, bool | None]:
    if iv:
        r = iv["median"]
        text = f"{r:.3f} [{iv['low']:.2f}, {iv['high']:.2f}]" + (" ~" if iv["verdict"] == NO_DIFFERENCE else "")
    elif o.get(kind) and c.get(kind):
        r = c[kind] / o[kind]
        text = f"{r:.3f}"
    else:
        return "—", None
    return text + ("" if r >= GOAL else " ✗"), r >= GOAL


def main(run_dir: str) -> int:
    d = Path(run_dir)
    lines = [
        f"# CPU: converted (exact) vs original, {d.name}",
        "",
        "Throughput ratio converted ÷ original (≥ 1: converted faster): median of the per-repeat paired ratios "
        f"[min, max] over interleaved repeats; ✗ marks a median below the goal {GOAL}; ~ marks an interval that "
        "contains 1 (no measurable difference). Commands and load averages: commands.txt.",
        "",
        "Null control (runs that have it): the original loaded a second time and measured like the others "
        "(`original_copy`); its ratio to the original is what two identical models differ by in the same run.",
        "",
        "| size | mode | " + " | ".join(KINDS) + " | null control (fwd, train, decode) "
        "| original tokens/s (fwd, train, decode) | repeats, decode tokens |",
        "|---|---|" + "---|" * (len(KINDS) + 3),
    ]
    met = []
    for f in sorted(d.glob("*.json")):
        size, mode = f.stem.rsplit("-", 1)
        data = json.loads(f.read_text())
        models = {m["name"]: m for m in data["models"]}
        orig, conv = models["original"], models["exact"]
        o, c = orig["tokens_per_second"], conv["tokens_per_second"]
        setup = data.get("speed_setup") or {}
        ivs = (conv.get("ratio_intervals") or {}).get("tokens_per_second") or {}
        cells = []
        for k in KINDS:
            text, ok = cell(o, c, ivs.get(k), k)
            cells.append(text)
            if ok is not None:
                met.append(ok)
        copy = models.get("original_copy")
        null_ivs = ((copy or {}).get("ratio_intervals") or {}).get("tokens_per_second") or {}
        null = (
            ", ".join(f"{null_ivs[k]['median']:.3f}" if null_ivs.get(k) else "—" for k in KINDS) if copy else "not run"
        )
        lines.append(
            f"| {size} | {mode} | "
            + " | ".join(cells)
            + f" | {null} | "
            + ", ".join(f"{o[k]:.0f}" if o.get(k) else "—" for k in KINDS)
            + f" | {setup.get('repeats', '?')}, {max(0, setup.get('new_tokens', 1) - 1)} |"
        )
    lines += [
        "",
        f"Goal (median ≥ {GOAL} in every cell): {'met' if met and all(met) else 'not met'} "
        f"({sum(met)} of {len(met)} cells).",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a bench/cpu_models.sh output directory (results/cpu-models-*)")
    sys.exit(main(ap.parse_args().run_dir))
