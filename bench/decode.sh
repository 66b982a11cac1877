#!/usr/bin/env bash
# Batch-1 decode of converted vs original models (#26): the op-level profile and the timed
# benchmark with its null control, on the shipped models and a 2-layer width-96 tied GPT-2 (random
# init from its config, bench/make_gpt2_source.py). Run under the heavy lock:
#   flock /work/bench.lock bench/decode.sh OUT_DIR [PROFILE_PYTHONPATH_BEFORE]
# PROFILE_PYTHONPATH_BEFORE: a checkout of the code before the change, profiled too (the "before" table).
set -euo pipefail
out=$1; before=${2:-}
mkdir -p "$out"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$here
# the "before" profile runs a copy of the script outside this checkout, so that it imports the
# normswap on PYTHONPATH (the script puts its own checkout first on sys.path); that checkout needs
# normswap/benchmarks/decode_timing.py, the timed loop the script imports
mkdir -p "$tmp/bench" && cp bench/decode_profile.py "$tmp/bench/"
python3 bench/make_gpt2_source.py "$tmp/gpt2-2x96" --layers 2 --width 96 --heads 4 >/dev/null
for f in decode-profile.md ${before:+decode-profile-before.md}; do
  echo "# Decode profile ($f: $([ "$f" = decode-profile.md ] && echo "this checkout" || echo "the code before the change")), $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)" > "$out/$f"
  echo >> "$out/$f"
done
for s in normswap:kjv-gpt2 normswap:kjv-neox "$tmp/gpt2-2x96"; do
  n=$(basename "${s#normswap:}")
  python3 -m normswap.cli.main convert "$s" "$tmp/$n-exact" >/dev/null
  if [ -n "$before" ]; then
    PYTHONPATH=$before python3 "$tmp/bench/decode_profile.py" "$s" "$tmp/$n-exact" --steps 32 --rounds 3 --md "$out/decode-profile-before.md" >/dev/null 2>&1
  fi
  python3 bench/decode_profile.py "$s" "$tmp/$n-exact" --steps 32 --rounds 3 --md "$out/decode-profile.md" >/dev/null 2>&1
done
echo "# $(date -u +%FT%TZ) load before: $(cat /proc/loadavg)" >> "$out/decode.txt"
sed -i "s#$tmp/##g" "$out"/decode-profile*.md
python3 -m normswap.cli.main bench decode normswap:kjv-gpt2="$tmp/kjv-gpt2-exact" normswap:kjv-neox="$tmp/kjv-neox-exact" \
  "$tmp/gpt2-2x96"="$tmp/gpt2-2x96-exact" --save "$out/decode.json" 2>/dev/null | sed "s#$tmp/##g" >> "$out/decode.txt"
echo "# $(date -u +%FT%TZ) load after: $(cat /proc/loadavg)" >> "$out/decode.txt"
