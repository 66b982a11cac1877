"""Where the seconds of `normswap convert` go:
`python bench/convert_profile.py --save results/convert-profile-1.4b-20261201T0136Z/convert-profile-1.4b`.

Builds the same synthetic checkpoint as `normswap bench convert` (normswap/benchmarks/conversion.py),
then runs `convert_checkpoint` in a fresh
process (so that imports are timed as a user meets them) once with --no-verify and once verified,
with timers around each stage of the real code path (the functions are wrapped, not copied):

- imports: Python start-up, torch, transformers' top level, normswap's CLI and pipeline;
- config: ``load_config`` (transformers' AutoConfig); model class: importing the modeling module;
- plan: meta skeleton, family, matching file tensors to it, the plan;
- convert: ``execute`` (reads, arithmetic and writes on a thread pool): its wall seconds, the
  process's CPU seconds meanwhile (user and kernel apart), and the thread-seconds spent in reads
  (``pread``, kernel copies) and in writes (``pwrite``) summed over threads, both as elapsed time
  and as the calling threads' own CPU time: with more threads than free cores, elapsed time in a
  call includes waiting for a core, so only the CPU column says what the call itself costs;
- verification: each forward pass (source, converted, unrounded) split into loading weights
  (reads, casts, recomputing unrounded tensors) and the rest of the forward, with the seconds
  inside ``torch.nn.functional.linear`` (the matrix products) counted apart;
- the floors beside them: `cp -r` of the checkpoint, a process that only imports torch, and the
  matrix products' share, which no implementation of this probe avoids.

The page cache is warm (every source file read once before each run), as in normswap/benchmarks/conversion.py.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from normswap.benchmarks.saved_result import save_and_print

_HERE = Path(__file__).resolve().parent

# The child: the real convert path with timers wrapped around its stages. Prints one JSON line.
_CHILD = r"""
import json, sys, time, threading, resource
T0 = time.perf_counter(); C0 = time.process_time()
stages = []
def lap(name, t, c):
    stages.append({"stage": name, "wall_s": round(time.perf_counter() - t, 3),
                   "cpu_s": round(time.process_time() - c, 3)})
t, c = time.perf_counter(), time.process_time()
import torch
lap("import torch", t, c); t, c = time.perf_counter(), time.process_time()
import transformers
lap("import transformers (top level)", t, c); t, c = time.perf_counter(), time.process_time()
import normswap.cli.convert_command
from normswap.convert import pipeline, execute as ex, verify as V, tensor_match as I, source as S
from normswap.checkpoint import load as ckload, shards as SH
lap("import normswap (cli, pipeline)", t, c)

lock = threading.Lock()
acc = {"read_thread_s": 0.0, "write_thread_s": 0.0, "linear_s": 0.0, "read_thread_cpu_s": 0.0,
       "write_thread_cpu_s": 0.0, "linear_cpu_s": 0.0}
def timed_into(name, fn):
    def wrapper(*a, **k):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            with lock:
                acc[name] += time.perf_counter() - t
                acc[name[:-len("_s")] + "_cpu_s"] += time.thread_time() - c
    return wrapper
S.SafetensorsFiles.read = timed_into("read_thread_s", S.SafetensorsFiles.read)
SH.ShardWriter.write = timed_into("write_thread_s", SH.ShardWriter.write)
SH.ShardWriter.copy = timed_into("read_thread_s", SH.ShardWriter.copy)  # kernel copy: read and write in one
torch.nn.functional.linear = timed_into("linear_s", torch.nn.functional.linear)

def stage(name, module, attr, extra=None):
    fn = getattr(module, attr)
    def wrapper(*a, **k):
        t, c = time.perf_counter(), time.process_time()
        before, usage = dict(acc), resource.getrusage(resource.RUSAGE_SELF)
        try:
            return fn(*a, **k)
        finally:
            row = {"stage": name, "wall_s": round(time.perf_counter() - t, 3),
                   "cpu_s": round(time.process_time() - c, 3)}
            if extra:
                row.update({k: round(acc[k] - before[k], 3) for k in extra})
                now = resource.getrusage(resource.RUSAGE_SELF)
                row["user_cpu_s"] = round(now.ru_utime - usage.ru_utime, 3)
                row["kernel_cpu_s"] = round(now.ru_stime - usage.ru_stime, 3)
            stages.append(row)
    setattr(module, attr, wrapper)

