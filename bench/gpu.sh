#!/usr/bin/env bash
# One prepared GPU run for normswap (target: one H200, under 8 minutes in all, by construction).
#
#   bash bench/gpu.sh              # on the GPU machine, from anywhere; uses its own torch/transformers/triton
#   bash bench/gpu.sh --dry-run    # the same steps, tiny, on CPU (same as NORMSWAP_BENCH_QUICK=1)
#
# Steps (each killed at its limit; a failing step is recorded and the next one still runs):
#   tests     - tests/test_kernels.py + test_kernels_dispatch.py; CUDA is detected, so the Triton
#               kernels run compiled (not interpreted), checked against float64
#   cuda-tests - every test marked `cuda` (skipped on machines without CUDA, so nowhere else):
#               convert --device cuda, a fine-tune on cuda against its own device's reference, and
#               FSDP under `accelerate launch` with the shipped fsdp.yaml against one plain process
#               (the dry run collects them and checks that each is skipped, not lost)
#   kernels   - `normswap bench kernels --device cuda`: LLM shapes, bf16, fwd and fwd+bwd, fused
#               residual rows, per-call times at tiny shapes, what `auto` chose and why, measured
#               copy bandwidth and each kernel's share of it; every case is appended to
#               kernels.jsonl the moment it is measured, so a kill keeps what was done
#   user-path - the user's path: bench/make_gpt2_source.py writes a GPT-2-small-shaped model
#               (random init), and `normswap run bench/gpt2-small-gpu.yaml` converts it exactly,
#               fine-tunes it 50 steps under bf16 autocast with NORMSWAP_KERNEL=triton (the Triton
#               kernels inside the training loop) and writes `eval report` on cuda; the report
#               (report.md, results.json) is copied to user-path/ beside the kernel results
#   study     - `normswap study` of a GPT-2-small-shaped config (random init, 124M parameters):
#               layernorm, rmsnorm (γ = 1) and the layernorm null control interleaved step by step
#               (Williams order), --precision bf16 (every norm computing in bfloat16, recorded per
#               unit), --kernels best (normswap's Triton kernel, F.rms_norm or torch.compile, timed
#               side by side before training; the label of what ran detected per unit),
#               150 steps × 8 × 256 tokens, 2 seeds, on cuda; its report.md and results.json are
#               copied to study/, and summary.md/status.json get the kernels, dtypes, peak memory
#               (max_memory_allocated at a steady-state step) and each arm's Amdahl bound
# Results: bench/results/gpu-<UTC stamp>/ (dry runs: a temp dir unless NORMSWAP_BENCH_RESULTS is
# set), and a copy in $OUT when that is set. Exit status: number of failed steps.
set -uo pipefail   # deliberately no -e: one failing step must not lose the others' results

cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

QUICK=${NORMSWAP_BENCH_QUICK:-0}
if [[ "${1:-}" == "--dry-run" ]]; then QUICK=1; fi

# Time budget (seconds). Each step gets LIMIT + KILL_AFTER at most; env and summary are bounded
# too; the total must stay under 480 s (8 min) or the script refuses to start.
KILL_AFTER=5
# (the study's 80 s came from the kernels' 140 -> 100, the tests' 80 -> 70 and the user path's 180 -> 150;
# the cuda-tests' 70 s from the kernels' 100 -> 80, the tests' 70 -> 60, the user path's 150 -> 125,
# the study's 80 -> 75 and the summary's 30 -> 20)
L_ENV=10; L_TESTS=60; L_CUDA=70; L_KERNELS=80; L_USER=125; L_STUDY=75; L_SUMMARY=20
BUDGET=$(( L_ENV + L_TESTS + L_CUDA + L_KERNELS + L_USER + L_STUDY + L_SUMMARY + 7 * KILL_AFTER ))
if (( BUDGET >= 480 )); then echo "step limits add up to ${BUDGET}s, over 8 minutes" >&2; exit 99; fi
if [[ "$QUICK" == "1" ]]; then
    # the dry run checks the script on a CPU, often a shared one: same steps, tiny, longer limits
    S=${NORMSWAP_DRY_RUN_SCALE:-4}
    L_TESTS=$(( L_TESTS * S )); L_CUDA=$(( L_CUDA * S )); L_KERNELS=$(( L_KERNELS * S )); L_USER=$(( L_USER * S ))
    L_SUMMARY=$(( L_SUMMARY * S )); L_STUDY=$(( L_STUDY * S ))
fi

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
if [[ "$QUICK" == "1" ]]; then
    RES=${NORMSWAP_BENCH_RESULTS:-$(mktemp -d -t normswap-gpu-dryrun.XXXXXX)}
else
    RES=${NORMSWAP_BENCH_RESULTS:-$ROOT/bench/results/gpu-$STAMP}
fi
mkdir -p "$RES"
WORK=$(mktemp -d -t normswap-gpu-work.XXXXXX)   # models and checkpoints: never under results/
STATUS="$RES/steps.tsv"
: >"$STATUS"
T0=$(date +%s)

