"""Peak memory of a one-step fine-tune on a 400 MB corpus written on ONE line (issue #22, case 8).

Three real `normswap finetune` runs, each in its own process, side by side in one invocation:

    null        --data embedded: the fine-tune itself (model, optimizer, tokenizer), no big file
    many-lines  a 400 MB file of the embedded KJV text repeated, its line breaks kept
    one-line    the same 400 MB of text with every line break replaced by a space: one line

Each runs `normswap finetune normswap:kjv-gpt2 OUT --data FILE --eval-data embedded --steps 1`
(small batch, seq-len 128): the held-out set is the same in every run, and FILE is trained on whole
(with `--before REV`, normswap as it was at REV - the whole-file reader - runs one-line files of
--before-size-mb and twice that: it hands the tokenizer the whole line, so 400 MB would exhaust the
shared machine). Peak RSS is the child's ru_maxrss from wait4 (the kernel's high-water mark of its resident
set; the fine-tune runs in one process). The corpora are written to a temporary directory and
deleted afterwards. Goal: the one-line run's peak RSS at most 1.5 GB; the null control says how
much of any run is the fine-tune itself.

    flock /work/bench.lock python bench/oneline_corpus.py --save results/oneline-corpus-20261201T1635Z/oneline-corpus
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from normswap.benchmarks.saved_result import save_and_print  # noqa: E402

GOAL_BYTES = 1.5e9


def write_corpus(path: Path, size: int, *, one_line: bool) -> int:
    """The embedded corpus' training text repeated to ``size`` bytes; with ``one_line`` its line
    breaks become spaces. Returns the bytes written."""
    from normswap.data import load_text

    text = load_text("embedded", "train") + "\n\n"
    if one_line:
        text = text.replace("\n", " ")
    unit = text.encode("utf-8")
    written = 0
    with open(path, "wb") as f:
        while written < size:
            f.write(unit)
            written += len(unit)
    return written


def longest_line(path: Path) -> int:
    longest = current = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            parts = block.split(b"\n")
            current += len(parts[0])
            if len(parts) > 1:
                longest = max(longest, current, *(len(p) for p in parts[1:-1]))
                current = len(parts[-1])
    return max(longest, current)


def finetune(data: str, out: Path, args, code: Path = ROOT) -> dict:
    """One `normswap finetune` (normswap from ``code``) in a child process; its peak RSS from wait4's rusage."""
    cmd = [
        sys.executable,
        "-m",
        "normswap",
        "finetune",
        args.model,
        str(out),
        "--data",
        data,
        "--eval-data",
        "embedded",
        "--steps",
        "1",
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--eval-tokens",
        str(args.eval_tokens),
        "--warmup-steps",
        "0",
        "--no-progress",
        "--json",
    ]
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        t0 = time.perf_counter()
        # cwd: `python -m` puts it first on sys.path, so it decides which normswap runs
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, text=True, cwd=code)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        out_text, err_text = stdout.read(), stderr.read()
    run = {"returncode": proc.returncode, "peak_rss_bytes": usage.ru_maxrss * 1024, "wall_seconds": round(wall, 1)}
    if proc.returncode == 0:
        summary = json.loads(out_text)
        run["summary"] = {
            k: summary.get(k)
            for k in (
                "steps",
                "seq_len",
                "global_batch",
                "initial_eval_loss",
                "final_eval_loss",
                "eval_tokens",
                "wall_seconds",
            )
        }
    else:
        run["stderr"] = err_text[-2000:]
    return run


