#!/usr/bin/env bash
# CPU goal check: each converted model (exact) against its LayerNorm original, forward, training
# step and greedy decode, eager and under torch.compile, measured interleaved in one process per
# size by `normswap eval speed` (the same code as `eval report`). Sizes: the shipped kjv-gpt2
# (4 layers, width 128), the shipped kjv-neox, a 6-layer width-384 GPT-2 and the GPT-2-small
# shape (12 layers, 768; random init). Writes results/cpu-models-<stamp>/: one JSON per size and mode, the
# commands, and the load average before and after each (the machine is shared).
#
#   bash bench/cpu_models.sh                 # everything
#   SIZES="kjv" MODES="eager compiled" bash bench/cpu_models.sh
#   WORK=/tmp/x CONVERT_ONLY=1 SIZES=small bash bench/cpu_models.sh   # convert first (no timing), then
#   WORK=/tmp/x SIZES=small flock /work/wt/heavy.lock bash bench/cpu_models.sh   # time under the lock
#   NORMSWAP_BENCH_RESULTS=results/cpu-models-X ...   # several runs (one per size/mode) into one directory
#
# Repeats and tokens per size (REPEATS / NEW_TOKENS override them for every size): a tiny model's
# forward takes ~20 ms and one decode sample 15-30 tokens, so one burst of another process on
# this shared machine moves a single sample by 10-30 %: many interleaved repeats (25) are what
# narrow the interval there; GPT-2-small (2 s a forward and 6 s a training step on one core) gets
# 7 repeats so that one size and mode stays within ~10 minutes, Inductor's compile included.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
SIZES=${SIZES:-"kjv neox mid small"}
MODES=${MODES:-"eager compiled"}
repeats_for() { case $1 in kjv|neox) echo 25 ;; mid) echo 15 ;; *) echo 7 ;; esac; }
# One intra-op thread by default: on a shared machine two OpenMP threads spinning against other
# processes turn a 2 ms forward into hundreds of ms of noise; one thread measures the models' own
# work. THREADS=2 for the machine's full width.
export OMP_NUM_THREADS=${THREADS:-1}
RES=${NORMSWAP_BENCH_RESULTS:-results/cpu-models-$(date -u +%Y%m%dT%H%MZ)}
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
        mid) src=$WORK/mid-src; make=(--layers 6 --width 384 --heads 6) ;;
        small) src=$WORK/small-src; make=() ;;
    esac
    [[ $src == normswap:* || -d $src ]] || "$PY" bench/make_gpt2_source.py "$src" "${make[@]}" >/dev/null || exit 1
    [[ -d $WORK/$size-exact ]] || "$PY" -m normswap convert "$src" "$WORK/$size-exact" --mode exact >/dev/null || exit 1
    [[ -n ${CONVERT_ONLY:-} ]] && continue
    for mode in $MODES; do
        flag=""; [[ $mode == compiled ]] && flag="--compile"
        repeats=${REPEATS:-$(repeats_for "$size")}
        new_tokens=${NEW_TOKENS:-32}
        # original_copy: the original loaded a second time and measured like the others, the null
        # control: what two identical models differ by in this run (noise, not conversion)
        cmd=("$PY" -m normswap eval speed "original=$src" "original_copy=$src" "exact=$WORK/$size-exact" --baseline original --device cpu
             --batch-size 2 --seq-len 64 --new-tokens "$new_tokens" --repeats "$repeats" --min-time 0.2 --no-memory --json $flag)
        echo "# $(date -u +%FT%TZ) load before: $(load)" >>"$RES/commands.txt"
        [[ $src == normswap:* ]] || echo "# $size source: python bench/make_gpt2_source.py $src ${make[*]} (random init), converted with normswap convert --mode exact" >>"$RES/commands.txt"
        echo "OMP_NUM_THREADS=$OMP_NUM_THREADS normswap eval speed original=$src original_copy=$src exact=<converted> ${cmd[*]:8}" >>"$RES/commands.txt"
        start=$SECONDS
        "${cmd[@]}" >"$RES/$size-$mode.json.tmp" 2>"$RES/$size-$mode.log"
        rc=$?
        [[ $rc == 0 ]] && mv "$RES/$size-$mode.json.tmp" "$RES/$size-$mode.json"
        echo "# $(date -u +%FT%TZ) load after: $(load), exit $rc, $((SECONDS - start)) s" >>"$RES/commands.txt"
    done
done
[[ -n $KEEP_WORK ]] || rm -rf "$WORK"
[[ -n ${CONVERT_ONLY:-} ]] && exit 0
"$PY" bench/cpu_models_table.py "$RES" >"$RES/README.md"
cat "$RES/README.md"
