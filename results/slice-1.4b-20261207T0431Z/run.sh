#!/usr/bin/env bash
# the 1.4B slice run from main's checkout (its results are copied into results/ afterwards)
set -u
out=/work/runs/slice-1.4b
rm -rf "$out" /work/big/neox-1.4b-sliced; mkdir -p "$out"
cd /work/main
echo "# normswap slice on the synthetic 1.4B GPT-NeoX (bf16, 5 shards; normswap.benchmarks.conversion.synthetic_checkpoint(params=1.4e9, shards=5, dtype=\"bf16\", seed=0), kjv-neox's tokenizer beside it)" > "$out/command.txt"
echo "# commit $(git rev-parse --short HEAD), started $(date -u +%FT%TZ) on the shared 2-core / 24 GiB CPU host" >> "$out/command.txt"
echo "PYTHONPATH=/work/main /usr/bin/time -v python3 -m normswap slice /work/big/neox-1.4b /work/big/neox-1.4b-sliced --fraction 0.25 --calibration-tokens 2048 --eval-tokens 1024 --device cpu --json > result.json 2> stderr.txt" >> "$out/command.txt"
uptime > "$out/uptime-before.txt"
PYTHONPATH=/work/main /usr/bin/time -v python3 -m normswap slice /work/big/neox-1.4b /work/big/neox-1.4b-sliced --fraction 0.25 --calibration-tokens 2048 --eval-tokens 1024 --device cpu --json > "$out/result.json" 2> "$out/stderr.txt"
echo "exit $?" >> "$out/uptime-after.txt"
uptime >> "$out/uptime-after.txt"