step() {  # step NAME LIMIT_S CMD...
    local name=$1 limit=$2
    shift 2
    local start end rc
    start=$(date +%s)
    echo "=== [$name] $(date -u +%H:%M:%S) (limit ${limit}s): $*" | tee -a "$RES/$name.log"
    timeout --kill-after=$KILL_AFTER "$limit" "$@" >>"$RES/$name.log" 2>&1
    rc=$?
    end=$(date +%s)
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then echo "=== [$name] TIMED OUT after ${limit}s" | tee -a "$RES/$name.log"; fi
    echo "=== [$name] rc=$rc in $((end - start))s" | tee -a "$RES/$name.log"
    tail -n 5 "$RES/$name.log"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((end - start))" "$limit" >>"$STATUS"   # written as it goes
}

user_path() {  # DEVICE EXTRA_RUN_ARGS...
    local device=$1
    shift
    local tiny=()
    [[ "$device" == "cpu" ]] && tiny=(--tiny)
    "$PY" bench/make_gpt2_source.py "$WORK/source" "${tiny[@]}" || return 1
    "$PY" -m normswap run bench/gpt2-small-gpu.yaml --out "$WORK/run" --set source="$WORK/source" \
        --set device="$device" "$@"
}

collect_user_path() {  # outside the timed step: whatever the run wrote, even if it was killed part-way
    mkdir -p "$RES/user-path"
    for f in report/report.md report/results.json summary.md run.json; do
        [[ -f "$WORK/run/$f" ]] && cp "$WORK/run/$f" "$RES/user-path/"
    done
}
study_config() {  # DIR SHAPE: a bare config.json (random init per seed; tokenizer: the shipped kjv-gpt2's)
    mkdir -p "$1"
    "$PY" - "$1/config.json" "$2" <<'PYEOF'
import json, sys
small = dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024)  # GPT-2 small
tiny = dict(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=4096)  # the dry run: seconds on a CPU
shape = small if sys.argv[2] == "small" else tiny
json.dump(dict(model_type="gpt2", **{"vocab_size": 50257, **shape}), open(sys.argv[1], "w"))
PYEOF
}

study_run() {  # DEVICE SHAPE EXTRA_ARGS...
    local device=$1 shape=$2
    shift 2
    study_config "$WORK/study-config" "$shape" || return 1
    "$PY" -m normswap study "$WORK/study-config/config.json" --out "$WORK/study" --device "$device" --precision bf16 \
        --kernels best --arms layernorm,rmsnorm,layernorm-control --no-progress "$@"
}

collect_study() {
    mkdir -p "$RES/study"
    for f in report.md results.json; do [[ -f "$WORK/study/$f" ]] && cp "$WORK/study/$f" "$RES/study/"; done
}
export -f user_path study_config study_run
export PY WORK RES

if [[ "$QUICK" == "1" ]]; then
    DEVICE=cpu
    step tests "$L_TESTS" "$PY" -m pytest tests/test_kernels.py -q -p no:cacheprovider -rfE \
        -k "forward_and_grads and (float32-64 or bfloat16-384)"
    step cuda-tests "$L_CUDA" "$PY" -m pytest tests -q -p no:cacheprovider -rs -m cuda
    step kernels "$L_KERNELS" "$PY" -m normswap bench kernels --device cpu --quick --jsonl "$RES/kernels.jsonl" \
        --out "$RES/kernels.json" --markdown "$RES/kernels.md"
    step user-path "$L_USER" bash -c 'user_path cpu --set variants.exact.finetune.steps=5 \
        --set variants.exact.finetune.seq_len=64 --set variants.exact.finetune.eval_tokens=1024 \
        --set eval.seq_len=64 --set eval.max_tokens=2048 --set eval.repeats=2 --set eval.new_tokens=4'
    collect_user_path
    step study "$L_STUDY" bash -c 'study_run cpu tiny --steps 5 --seeds 2 --batch-size 4 --seq-len 64 --eval-tokens 512 \
        --eval-every 0 --warmup 2'
    collect_study
else
    DEVICE=cuda
    timeout "$L_ENV" nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version \
        --format=csv >"$RES/env.txt" 2>&1 || true
    step tests "$L_TESTS" "$PY" -m pytest tests/test_kernels.py tests/test_kernels_dispatch.py -q -x \
        -p no:cacheprovider -rfE -m "not slow"
    step cuda-tests "$L_CUDA" "$PY" -m pytest tests -q -p no:cacheprovider -rfEs -m cuda
    step kernels "$L_KERNELS" "$PY" -m normswap bench kernels --device cuda \
        --shapes 8192x768,8192x2048,8192x4096,16384x4096,4096x8192 --jsonl "$RES/kernels.jsonl" \
        --out "$RES/kernels.json" --markdown "$RES/kernels.md"
    step user-path "$L_USER" env NORMSWAP_KERNEL=triton bash -c 'user_path cuda'
    collect_user_path
    step study "$L_STUDY" bash -c 'study_run cuda small --steps 150 --seeds 2 --batch-size 8 --seq-len 256 --warmup 30 \
        --lr 6e-4 --eval-every 75 --eval-tokens 16384'
    collect_study
