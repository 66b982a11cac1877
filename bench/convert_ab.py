"""Two normswap source trees side by side on one synthetic checkpoint: `python bench/convert_ab.py BEFORE AFTER`.

A before/after of a change to convert, under the same machine load: both trees' `normswap convert
--no-verify` and `normswap convert` (verified) run as separate processes, interleaved in every
round (before, after, before, after), each after the source files are read once (warm page cache),
beside `cp -r`. Each tree is put first on PYTHONPATH. Peak RSS and wall time as in normswap/benchmarks/conversion.py.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from normswap.benchmarks.saved_result import save_and_print


def _bench_module():
    from normswap.benchmarks import conversion

    return conversion


def _rev(tree) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--params", type=float, default=1.4e9)
    ap.add_argument("--shards", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--save", default=None)
    args = ap.parse_args(argv)
    bench = _bench_module()
    say = lambda m: print(f"convert a/b: {m}", file=sys.stderr, flush=True)  # noqa: E731
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    root = Path(tempfile.mkdtemp(prefix="normswap-convert-ab-"))
    try:
        src = root / "src"
        info = bench.synthetic_checkpoint(src, params=args.params, shards=args.shards, progress=say)
        shard = str(info["largest_shard_bytes"])
        runs: dict = {}
        for r in range(args.rounds):
            steps = [("copy", None, [])] + [
                (f"{name} {kind}", tree, flags)
                for kind, flags in (("--no-verify", ["--no-verify"]), ("verified", []))
                for name, tree in trees.items()
            ]
            for step, tree, flags in steps:
                out = root / "out"
                bench._warm(src)
                say(f"round {r + 1}/{args.rounds}: {step}")
                if tree is None:
                    cmd, env = ["cp", "-r", str(src), str(out)], dict(os.environ)
                else:
                    cmd = [
                        sys.executable,
                        "-m",
                        "normswap",
                        "convert",
                        str(src),
                        str(out),
                        "--json",
                        "--max-shard-size",
                        shard,
                        *flags,
                    ]
                    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", NORMSWAP_KERNEL="torch")
                row = bench.run_measured(
                    cmd, env=env, cwd=root
                )  # not a source tree: `-m` puts the cwd first on sys.path
                if row["returncode"] != 0:
                    raise SystemExit(f"{step} failed: {' | '.join(row['stderr_tail'])}")
                runs.setdefault(step, []).append(
                    {
                        "seconds": row["seconds"],
                        "peak_rss_bytes": row["peak_rss_bytes"],
                        "load_1m_after": round(os.getloadavg()[0], 2),
                    }
                )
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "convert-ab",
        "command": " ".join(["python bench/convert_ab.py", *(argv or sys.argv[1:])]),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": bench.machine(),
        "trees": {k: {"path": str(v), "commit": _rev(v)} for k, v in trees.items()},
        "checkpoint": info,
        "runs": runs,
    }
    copy = sorted(x["seconds"] for x in runs["copy"])[len(runs["copy"]) // 2]
    lines = [
        f"# convert before/after — {info['parameters'] / 1e9:.2f}B {info['family']}, {info['dtype']}, "
        f"{info['bytes'] / 1e9:.2f} GB in {info['files']} files",
        "",
        f"Command: `{result['command']}`",
        "",
        f"{result['date']} · {result['machine']['cpu']} · {result['machine']['cores']} cores · before = "
        f"{trees['before']} at {result['trees']['before']['commit']}, after = {trees['after']} at "
        f"{result['trees']['after']['commit']}. Steps interleaved in every round, warm page cache for each.",
        "",
        "| step | wall s (median) | all rounds | × copy (median) | peak RSS | 1-min load after each |",
        "|---|---:|---|---:|---:|---|",
    ]
    for step, rows in runs.items():
        secs = sorted(x["seconds"] for x in rows)
        med = secs[len(secs) // 2]
        each = ", ".join(f"{x['seconds']:.1f}" for x in rows)
        lines.append(
            f"| {step} | {med:.1f} | {each} | {med / copy:.2f} | "
            f"{max(x['peak_rss_bytes'] for x in rows) / 1e9:.2f} GB | "
            f"{', '.join(str(x['load_1m_after']) for x in rows)} |"
        )
    md = "\n".join(lines) + "\n"
    return save_and_print(args.save, result, md)


if __name__ == "__main__":
    sys.exit(main())
