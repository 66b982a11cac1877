#!/usr/bin/env bash
# A committed timed run; run it with the CPU to itself (nothing else of ours running), e.g.
#   bash bench/timed_run.sh OUT normswap bench slice ...
# OUT gets command.txt (the command line, time, commit), stdout.txt, stderr.txt, result.json (the
# command's --save) and load.txt (uptime before and after).
set -euo pipefail
out=$1; shift
mkdir -p "$out"
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$here
echo "$* --save $out/result.json ($(date -u +%FT%TZ); commit $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo unknown))" > "$out/command.txt"
echo "before: $(uptime)" > "$out/load.txt"
start=$(date +%s)
set +e
python3 -m normswap.cli.main "${@:2}" --save "$out/result.json" > "$out/stdout.txt" 2> "$out/stderr.txt"
rc=$?
set -e
echo "after ($(( $(date +%s) - start )) s, exit $rc): $(uptime)" >> "$out/load.txt"
exit $rc
