#!/usr/bin/env bash
# One prepared GPU run for normswap's kernels (target: one H200, under 8 minutes in all).
#
#   bash bench/gpu.sh              # on the GPU machine, from anywhere; uses its own torch/triton
#   bash bench/gpu.sh --dry-run    # CPU smoke run of every step (same as NORMSWAP_BENCH_QUICK=1)
#
# Steps (each with its own timeout; a failing step is recorded and the next one still runs):
#   1. tests   - tests/test_kernels.py on CUDA with NORMSWAP_KERNEL=triton: compiled kernels,
#                no interpreter, checked against float64 (incl. H up to 32768)
#   2. kernels - `normswap bench kernels --device cuda`: LLM shapes (4096-16384 rows x
#                H in {768, 2048, 4096, 8192}, bf16), fwd and fwd+bwd, fused residual rows,
#                measured copy bandwidth and each kernel's share of it, goals evaluated
#   3. model   - bench/model_throughput.py: GPT-2-small (random init) vs its exact conversion,
#                forward and training-step tokens/s and peak memory
# Results: bench/results/gpu-<UTC stamp>/ (dry runs: a temp dir unless NORMSWAP_BENCH_RESULTS is
# set), and a copy in $OUT when that is set. Exit status: number of failed steps.
set -uo pipefail   # deliberately no -e: one failing step must not lose the others' results

cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

QUICK=${NORMSWAP_BENCH_QUICK:-0}
if [[ "${1:-}" == "--dry-run" ]]; then QUICK=1; fi

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
if [[ "$QUICK" == "1" ]]; then
    RES=${NORMSWAP_BENCH_RESULTS:-$(mktemp -d -t normswap-gpu-dryrun.XXXXXX)}
else
    RES=${NORMSWAP_BENCH_RESULTS:-$ROOT/bench/results/gpu-$STAMP}
fi
mkdir -p "$RES"
STATUS="$RES/.steps.tsv"
: >"$STATUS"
T0=$(date +%s)

step() {  # step NAME TIMEOUT_S CMD...
    local name=$1 limit=$2
    shift 2
    local start end rc
    start=$(date +%s)
    echo "=== [$name] $(date -u +%H:%M:%S) (limit ${limit}s): $*" | tee -a "$RES/$name.log"
    timeout --kill-after=10 "$limit" "$@" >>"$RES/$name.log" 2>&1
    rc=$?
    end=$(date +%s)
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then echo "=== [$name] TIMED OUT after ${limit}s" | tee -a "$RES/$name.log"; fi
    echo "=== [$name] rc=$rc in $((end - start))s" | tee -a "$RES/$name.log"
    tail -n 5 "$RES/$name.log"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((end - start))" "$limit" >>"$STATUS"
}

if [[ "$QUICK" == "1" ]]; then
    DEVICE=cpu
    step tests 300 "$PY" -m pytest tests/test_kernels.py -q -p no:cacheprovider -rfE \
        -k "forward_and_grads and (float32-64 or bfloat16-384)"
    step kernels 300 "$PY" -m normswap bench kernels --device cpu --quick \
        --out "$RES/kernels.json" --markdown "$RES/kernels.md"
    step model 300 "$PY" bench/model_throughput.py --quick --device cpu \
        --out "$RES/model.json" --markdown "$RES/model.md"
else
    DEVICE=cuda
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv >"$RES/env.txt" 2>&1 || true
    step tests 150 env NORMSWAP_TEST_DEVICE=cuda NORMSWAP_KERNEL=triton "$PY" -m pytest tests/test_kernels.py -q -p no:cacheprovider -rfE --timeout=90
    step kernels 240 "$PY" -m normswap bench kernels --device cuda \
        --out "$RES/kernels.json" --markdown "$RES/kernels.md"
    step model 150 "$PY" bench/model_throughput.py --device cuda \
        --out "$RES/model.json" --markdown "$RES/model.md"
fi

# status.json + summary.md (env, step table, the kernel and model tables, goals)
"$PY" - "$RES" "$STATUS" "$DEVICE" "$QUICK" "$(( $(date +%s) - T0 ))" <<'EOF'
import json, os, platform, sys
res, status_path, device, quick, total = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", int(sys.argv[5])
steps = []
for line in open(status_path):
    name, rc, secs, limit = line.rstrip("\n").split("\t")
    rc = int(rc)
    steps.append({"step": name, "rc": rc, "seconds": int(secs), "limit_s": int(limit),
                  "status": "ok" if rc == 0 else ("timeout" if rc in (124, 137) else "failed")})
env = {"python": platform.python_version(), "device": device, "dry_run": quick, "total_seconds": total}
try:
    import torch
    env["torch"] = torch.__version__
    env["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
except Exception as e:  # the summary must still be written
    env["torch"] = f"unavailable: {e}"
for mod in ("triton", "transformers"):
    try:
        env[mod] = __import__(mod).__version__
    except Exception:
        env[mod] = None
summary = {"env": env, "steps": steps}
kj = os.path.join(res, "kernels.json")
if os.path.exists(kj):
    k = json.load(open(kj))
    summary["copy_gbps"] = k.get("copy_gbps")
    summary["goals"] = k.get("goals")
mj = os.path.join(res, "model.json")
if os.path.exists(mj):
    m = json.load(open(mj))
    summary["model_speedup"] = m.get("speedup")
    summary["model_equivalent"] = m.get("equivalent")
tmp = os.path.join(res, ".status.json.tmp")
json.dump(summary, open(tmp, "w"), indent=2)
os.replace(tmp, os.path.join(res, "status.json"))
lines = ["# normswap GPU run" + (" (dry run on CPU: not a result)" if quick else ""), "",
         "env: " + ", ".join(f"{k}={v}" for k, v in env.items()), ""]
if os.path.exists(os.path.join(res, "env.txt")):
    lines += ["```", open(os.path.join(res, "env.txt")).read().strip(), "```", ""]
lines += ["| step | status | rc | seconds (limit) |", "|---|---|---|---|"]
lines += [f"| {s['step']} | {s['status']} | {s['rc']} | {s['seconds']} ({s['limit_s']}) |" for s in steps]
for title, name in (("Kernels", "kernels.md"), ("Model throughput", "model.md")):
    p = os.path.join(res, name)
    if os.path.exists(p):
        lines += ["", f"## {title}", "", open(p).read().strip()]
tests_log = os.path.join(res, "tests.log")
if os.path.exists(tests_log):
    tail = [l for l in open(tests_log).read().splitlines() if l.strip()][-15:]
    lines += ["", "## Tests (tail)", "", "```", *tail, "```"]
tmp = os.path.join(res, ".summary.md.tmp")
open(tmp, "w").write("\n".join(lines) + "\n")
os.replace(tmp, os.path.join(res, "summary.md"))
EOF
rm -f "$STATUS"

if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    # at most 8 files come back from the device machine: the summary first
    for f in summary.md status.json kernels.json model.json tests.log kernels.log model.log env.txt; do
        [[ -f "$RES/$f" ]] && cp "$RES/$f" "$OUT/"
    done
fi

FAILED=$(grep -c '"status": "\(failed\|timeout\)"' "$RES/status.json" || true)
echo "results: $RES ($FAILED failed step(s)), total $(( $(date +%s) - T0 ))s"
exit "$FAILED"
