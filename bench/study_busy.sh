#!/usr/bin/env bash
# A study on a busy machine: two CPU burners (`python3 -c "while 1: pass"`, this script's own
# children, killed by PID at the end) beside a small `normswap study` of a tiny GPT-2 config.
# What it shows: the throughput claim gets no verdict — results.json's
# comparisons.rmsnorm.throughput_gates names every reason (Amdahl bound below 1.10, load average
# above the CPU count, null control outside its band). Run it under `flock /work/bench.lock`.
#   bash bench/study_busy.sh [OUT_DIR]       (default: results/study-busy-<UTC stamp>)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
RES=${1:-results/study-busy-$(date -u +%Y%m%dT%H%MZ)}
WORK=$(mktemp -d -t normswap-busy.XXXXXX)
mkdir -p "$RES"
echo '{"model_type":"gpt2","n_layer":2,"n_embd":32,"n_head":2,"n_positions":64,"vocab_size":4096}' >"$WORK/tiny.json"
python3 -c "while 1: pass" & B1=$!
python3 -c "while 1: pass" & B2=$!
trap 'kill $B1 $B2 2>/dev/null; rm -rf "$WORK"' EXIT
sleep 20   # let the 1-minute load average see them
{
    echo "uptime before: $(uptime)"
    python3 -m normswap study "$WORK/tiny.json" --out "$WORK/study" --device cpu --steps 30 --seeds 2 --batch-size 4 \
        --seq-len 32 --eval-tokens 512 --eval-every 0 --warmup 5 --no-progress 2>&1 | grep -v '^\[transformers'
    echo "uptime after: $(uptime)"
} | tee "$RES/run.log"
cp "$WORK/study/results.json" "$WORK/study/report.md" "$RES/"
