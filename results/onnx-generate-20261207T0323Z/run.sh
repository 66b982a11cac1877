#!/bin/bash
# Exports every kjv model, its exact conversion and a 25 % slice with the key/value cache, then checks greedy parity.
set -euo pipefail
W=${W:-/tmp/kv-run/work}
rm -rf "$W"; mkdir -p "$W"
A=normswap/assets/models
for m in kjv-gpt2 kjv-neox; do
  python3 -m normswap convert $A/$m "$W/$m-converted" --json > "$W/$m-convert.json"
  python3 -m normswap slice $A/$m "$W/$m-sliced" --fraction 0.25 --json > "$W/$m-slice.json"
  for v in "$A/$m:$m" "$W/$m-converted:$m-converted" "$W/$m-sliced:$m-sliced"; do
    python3 -m normswap export "${v%%:*}" "$W/onnx-${v##*:}" --format onnx --json > "$W/export-${v##*:}.json"
  done
done
python3 "$(dirname "$0")/parity.py" \
  "$W/onnx-kjv-gpt2=$A/kjv-gpt2" "$W/onnx-kjv-gpt2-converted=$W/kjv-gpt2-converted" "$W/onnx-kjv-gpt2-sliced=$W/kjv-gpt2-sliced" \
  "$W/onnx-kjv-neox=$A/kjv-neox" "$W/onnx-kjv-neox-converted=$W/kjv-neox-converted" "$W/onnx-kjv-neox-sliced=$W/kjv-neox-sliced"
