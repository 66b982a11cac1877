#!/usr/bin/env bash
# Regenerates docs/architectures-survey.md and normswap/architectures/data/survey.json (the rows `normswap families --all` lists): every model_type of the installed transformers,
# discovered and checked exactly as `normswap convert` would. Four shards (each about 8 minutes with
# two workers on a 2-core machine; set SURVEY_LOCK to a lock file to queue each behind other heavy
# jobs), then one table from the four files.
#
# `docs/architectures-survey.sh --update-tried` re-runs only the rows tried last time (exact,
# approximate-only, refused: about 8 minutes under one lock) and keeps the others; the table then
# says how many rows come from which run.
set -euo pipefail
cd "$(dirname "$0")/.."
lock=()
[ -n "${SURVEY_LOCK:-}" ] && lock=(flock "$SURVEY_LOCK")
rows=normswap/architectures/data/survey.json
if [ "${1:-}" = "--update-tried" ]; then
  "${lock[@]}" normswap families survey --from-json "$rows" --update exact --update approx-only --update refused --jobs 2 \
    --save "$rows" --markdown docs/architectures-survey.md
  exit 0
fi
tmp=$(mktemp -d)
for k in 1 2 3 4; do
  "${lock[@]}" normswap families survey --shard "$k/4" --jobs 2 --save "$tmp/shard$k.json" > /dev/null
done
normswap families survey --from-json "$tmp/shard1.json" --from-json "$tmp/shard2.json" --from-json "$tmp/shard3.json" \
  --from-json "$tmp/shard4.json" --save "$rows" --markdown docs/architectures-survey.md
rm -rf "$tmp"
