"""What the tokenizer guard (normswap/checkpoint/tokenizer_guard.py) costs a normal tokenization.

Usage: python bench/tokenizer_guard.py OUT_DIR [--budget SECONDS]

The shipped kjv-gpt2 tokenizer, raw (the library's Rust tokenizer, called through transformers as every
normswap measurement calls it) against the same tokenizer as normswap loads it (guarded: each encode on a
helper thread with the stderr descriptor held), timed with normswap.timing.compare: interleaved pairs,
the raw tokenizer's second copy as the null control. Two workloads: the embedded corpus's test split in one
call (what `eval ppl` does) and 200 short calls of one verse each (what lm-eval's requests do).
Writes OUT_DIR/results.json and OUT_DIR/command.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--budget", type=float, default=60.0)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from normswap.assets.models import model_path
    from normswap.checkpoint.load import load_tokenizer
    from normswap.checkpoint.tokenizer_guard import GuardedBackend
    from normswap.data import load_text
    from normswap.timing import compare

    path = str(model_path("kjv-gpt2"))
    guarded = load_tokenizer(path)
    assert isinstance(guarded.backend_tokenizer, GuardedBackend)
    raw, raw2 = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    text = load_text("embedded", "test")
    verses = [v for v in text.splitlines() if v.strip()][:200]
    assert guarded(text)["input_ids"] == raw(text)["input_ids"]
    results = {"text_chars": len(text), "verses": len(verses), "verse_chars_mean": sum(map(len, verses)) / 200}
    for name, work in {
        "whole_test_split_one_call": lambda tok: tok(text, add_special_tokens=False),
        "200_verses_one_call_each": lambda tok: [tok(v, add_special_tokens=False) for v in verses],
    }.items():
        fns = {"raw": lambda w=work: w(raw), "raw_copy": lambda w=work: w(raw2), "guarded": lambda w=work: w(guarded)}
        c = compare(fns, "raw", "raw_copy", calls_per_sample=1, budget_s=args.budget / 2, min_pairs=30)
        g, n = c["guarded"], c.null
        results[name] = {
            "guarded_speed_over_raw": dataclasses.asdict(g),
            "null_control": dataclasses.asdict(n),
            "verdict": g.verdict,
            "seconds_per_call": c.seconds_per_call,
            "stop_reason": c.stop_reason,
            "pairs": c.rounds,
        }
        print(f"{name}: guarded/raw speed {g.ratio:.3f} [{g.low:.3f}, {g.high:.3f}], null {n.ratio:.3f} "
              f"[{n.low:.3f}, {n.high:.3f}]: {results[name]['verdict']}", flush=True)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "command.txt").write_text("python " + " ".join(sys.argv) + "\n")


if __name__ == "__main__":
    main()