fi

# status.json + summary.md (env, step table, the kernel tables, the user path's report)
timeout "$L_SUMMARY" "$PY" - "$RES" "$STATUS" "$DEVICE" "$QUICK" "$(( $(date +%s) - T0 ))" "$BUDGET" <<'EOF'
import json, os, platform, sys
res, status_path, device, quick, total, budget = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", int(sys.argv[5]), int(sys.argv[6])
steps = []
for line in open(status_path):
    name, rc, secs, limit = line.rstrip("\n").split("\t")
    rc = int(rc)
    steps.append({"step": name, "rc": rc, "seconds": int(secs), "limit_s": int(limit),
                  "status": "ok" if rc == 0 else ("timeout" if rc in (124, 137) else "failed")})
env = {"python": platform.python_version(), "device": device, "dry_run": quick, "total_seconds": total,
       "budget_seconds": budget, "loadavg": list(os.getloadavg())}
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
    summary["goals"] = (k.get("goals") or []) + ([k["tiny_goal"]] if k.get("tiny_goal") else [])
up = os.path.join(res, "user-path", "results.json")
if os.path.exists(up):
    r = json.load(open(up))
    summary["user_path"] = [{k: m.get(k) for k in ("name", "perplexity", "tokens_per_second", "norm_time_share", "ratios")}
                            for m in r.get("models", [])]
st = os.path.join(res, "study", "results.json")
if os.path.exists(st):
    r = json.load(open(st))
    summary["study"] = {"claims": r.get("claims"), "null_control": r.get("null_control"), "wall_seconds": (r.get("timing") or {}).get("wall_seconds"),
                        "kernels": (r.get("setup") or {}).get("kernels"), "memory_method": (r.get("setup") or {}).get("memory_method"),
                        "amdahl_bound": {a: c.get("amdahl_bound") for a, c in (r.get("comparisons") or {}).items()},
                        "units": [{k: u.get(k) for k in ("arm", "seed", "norm_kernel", "norm_kernel_fused", "norm_compute_dtype")}
                                  | {"peak_bytes": (u.get("memory") or {}).get("peak_bytes")} for u in r.get("units", [])]}
tmp = os.path.join(res, ".status.json.tmp")
json.dump(summary, open(tmp, "w"), indent=2)
os.replace(tmp, os.path.join(res, "status.json"))
lines = ["# normswap GPU run" + (" (dry run on CPU: not a result)" if quick else ""), "",
         "env: " + ", ".join(f"{k}={v}" for k, v in env.items()), ""]
if os.path.exists(os.path.join(res, "env.txt")):
    lines += ["```", open(os.path.join(res, "env.txt")).read().strip(), "```", ""]
lines += ["| step | status | rc | seconds (limit) |", "|---|---|---|---|"]
lines += [f"| {s['step']} | {s['status']} | {s['rc']} | {s['seconds']} ({s['limit_s']}) |" for s in steps]
for title, name in (("Kernels", "kernels.md"), ("User path: convert, bf16 fine-tune, eval report", os.path.join("user-path", "report.md")),
                    ("Study: LayerNorm vs RMSNorm, GPT-2-small shape, bf16", os.path.join("study", "report.md"))):
    p = os.path.join(res, name)
    if os.path.exists(p):
        lines += ["", f"## {title}", "", open(p).read().strip()]
for title, name in (("Tests (tail)", "tests.log"), ("CUDA-marked tests (tail)", "cuda-tests.log")):
    log = os.path.join(res, name)
    if os.path.exists(log):
        tail = [l for l in open(log).read().splitlines() if l.strip()][-15:]
        lines += ["", f"## {title}", "", "```", *tail, "```"]
tmp = os.path.join(res, ".summary.md.tmp")
open(tmp, "w").write("\n".join(lines) + "\n")
os.replace(tmp, os.path.join(res, "summary.md"))
EOF
rm -rf "$WORK"

if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    # at most 8 files come back from the device machine: the summary first
    for f in summary.md status.json kernels.jsonl kernels.json tests.log cuda-tests.log user-path.log user-path/report.md; do
        [[ -f "$RES/$f" ]] && cp "$RES/$f" "$OUT/$(echo "$f" | tr / -)"
    done
fi

FAILED=$(grep -c '"status": "\(failed\|timeout\)"' "$RES/status.json" 2>/dev/null || true)
echo "results: $RES (${FAILED:-?} failed step(s)), total $(( $(date +%s) - T0 ))s of a ${BUDGET}s budget"
exit "${FAILED:-1}"
