#!/usr/bin/env bash
# Regenerates docs/architectures-survey.md and normswap/architectures/data/survey.json (the rows `normswap families --all` lists): every model_type of the installed transformers,
# discovered and checked exactly as `normswap convert` would. Four shards (each about 8 minutes with
# two workers on a 2-core machine; set SURVEY_LOCK to a lock file to queue each behind other heavy
# jobs), then one table from the four files.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
lock=()
[ -n "${SURVEY_LOCK:-}" ] && lock=(flock "$SURVEY_LOCK")
for k in 1 2 3 4; do
  "${lock[@]}" normswap families survey --shard "$k/4" --jobs 2 --save-json "$tmp/shard$k.json" > /dev/null
done
normswap families survey --from-json "$tmp/shard1.json" --from-json "$tmp/shard2.json" --from-json "$tmp/shard3.json" \
  --from-json "$tmp/shard4.json" --save-json normswap/architectures/data/survey.json --out docs/architectures-survey.md
rm -rf "$tmp"
