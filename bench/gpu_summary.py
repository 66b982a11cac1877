#!/usr/bin/env python3
"""status.json and summary.md of a bench/gpu.sh run: the step table (status, seconds, limit), the
environment, and each step's headline from the files it wrote (kernels, the user's path, the
1.5B speed run, the study). Reads JSON and text only (no torch: it must be quick and always work,
even after a step died), writes both files atomically.

    python bench/gpu_summary.py RESULTS_DIR [--dry-run] [--total-seconds S] [--budget-seconds S]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

TIMED_OUT = (124, 137)  # timeout(1)'s exit status, and SIGKILL's after --kill-after
NULL_GOAL = 0.01  # a null control within ±1 %: the run can tell a 1 % difference for that kind


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_steps(res: Path) -> list[dict]:
    steps = []
    if not (res / "steps.tsv").exists():
        return steps
    for line in (res / "steps.tsv").read_text().splitlines():
        name, rc, secs, limit = line.split("\t")
        status = "ok" if rc == "0" else ("timeout" if int(rc) in TIMED_OUT else "failed")
        steps.append({"step": name, "rc": int(rc), "seconds": int(secs), "limit_s": int(limit), "status": status})
    return steps


def _interval(iv: dict | None) -> str:
    if not iv:
        return "—"
    return f"×{iv['median']:.3f} [{iv['low']:.3f}–{iv['high']:.3f}], {iv.get('pairs', '?')} pairs"


def speed_rows(results: dict) -> list[dict]:
    """Per kind of an eval speed/report results.json: each model's ratio to the baseline and the null
    control's, and whether the null is inside ±NULL_GOAL."""
    null = (results.get("null_control") or {}).get("ratio_intervals") or {}
    null_kinds = dict(null.get("tokens_per_second") or {}, norms=null.get("norm_ms_per_forward"))
    rows = []
    for m in results.get("models") or []:
        ivs = m.get("ratio_intervals") or {}
        kinds = dict(ivs.get("tokens_per_second") or {}, norms=ivs.get("norm_ms_per_forward"))
        for kind, iv in kinds.items():
            if not iv:
                continue
            n = null_kinds.get(kind)
            within = None if not n else (1 - NULL_GOAL <= n["low"] and n["high"] <= 1 + NULL_GOAL)
            rows.append({"model": m["name"], "kind": kind, "ratio": iv, "null": n, "null_within_1pct": within})
    return rows


def _speed_table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | kind | ratio to the baseline (speed; norms: time) | verdict | null control | null within ±1 % |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        within = {True: "yes", False: "no", None: "—"}[r["null_within_1pct"]]
        lines.append(
            f"| {r['model']} | {r['kind']} | {_interval(r['ratio'])} | {r['ratio'].get('verdict', '')} | "
            f"{_interval(r['null'])} | {within} |"
        )
    return lines


def summarize(res: Path, *, dry_run: bool, total: int | None, budget: int | None) -> tuple[dict, str]:
    steps = read_steps(res)
    env = _json(res / "setup" / "env.json") or {}
    summary = {"dry_run": dry_run, "total_seconds": total, "budget_seconds": budget, "env": env, "steps": steps}
    kernels = _json(res / "kernels" / "kernels.json")
    if kernels:
        summary["kernels"] = {
            "copy_gbps": kernels.get("copy_gbps"),
            "rows": len(kernels.get("rows") or []),
            "tiny_rows": len(kernels.get("tiny") or []),
            "skipped": kernels.get("skipped"),
            "goals": (kernels.get("goals") or []) + ([kernels["tiny_goal"]] if kernels.get("tiny_goal") else []),
        }
    user = _json(res / "user-path" / "results.json")
    if user:
        summary["user_path"] = {
            "models": [{k: m.get(k) for k in ("name", "perplexity", "ratios")} for m in user.get("models") or []],
            "warnings": user.get("warnings"),
            "speed": speed_rows(user),
        }
    xl = _json(res / "xl-speed" / "xl-speed.json")
    if xl:
        summary["xl_speed"] = {"device": xl.get("device"), "dtype": xl.get("dtype"), "speed": speed_rows(xl)}
    study = _json(res / "study" / "results.json")
    if study:
        setup = study.get("setup") or {}
        summary["study"] = {
            "claims": study.get("claims"),
            "notes": study.get("notes"),
            "kernels": setup.get("kernels"),
            "amdahl_bound": {a: c.get("amdahl_bound") for a, c in (study.get("comparisons") or {}).items()},
            "norm_compute_dtype": {
                f"{u['arm']}/{u['seed']}": u.get("norm_compute_dtype") for u in study.get("units") or []
            },
            "wall_seconds": (study.get("timing") or {}).get("wall_seconds"),
        }
    return summary, _markdown(res, summary)


def _markdown(res: Path, s: dict) -> str:
    lines = ["# normswap GPU run" + (" (dry run on CPU: not a result)" if s["dry_run"] else ""), ""]
    if s["total_seconds"] is not None:
        lines += [f"total {s['total_seconds']} s of a {s['budget_seconds']} s plan", ""]
    lines += ["env: " + ", ".join(f"{k}={v}" for k, v in s["env"].items()), ""]
    lines += ["| step | status | rc | seconds (limit) |", "|---|---|---|---|"]
    lines += [f"| {t['step']} | {t['status']} | {t['rc']} | {t['seconds']} ({t['limit_s']}) |" for t in s["steps"]]
    for title, key in (
        ("1.5B (GPT-2-XL shape), eval speed", "xl_speed"),
        ("User path: eval report speed", "user_path"),
    ):
        if s.get(key) and s[key].get("speed"):
            lines += ["", f"## {title}", "", *_speed_table(s[key]["speed"])]
    for title, name in (
        ("Kernels", "kernels/kernels.md"),
        ("User path: convert, bf16 fine-tune, eval report", "user-path/report.md"),
        ("Study: LayerNorm vs RMSNorm, GPT-2-small shape, bf16", "study/report.md"),
    ):
        if (res / name).exists():
            lines += ["", f"## {title}", "", (res / name).read_text().strip()]
    for t in s["steps"]:
        log = res / f"{t['step']}.log"
        if t["status"] != "ok" and log.exists():
            tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-12:]
            lines += ["", f"## {t['step']}: {t['status']} (log tail)", "", "```", *tail, "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="the run's results directory (results/gpu-<stamp>/)")
    ap.add_argument("--dry-run", action="store_true", help="the run was bench/gpu.sh --dry-run (CPU)")
    ap.add_argument("--total-seconds", type=int, default=None)
    ap.add_argument("--budget-seconds", type=int, default=None)
    args = ap.parse_args(argv)
    res = Path(args.results)
    if not res.is_dir():
        ap.error(f"{res} is not a directory")
    summary, md = summarize(res, dry_run=args.dry_run, total=args.total_seconds, budget=args.budget_seconds)
    _write(res / "status.json", json.dumps(summary, indent=2) + "\n")
    _write(res / "summary.md", md)
    bad = [t["step"] for t in summary["steps"] if t["status"] != "ok"]
    print(f"{res}: {len(summary['steps'])} step(s), {len(bad)} not ok{': ' + ', '.join(bad) if bad else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
