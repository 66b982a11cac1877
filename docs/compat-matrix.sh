#!/usr/bin/env bash
# Regenerates docs/compat-matrix.md and docs/compat-matrix.json: `normswap families matrix` over every row
# (`--list-rows`: the curated families, every architecture discovery converts exactly, and the ones it converts
# exactly on their pooled outputs), one row per process, then one table from the rows' saved files.
#
# A row costs minutes on a shared 2-core machine (torch.compile's C++ build, a Trainer, two ONNX exports), so:
# - every finished row is kept in normswap's row cache (normswap/compat/cache.py; private, schema-checked JSON):
#   a rerun redoes only the rows whose inputs (normswap's source, the libraries, the row's config, the
#   columns) changed;
# - each row takes the shared CPU lock on its own (NS_CPU_LOCK, default /tmp/ns-cpu.lock), so an exclusive
#   timed run can get in between rows; while the file $MATRIX_PAUSE exists no new row starts.
# `MATRIX_ROWS="a b c"` replaces the row list.
set -euo pipefail
cd "$(dirname "$0")/.."
rows=(${MATRIX_ROWS:-$(normswap families matrix --list-rows)})
lock=${NS_CPU_LOCK:-/tmp/ns-cpu.lock}
tmp=$(mktemp -d)
from=()
for row in "${rows[@]}"; do
  while [ -n "${MATRIX_PAUSE:-}" ] && [ -e "$MATRIX_PAUSE" ]; do sleep 10; done
  safe=${row//[^A-Za-z0-9_.-]/_}
  if HF_MODULES_CACHE="$tmp/modules" flock -s "$lock" nice normswap families matrix --only "$row" \
      --row-seconds 600 --save "$tmp/$safe.json" > /dev/null; then
    from+=(--from-json "$tmp/$safe.json")
  else
    echo "compat-matrix.sh: the row $row exited $?; left out of the table" >&2
  fi
done
normswap families matrix "${from[@]}" --save docs/compat-matrix.json --markdown docs/compat-matrix.md --force
rm -rf "$tmp"
