"""What the tokenizer guard and the vetting build cost a normal tokenizer (normswap/checkpoint/tokenizer_guard.py,
tokenizer_vet.py).

Usage: python bench/tokenizer_guard.py OUT_DIR [--budget SECONDS]

The shipped kjv-gpt2 tokenizer, raw (the library's Rust tokenizer, called through transformers as every
normswap measurement calls it) against the same tokenizer as normswap loads it (guarded: each encode and
decode on a helper thread with the stderr descriptor held), timed with normswap.timing.compare: interleaved
pairs, the raw tokenizer's second copy as the null control. Workloads: the embedded corpus's test split
encoded in one call (what `eval ppl` does), 200 short calls of one verse each (what lm-eval's requests do),
and the test split's ids decoded in one call. Then the load itself: ``AutoTokenizer.from_pretrained`` raw
(and its second copy, the null) against normswap's ``load_tokenizer`` with and without the vetting build
(the vet's verdict cache cleared before each call, so every call vets), and the vet's child's CPU seconds.
Tokenizers run with TOKENIZERS_PARALLELISM=false, as the CLI runs them. Writes OUT_DIR/results.json and
OUT_DIR/command.txt (the command line, the commit, the date).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

VET_CPU_RUNS = 20


def _row(c, name: str) -> dict:
    g, n = c[name], c.null
    return {
        "speed_over_raw": dataclasses.asdict(g),
        "null_control": dataclasses.asdict(n),
        "verdict": g.verdict,
        "seconds_per_call": c.seconds_per_call,
        "stop_reason": c.stop_reason,
        "pairs": c.rounds,
    }


def _say(name: str, c, candidates) -> None:
    n = c.null
    for cand in candidates:
        g = c[cand]
        print(
            f"{name}: {cand}/raw speed {g.ratio:.3f} [{g.low:.3f}, {g.high:.3f}], null {n.ratio:.3f} "
            f"[{n.low:.3f}, {n.high:.3f}]: {g.verdict}; s/call {c.seconds_per_call}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds in all, over the four comparisons")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the CLI runs every tokenizer
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the test split is longer than the model's context: said once per call

    from normswap.assets.models import model_path
    from normswap.checkpoint import tokenizer_vet
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
    ids = raw(text, add_special_tokens=False)["input_ids"]
    assert guarded(text)["input_ids"] == raw(text)["input_ids"] and guarded.decode(ids) == raw.decode(ids)
    results = {"text_chars": len(text), "text_ids": len(ids), "verses": len(verses)}
    results["verse_chars_mean"] = sum(map(len, verses)) / len(verses)
    for name, work in {
        "whole_test_split_one_call": lambda tok: tok(text, add_special_tokens=False),
        "200_verses_one_call_each": lambda tok: [tok(v, add_special_tokens=False) for v in verses],
        "decode_test_split_one_call": lambda tok: tok.decode(ids),
    }.items():
        fns = {"raw": lambda w=work: w(raw), "raw_copy": lambda w=work: w(raw2), "guarded": lambda w=work: w(guarded)}
        c = compare(fns, "raw", "raw_copy", calls_per_sample=1, budget_s=args.budget / 5, min_pairs=30)
        results[name] = _row(c, "guarded")
        _say(name, c, ["guarded"])

    def vetted():
        tokenizer_vet._vetted.clear()  # every call vets: the cost of a command's first load
        return load_tokenizer(path)

    def unvetted():
        real, tokenizer_vet.vet = tokenizer_vet.vet, lambda directory: None
        try:
            return load_tokenizer(path)
        finally:
            tokenizer_vet.vet = real

    fns = {
        "raw": lambda: AutoTokenizer.from_pretrained(path),
        "raw_copy": lambda: AutoTokenizer.from_pretrained(path),
        "normswap_load_vetted": vetted,
        "normswap_load_unvetted": unvetted,
    }
    c = compare(fns, "raw", "raw_copy", calls_per_sample=1, budget_s=2 * args.budget / 5, min_pairs=10, warmup=1)
    results["load"] = {k: _row(c, k) for k in ("normswap_load_vetted", "normswap_load_unvetted")}
    _say("load", c, ["normswap_load_vetted", "normswap_load_unvetted"])
    # the vet's own cost in CPU seconds (its child's user + system time), which a loaded machine does not inflate
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(VET_CPU_RUNS):
        tokenizer_vet._vetted.clear()
        tokenizer_vet.vet(Path(path))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / VET_CPU_RUNS
    results["vet_child_cpu_seconds_per_vet"] = round(cpu, 4)
    print(f"vet: {cpu:.3f} s of CPU in its child per vet (mean of {VET_CPU_RUNS})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    (out / "command.txt").write_text(f"python {' '.join(sys.argv)}\ncommit {commit}\ndate {stamp}\n")


if __name__ == "__main__":
    main()