def _outcome(run: dict) -> str:
    return "ok" if run["returncode"] == 0 else f"failed (exit {run['returncode']:d})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="normswap:kjv-gpt2")
    ap.add_argument("--size-mb", type=int, default=400)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--before",
        default=None,
        metavar="REV",
        help="also run the one-line corpus with normswap as it was at git revision REV "
        "(e.g. the commit before the change)",
    )
    ap.add_argument("--before-size-mb", type=int, default=25, help="the one-line corpus for --before (and twice that)")
    ap.add_argument("--save", default=None, help="write SAVE.json and SAVE.md")
    args = ap.parse_args(argv)
    save = args.save
    del args.save
    size = args.size_mb * 10**6
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="normswap-oneline-") as tmp:
        tmp = Path(tmp)
        runs["null"] = {"data": "embedded", **finetune("embedded", tmp / "out-null", args)}
        for name, one_line in (("many-lines", False), ("one-line", True)):
            corpus = tmp / f"{name}.txt"
            written = write_corpus(corpus, size, one_line=one_line)
            info = {"data": f"{written / 1e6:.0f} MB, longest line {longest_line(corpus):,} characters"}
            runs[name] = {**info, "corpus_bytes": written, **finetune(str(corpus), tmp / f"out-{name}", args)}
            corpus.unlink()
        if args.before:
            # the whole-file reader hands the tokenizer the whole line at once (~40 bytes a character):
            # at the full size it would take the shared machine's memory, so it gets a smaller file
            old = tmp / "before"
            old.mkdir()
            subprocess.run(f"git -C {ROOT} archive {args.before} normswap | tar -x -C {old}", shell=True, check=True)
            for size_mb in (args.before_size_mb, 2 * args.before_size_mb):
                corpus = tmp / "before.txt"
                written = write_corpus(corpus, size_mb * 10**6, one_line=True)
                info = {"data": f"{written / 1e6:.0f} MB, longest line {longest_line(corpus):,} characters"}
                runs[f"one-line, normswap at {args.before} ({written / 1e6:.0f} MB)"] = {
                    **info,
                    "corpus_bytes": written,
                    **finetune(str(corpus), tmp / f"out-before-{size_mb}", args, code=old),
                }
                corpus.unlink()
    load_at_end = [round(x, 2) for x in os.getloadavg()]
    one = runs["one-line"]
    result = {
        "command": f"python bench/oneline_corpus.py --size-mb {args.size_mb}",
        "options": vars(args),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": load_at_end,
        },
        "goal_peak_rss_bytes": GOAL_BYTES,
        "goal_met": one["returncode"] == 0 and one["peak_rss_bytes"] <= GOAL_BYTES,
        "runs": runs,
    }
    null = runs["null"]["peak_rss_bytes"]
    command = result["command"] + (
        f" --before {args.before} --before-size-mb {args.before_size_mb}" if args.before else ""
    )
    rows = "\n".join(
        f"| {name} | {r['data']} | {_outcome(r)} | "
        f"{r['peak_rss_bytes'] / 1e9:.2f} GB | {r['peak_rss_bytes'] / null:.2f} | {r['wall_seconds']:.0f} s |"
        for name, r in runs.items()
    )
    md = (
        f"# One-step fine-tune on a {args.size_mb} MB corpus written on one line\n\n"
        f"`{command}` (under `flock /work/bench.lock`): "
        f"`normswap finetune {args.model} OUT --data FILE --eval-data embedded --steps 1 "
        f"--seq-len {args.seq_len} --batch-size {args.batch_size} --eval-tokens {args.eval_tokens}`, "
        f"each run in its own process, {args.threads} thread(s); peak RSS is the child's `ru_maxrss`. "
        f"Load average at start {load_at_start}, at end {load_at_end}.\n\n"
        "| run | data | result | peak RSS | vs null | wall |\n|---|---|---|---|---|---|\n"
        + rows
        + "\n\n"
        + "".join(
            f"{name}: `{r['stderr'].strip().splitlines()[-1]}`\n\n" for name, r in runs.items() if r["returncode"] != 0
        )
        + f"Goal: the one-line run at most {GOAL_BYTES / 1e9:.1f} GB peak RSS: "
        f"**{'met' if result['goal_met'] else 'not met'}**. "
        "The text file is read in 1 MiB blocks and a line longer than 64 Ki characters is cut just before whitespace "
        "into documents of about 4,000 characters, so the first step reads only what its shuffle buffer "
        "(2,048 documents) and the held-out set need, never the whole file.\n"
    )
    return save_and_print(save, result, md)


if __name__ == "__main__":
    raise SystemExit(main())
