#!/usr/bin/env bash
# Regenerates docs/compat-matrix.md and docs/compat-matrix.json: `normswap families matrix` over every
# curated family and a chosen set of architectures that discovery converts exactly, in two shards run
# side by side (a row costs 2-5 minutes on a shared 2-core machine, torch.compile's C++ build most of
# it, so all 74 rows would take hours), then one table from the two files.
#
# The discovered rows: the two the issue reported (Whisper, ViT; GPT-2 is curated), a pre-LN text
# encoder that sentence-transformers loads (XLM-RoBERTa-XL), an encoder-decoder text model (mBART),
# another vision encoder (DeiT) and a decoder-only LM found by discovery (OLMo).
# `MATRIX_ROWS="a b c"` replaces the list; `--all` runs every row (hours).
set -euo pipefail
cd "$(dirname "$0")/.."
rows=(${MATRIX_ROWS:-bert biogpt bloom codegen falcon gpt2 gpt_bigcode gpt_neo gpt_neox gptj mpt opt persimmon phi roberta
      stablelm starcoder2 xglm whisper vit xlm-roberta-xl mbart deit olmo})
if [ "${1:-}" = "--all" ]; then
  rows=($(normswap families matrix --list-rows))
fi
tmp=$(mktemp -d)
half=$(( (${#rows[@]} + 1) / 2 ))
pids=()
for k in 0 1; do
  shard=("${rows[@]:$((k * half)):$half}")
  args=()
  for r in "${shard[@]}"; do args+=(--only "$r"); done
  HF_MODULES_CACHE="$tmp/modules$k" nice normswap families matrix "${args[@]}" --row-seconds 300 --save-json "$tmp/shard$k.json" > /dev/null &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
normswap families matrix --from-json "$tmp/shard0.json" --from-json "$tmp/shard1.json" \
  --save-json docs/compat-matrix.json --out docs/compat-matrix.md
rm -rf "$tmp"
