#!/usr/bin/env bash
# Slice the shipped models at 25 %, heal each by distilling from its original (≤ 200 steps), and
# score the original, the sliced and the healed model on the held-out test books (128-token
# windows, stride 64: the figures docs/models.md quotes). Not timed: run it under the shared lock.
#   /work/tools/cpu bash bench/slice_heal.sh results/slice-heal-<date>
# OUT gets command.txt, per model <m>-slice.json, <m>-finetune.json, <m>-ppl.json and their
# stderr (progress), summary.txt (the perplexities side by side) and load.txt.
set -euo pipefail
out=$1
fraction=${FRACTION:-0.25}
steps=${STEPS:-200}
models=${MODELS:-"kjv-gpt2 kjv-neox"}
mkdir -p "$out"
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$here
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ns() { python3 -m normswap.cli.main "$@"; }
echo "bash bench/slice_heal.sh $out (FRACTION=$fraction STEPS=$steps MODELS='$models'; $(date -u +%FT%TZ); commit $(git -C "$here" rev-parse --short HEAD))" > "$out/command.txt"
echo "before: $(uptime)" > "$out/load.txt"
for m in $models; do
  src=normswap:$m
  cmd_slice=(slice "$src" "$work/$m-sliced" --fraction "$fraction" --device cpu --json)
  cmd_ft=(finetune "$work/$m-sliced" "$work/$m-healed" --distill-from "$src" --steps "$steps" --lr 5e-4
    --warmup-steps 10 --lr-schedule cosine --batch-size 8 --seq-len 128 --eval-tokens 4096 --device cpu --json)
  cmd_ppl=(eval ppl "$src" "$work/$m-sliced" "$work/$m-healed" --baseline "$src" --seq-len 128 --stride 64
    --max-tokens 0 --device cpu --json)
  for c in cmd_slice cmd_ft cmd_ppl; do
    declare -n cmd=$c
    echo "normswap ${cmd[*]}" >> "$out/command.txt"
  done
  ns "${cmd_slice[@]}" > "$out/$m-slice.json" 2> "$out/$m-slice.stderr.txt"
  ns "${cmd_ft[@]}" > "$out/$m-finetune.json" 2> "$out/$m-finetune.stderr.txt"
  ns "${cmd_ppl[@]}" > "$out/$m-ppl.json" 2> "$out/$m-ppl.stderr.txt"
done
echo "after: $(uptime)" >> "$out/load.txt"
python3 "$here/bench/slice_heal_summary.py" "$out" $models | tee "$out/summary.txt"
