#!/usr/bin/env bash
# #43's CPU goals, each a committed run beside one CPU burner (bench/busy_run.sh), in one go:
#   flock -x /tmp/ns-cpu.lock bash bench/never_slower.sh [OUT_DIR]   (default bench/results/never-slower-<stamp>)
# 1 decode            `normswap bench decode` with its defaults (the shipped models): converted ÷ original
# 2 decode-swap       the same with the roles swapped (each conversion the baseline, loaded twice as the
#                     null control; the original the candidate): an unbiased instrument reads the mirror of 1
# 3 decode-copy       an identical copy of kjv-gpt2's directory in either slot (candidate, then baseline): no difference
# 4 decode-2x96       a 2-layer width-96 tied GPT-2 (random init), where the norms are the largest share
# 5 norms-kjv-gpt2,   `normswap eval speed` original vs exact conversion: time in norm layers (and the
#   norms-kjv-neox    forward, train step, prefill, decode) with the null control
# 6 kernels-tiny      `normswap bench kernels` per-call rows at decode shapes (module vs nn.LayerNorm) and
#                     the CUDA path's host work with its kernel stubbed; one small bandwidth row
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
out=${1:-bench/results/never-slower-$(date -u +%Y%m%dT%H%MZ)}
mkdir -p "$out"
tmp=$(mktemp -d -t normswap-never-slower.XXXXXX); trap 'rm -rf "$tmp"' EXIT
export PYTHONPATH=$here
python3 -m normswap.cli.main convert normswap:kjv-gpt2 "$tmp/kjv-gpt2-exact" --mode exact >/dev/null
python3 -m normswap.cli.main convert normswap:kjv-neox "$tmp/kjv-neox-exact" --mode exact >/dev/null
cp -r normswap/assets/models/kjv-gpt2 "$tmp/kjv-gpt2-copy"
python3 bench/make_gpt2_source.py "$tmp/gpt2-2x96" --layers 2 --width 96 --heads 4 >/dev/null
run() { local name=$1; shift; bash bench/busy_run.sh "$out/$name" "$@" || echo "$name: exit $?" >&2; sed -i "s#$tmp/##g" "$out/$name"/*; }
run decode normswap bench decode
run decode-swap normswap bench decode "$tmp/kjv-gpt2-exact=normswap:kjv-gpt2" "$tmp/kjv-neox-exact=normswap:kjv-neox"
run decode-copy normswap bench decode "normswap:kjv-gpt2=$tmp/kjv-gpt2-copy" "$tmp/kjv-gpt2-copy=normswap:kjv-gpt2"
run decode-2x96 normswap bench decode "$tmp/gpt2-2x96"
for m in kjv-gpt2 kjv-neox; do
  run "norms-$m" normswap eval speed "original=normswap:$m" "exact=$tmp/$m-exact" --baseline original --device cpu \
    --no-memory --quiet
done
run kernels-tiny normswap bench kernels --device cpu --shapes 2048x256 --dtypes float32
echo "results: $out"
