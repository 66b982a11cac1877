#!/usr/bin/env bash
# A committed timed run beside one CPU-bound burner process (#37: decided on a busy machine).
#   flock -x /tmp/ns-cpu.lock bench/busy_run.sh OUT_DIR normswap bench decode [ARGS...]
# OUT_DIR gets command.txt, stdout.txt, stderr.txt, result.json (the command's --save, or its --json on stdout) and
# load.txt (uptime before, with the burner running, and after). The burner is `python3 -c 'while
# True: pass'`, started just before the command and stopped (by its pid) right after it.
set -euo pipefail
out=$1; shift
mkdir -p "$out"
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$here
echo "$* (beside one CPU burner, under flock -x /tmp/ns-cpu.lock; $(date -u +%FT%TZ); commit ${NS_COMMIT:-$(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo unknown)})" > "$out/command.txt"
echo "before: $(uptime)" > "$out/load.txt"
python3 -c 'while True: pass' &
burner=$!
trap 'kill "$burner" 2>/dev/null || true' EXIT
sleep 5
echo "burner started (pid $burner): $(uptime)" >> "$out/load.txt"
start=$(date +%s)
case "$3" in
  kernels) extra=(--save "$out/result.json" --markdown "$out/result.md") ;;
  speed) extra=(--json) ;;  # eval speed prints its JSON summary on stdout (copied to result.json below)
  *) extra=(--save "$out/result.json") ;;
esac
set +e
python3 -m normswap.cli.main "${@:2}" "${extra[@]}" > "$out/stdout.txt" 2> "$out/stderr.txt"
rc=$?
set -e
echo "after ($(( $(date +%s) - start )) s, exit $rc): $(uptime)" >> "$out/load.txt"
if [[ "$3" == speed && $rc -eq 0 ]]; then cp "$out/stdout.txt" "$out/result.json"; fi
kill "$burner"
exit $rc