stage("config (AutoConfig)", ckload, "load_config")
stage("model class (imports the modeling code)", ckload, "model_class_for")
stage("match file tensors to the skeleton", I, "match")
stage("plan (prepare)", pipeline, "prepare")
stage("convert: execute (read, arithmetic, write)", pipeline, "execute",
      ["read_thread_s", "write_thread_s", "read_thread_cpu_s", "write_thread_cpu_s"])
stage("verification (total)", pipeline, "run_verification")

passes = []
outputs = V.outputs
def timed_outputs(build, fetch, dtype, *a, **k):
    load = [0.0]
    def timed_fetch(*x, **y):
        t = time.perf_counter()
        try:
            return fetch(*x, **y)
        finally:
            load[0] += time.perf_counter() - t
    t, c, lin = time.perf_counter(), time.process_time(), acc["linear_s"]
    try:
        return outputs(build, timed_fetch, dtype, *a, **k)
    finally:
        wall = time.perf_counter() - t
        pass_names = ["source", "converted", "unrounded (rounding floor)", "source float64 (noise floor)"]
        passes.append({"pass": pass_names[len(passes)],
                       "wall_s": round(wall, 3), "cpu_s": round(time.process_time() - c, 3),
                       "load_weights_s": round(load[0], 3), "matmul_s": round(acc["linear_s"] - lin, 3),
                       "other_forward_s": round(wall - load[0] - (acc["linear_s"] - lin), 3)})
V.outputs = timed_outputs

src, out, shard, verify = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
t, c = time.perf_counter(), time.process_time()
result = pipeline.convert_checkpoint(src, out, verify=verify, max_shard_size=shard)
lap("convert_checkpoint (all of it)", t, c)
print(json.dumps({"stages": stages, "passes": passes, "total_wall_s": round(time.perf_counter() - T0, 3),
                  "total_cpu_s": round(time.process_time() - C0, 3), "verification": result["verification"]}))
