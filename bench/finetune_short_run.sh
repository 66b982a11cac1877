#!/usr/bin/env bash
# `normswap finetune --steps 3` on the shipped model: the held-out set sized to the run (the default)
# against the former fixed 65,536 tokens, interleaved, two repeats. The output is committed as
# results/finetune-short-run-20261130T1906Z/finetune_short_run.txt:
#     bash bench/finetune_short_run.sh | tee results/finetune-short-run-20261130T1906Z/finetune_short_run.txt
set -euo pipefail
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo "# bash bench/finetune_short_run.sh   ($(date -u +%FT%TZ), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg))"
for rep in 1 2; do
  for ev in default 65536; do
    extra=()
    [ "$ev" != default ] && extra=(--eval-tokens "$ev")
    t0=$(date +%s.%N)
    python3 -m normswap finetune normswap:kjv-gpt2 "$WORK/r$rep-$ev" --steps 3 --device cpu --no-progress --json "${extra[@]}" > "$WORK/s.json"
    t1=$(date +%s.%N)
    python3 - "$WORK/s.json" "$t0" "$t1" "$rep" "$ev" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"repeat {sys.argv[4]}  --eval-tokens {sys.argv[5]:>7}: {s['eval_tokens']:>6,} held-out tokens x 2 evaluations; "
      f"training+evaluation {s['wall_seconds']:6.1f} s; whole command {float(sys.argv[3]) - float(sys.argv[2]):6.1f} s")
PY
  done
done
