#!/usr/bin/env bash
# CPU goal check: each converted model (exact) against its LayerNorm original, forward, training
# step and greedy decode, eager and under torch.compile, measured interleaved in one process per
# size by `normswap eval speed` (the same code as `eval report`). Sizes: the shipped kjv-gpt2
# (4 layers, width 128), the shipped kjv-neox, a 6-layer width-384 GPT-2 and the GPT-2-small
# shape (12 layers, 768; random init). Writes bench/results/cpu-models-<stamp>/: one JSON per size and mode, the
# commands, and the load average before and after each (the machine is shared).
#
#   bash bench/cpu_models.sh                 # everything
#   SIZES="kjv" MODES="eager compiled" bash bench/cpu_models.sh
#   WORK=/tmp/x CONVERT_ONLY=1 SIZES=small bash bench/cpu_models.sh   # convert first (no timing), then
#   WORK=/tmp/x SIZES=small flock /work/wt/heavy.lock bash bench/cpu_models.sh   # time under the lock
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
SIZES=${SIZES:-"kjv neox mid small"}
MODES=${MODES:-"eager compiled"}
REPEATS=${REPEATS:-9}
# One intra-op thread by default: on a shared machine two OpenMP threads spinning against other
# processes turn a 2 ms forward into hundreds of ms of noise; one thread measures the models' own
# work. THREADS=2 for the machine's full width.
export OMP_NUM_THREADS=${THREADS:-1}
RES=${NORMSWAP_BENCH_RESULTS:-bench/results/cpu-models-$(date -u +%Y%m%dT%H%M%SZ)}
# WORK keeps the sources and conversions between runs (converted once, timed in several runs)
KEEP_WORK=${WORK:+1}
WORK=${WORK:-$(mktemp -d -t normswap-cpu-models.XXXXXX)}
mkdir -p "$WORK"
[[ -n ${CONVERT_ONLY:-} ]] || mkdir -p "$RES"
load() { "$PY" -c 'import os; print(" ".join(f"{v:.2f}" for v in os.getloadavg()))'; }
for size in $SIZES; do
    case $size in
        kjv) src=normswap:kjv-gpt2 ;;
        neox) src=normswap:kjv-neox ;;
        mid) src=$WORK/mid-src; [[ -d $src ]] || "$PY" bench/make_gpt2_source.py "$src" --layers 6 --width 384 --heads 6 >/dev/null ;;
        small) src=$WORK/small-src; [[ -d $src ]] || "$PY" bench/make_gpt2_source.py "$src" >/dev/null ;;
    esac
    [[ -d $WORK/$size-exact ]] || "$PY" -m normswap convert "$src" "$WORK/$size-exact" --mode exact >/dev/null || exit 1
    [[ -n ${CONVERT_ONLY:-} ]] && continue
    for mode in $MODES; do
        flag=""; [[ $mode == compiled ]] && flag="--compile"
        cmd=("$PY" -m normswap eval speed "original=$src" "exact=$WORK/$size-exact" --baseline original --device cpu
             --batch-size 2 --seq-len 64 --new-tokens 16 --repeats "$REPEATS" --min-time 0.2 --no-memory --json $flag)
        echo "# $(date -u +%FT%TZ) load before: $(load)" >>"$RES/commands.txt"
        echo "OMP_NUM_THREADS=$OMP_NUM_THREADS normswap eval speed original=$src exact=<converted> ${cmd[*]:7}" >>"$RES/commands.txt"
        "${cmd[@]}" >"$RES/$size-$mode.json.tmp" 2>"$RES/$size-$mode.log" && mv "$RES/$size-$mode.json.tmp" "$RES/$size-$mode.json"
        echo "# $(date -u +%FT%TZ) load after: $(load), exit $?" >>"$RES/commands.txt"
    done
done
[[ -n $KEEP_WORK ]] || rm -rf "$WORK"
[[ -n ${CONVERT_ONLY:-} ]] && exit 0
"$PY" bench/cpu_models_table.py "$RES" >"$RES/README.md"
cat "$RES/README.md"