"""


def _bench_module():
    from normswap.benchmarks import conversion

    return conversion


def _timed(cmd, env) -> tuple[float, str]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"convert_profile: {cmd[:3]} failed: {proc.stderr.strip()[-500:]}")
    return time.perf_counter() - t, proc.stdout


def profile(*, params=1.4e9, shards=5, workdir=None, command=None, progress=print) -> dict:
    bench = _bench_module()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", NORMSWAP_KERNEL="torch")
    root = Path(tempfile.mkdtemp(prefix="normswap-convert-profile-", dir=workdir))
    try:
        src = root / "src"
        info = bench.synthetic_checkpoint(src, params=params, shards=shards, progress=progress)
        shard = str(info["largest_shard_bytes"])
        floors = {}
        bench._warm(src)
        floors["cp_r_s"] = round(_timed(["cp", "-r", str(src), str(root / "copy")], env)[0], 3)
        shutil.rmtree(root / "copy")
        floors["python_import_torch_s"] = round(_timed([sys.executable, "-c", "import torch"], env)[0], 3)
        floors["python_import_torch_transformers_modeling_s"] = round(
            _timed(
                [
                    sys.executable,
                    "-c",
                    "import sys; from normswap.checkpoint.load import load_config, model_class_for; "
                    "model_class_for(load_config(sys.argv[1]))",
                    str(src),
                ],
                env,
            )[0],
            3,
        )
        runs = {}
        for name, verify in (("no_verify", "0"), ("verified", "1")):
            bench._warm(src)
            progress(f"profiling convert ({name})")
            wall, stdout = _timed(
                [sys.executable, "-c", _CHILD, str(src), str(root / f"out_{name}"), shard, verify], env
            )
            runs[name] = json.loads(stdout.strip().splitlines()[-1])
            runs[name]["process_wall_s"] = round(wall, 3)
            shutil.rmtree(root / f"out_{name}", ignore_errors=True)
        return {
            "benchmark": "convert-profile",
            "command": command,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {**bench.machine(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
            "checkpoint": info,
            "floors": floors,
            "runs": runs,
            "page_cache": "warm: the source files are read once (cat > /dev/null) before each run",
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def markdown(r: dict) -> str:
    info, m, fl = r["checkpoint"], r["machine"], r["floors"]
    lines = [
        f"# Where the time of `normswap convert` goes — {info['family']}, {info['parameters'] / 1e9:.2f}B parameters, "
        f"{info['dtype']}, {info['bytes'] / 1e9:.2f} GB in {info['files']} files",
        "",
        f"Command: `{r.get('command')}`",
        "",
        f"{r['date']} · {m['cpu']} · {m['cores']} cores · torch {m['torch']} · load average (1, 5, 15 min) "
        f"{m['load_average_at_end']} at the end (shared machine). "
        f"Page cache: {r['page_cache']}. One run of each; wall s are seconds of elapsed time, cpu s the process's "
        "CPU seconds (above wall where two cores worked).",
        "",
        "| floor | s |",
        "|---|---:|",
        f"| `cp -r` of the checkpoint (read + write every byte) | {fl['cp_r_s']:.2f} |",
        f"| a process that imports torch | {fl['python_import_torch_s']:.2f} |",
        f"| a process that imports torch + transformers + the modeling code (what the plan needs) | "
        f"{fl['python_import_torch_transformers_modeling_s']:.2f} |",
        "",
    ]
    for name, run in r["runs"].items():
        lines += [
            f"## convert {'--no-verify' if name == 'no_verify' else '(verified)'}: {run['process_wall_s']:.2f} s "
            f"wall for the process ({run['total_cpu_s']:.1f} s CPU)",
            "",
            "| stage | wall s | cpu s | notes |",
            "|---|---:|---:|---|",
        ]
        seen = set()
        for row in run["stages"]:
            if row["stage"] in seen and row["wall_s"] < 0.05:
                continue  # a repeat (verification's own config and skeletons) that costs nothing
            seen.add(row["stage"])
            notes = ""
            if "read_thread_cpu_s" in row:
                notes = (
                    f"CPU s: user {row['user_cpu_s']:.2f}, kernel {row['kernel_cpu_s']:.2f}. Inside reads and kernel "
                    f"copies: {row['read_thread_s']:.2f} thread-s elapsed, {row['read_thread_cpu_s']:.2f} CPU; inside "
                    f"writes: {row['write_thread_s']:.2f} elapsed, {row['write_thread_cpu_s']:.2f} CPU (elapsed beyond "
                    "CPU: waiting for a core or the file); the rest of the CPU is arithmetic"
                )
            elif "read_thread_s" in row:  # a result saved before CPU time was recorded
                notes = (
                    f"thread-seconds summed over the pool: reads and kernel copies {row['read_thread_s']:.2f}, "
                    f"writes {row['write_thread_s']:.2f}; the rest of the CPU is arithmetic"
                )
            lines.append(f"| {row['stage']} | {row['wall_s']:.2f} | {row['cpu_s']:.2f} | {notes} |")
        if run["passes"]:
            lines += [
                "",
                "| verification pass | wall s | cpu s | loading weights s | matrix products s "
                "| rest of the forward s |",
                "|---|---:|---:|---:|---:|---:|",
            ]
            for p in run["passes"]:
                lines.append(
                    f"| {p['pass']} | {p['wall_s']:.2f} | {p['cpu_s']:.2f} | {p['load_weights_s']:.2f} | "
                    f"{p['matmul_s']:.2f} | {p['other_forward_s']:.2f} |"
                )
        lines.append("")
    lines += [
        "- stages nest: `model class` runs inside the plan's first skeleton build, `match` and `plan` inside "
        "`convert_checkpoint`, the verification's own skeletons and matches inside `verification (total)`; "
        "rows are not meant to add up",
        "- loading weights (verification): reading the files and casting to float32 for the source and converted "
        "passes; recomputing the converted tensors before rounding for the unrounded pass",
        "- matrix products: seconds inside torch.nn.functional.linear (64 probe tokens x every weight matrix)",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1.4e9)
    ap.add_argument("--shards", type=int, default=5)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--save", default=None, help="write SAVE.json and SAVE.md")
    args = ap.parse_args(argv)
    command = " ".join(["python bench/convert_profile.py", *(argv if argv is not None else sys.argv[1:])])
    result = profile(
        params=args.params,
        shards=args.shards,
        workdir=args.workdir,
        command=command,
        progress=lambda msg: print(f"convert profile: {msg}", file=sys.stderr, flush=True),
    )
    md = markdown(result)
    return save_and_print(args.save, result, md)


if __name__ == "__main__":
    sys.exit(main())
