#!/usr/bin/env bash
# #43's CPU goals, each a committed run beside one CPU burner (bench/busy_run.sh), in one go:
#   flock -x /tmp/ns-cpu.lock bash bench/never_slower.sh [OUT_DIR]   (default results/never-slower-<stamp>)
# 1 decode            `normswap bench decode` with its defaults (the shipped models): converted ÷ original
# 2 decode-swap       the same with the roles swapped (each conversion the baseline, loaded twice as the
#                     null control; the original the candidate): an unbiased instrument reads the mirror of 1
# 3 decode-copy       an identical copy of kjv-gpt2's directory in either slot (candidate, then baseline): no difference
# 4 decode-2x96       a 2-layer width-96 tied GPT-2 (random init), where the norms are the largest share
# 5 norms-kjv-gpt2,   `normswap eval speed` original vs exact conversion: time in norm layers (and the
#   norms-kjv-neox    forward, train step, prefill, decode) with the null control
# 6 kernels-tiny      `normswap bench kernels` per-call rows at decode shapes (module vs nn.LayerNorm) and
#                     the CUDA path's host work with its kernel stubbed; one small bandwidth row
# PARTS=generate: the quiet runs instead, each a separate command under $TIMED (a wrapper that gives the
# CPU to one run at a time, no burner; uptime before and after in load.txt), each within ~5 minutes:
# g1 generate-2x96     `bench decode` (decode steps and generate() calls) of the 2 x 96 tied GPT-2
# g2 generate-kjv      the same for kjv-gpt2 and kjv-neox
# g3 generate-swap     the roles swapped (each conversion the baseline)
# g4 generate-small    the GPT-2-small shape (12 x 768, random init), fewer pairs
# g5 train-small       training step and forward of the GPT-2-small shape, batch 8 x 128, with a null
#                      control (bench/train_forward_pairs.py: eval speed's instrument for these two kinds)
#   PARTS=generate ONLY="g1 g2" TIMED="flock -x /tmp/cpu.lock" SETUP="flock -s /tmp/cpu.lock" bash bench/never_slower.sh OUT_DIR
# (TIMED and SETUP: optional prefixes for the timed commands and for the untimed conversions around them)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
out=${1:-results/never-slower-$(date -u +%Y%m%dT%H%MZ)}
mkdir -p "$out"
tmp=$(mktemp -d -t normswap-never-slower.XXXXXX); trap 'rm -rf "$tmp"' EXIT
export PYTHONPATH=$here
# SETUP: a prefix for the untimed preparation (e.g. a shared lock that waits for timed runs,
# so that converting here never runs beside another timed run)
${SETUP:-} python3 -m normswap.cli.main convert normswap:kjv-gpt2 "$tmp/kjv-gpt2-exact" --mode exact >/dev/null
${SETUP:-} python3 -m normswap.cli.main convert normswap:kjv-neox "$tmp/kjv-neox-exact" --mode exact >/dev/null
cp -r normswap/assets/models/kjv-gpt2 "$tmp/kjv-gpt2-copy"
${SETUP:-} python3 bench/make_gpt2_source.py "$tmp/gpt2-2x96" --layers 2 --width 96 --heads 4 >/dev/null
quiet() {  # a quiet run: under the timed lock when TIMED is set (the caller's wrapper), uptime before and after
  local name=$1; shift; mkdir -p "$out/$name"
  echo "$* ($(date -u +%FT%TZ); commit ${NS_COMMIT:-$(git rev-parse --short HEAD)}; ${TIMED:-no lock})" > "$out/$name/command.txt"
  echo "before: $(uptime)" > "$out/$name/load.txt"
  local start; start=$(date +%s)
  ${TIMED:-} python3 -m normswap.cli.main "$@" --save "$out/$name/result.json" > "$out/$name/stdout.txt" \
    2> "$out/$name/stderr.txt" || echo "$name: exit $?" >&2
  echo "after ($(( $(date +%s) - start )) s): $(uptime)" >> "$out/$name/load.txt"
  sed -i "s#$tmp/##g" "$out/$name"/*
}
small() {  # the GPT-2-small shape (random init) and its exact conversion, made once
  [[ -d $tmp/gpt2-small-exact ]] && return
  ${SETUP:-} python3 bench/make_gpt2_source.py "$tmp/gpt2-small" >/dev/null
  ${SETUP:-} python3 -m normswap.cli.main convert "$tmp/gpt2-small" "$tmp/gpt2-small-exact" --mode exact >/dev/null
}
if [[ ${PARTS:-} == generate ]]; then
  ${SETUP:-} python3 -m normswap.cli.main convert "$tmp/gpt2-2x96" "$tmp/gpt2-2x96-exact" --mode exact >/dev/null
  for part in ${ONLY:-g1 g2 g3 g4 g5}; do
    case $part in
      g1) quiet generate-2x96 bench decode "$tmp/gpt2-2x96=$tmp/gpt2-2x96-exact" --model-seconds 100 --generate-seconds 100 ;;
      g2) quiet generate-kjv bench decode "normswap:kjv-gpt2=$tmp/kjv-gpt2-exact" "normswap:kjv-neox=$tmp/kjv-neox-exact" \
            --model-seconds 60 --generate-seconds 60 ;;
      g3) quiet generate-swap bench decode "$tmp/kjv-gpt2-exact=normswap:kjv-gpt2" "$tmp/kjv-neox-exact=normswap:kjv-neox" \
            --model-seconds 60 --generate-seconds 60 ;;
      g4) small
          quiet generate-small bench decode "$tmp/gpt2-small=$tmp/gpt2-small-exact" --model-seconds 90 --generate-seconds 120 \
            --replicas 2 ;;
      g5) small
          mkdir -p "$out/train-small"
          echo "python3 bench/train_forward_pairs.py gpt2-small gpt2-small-exact --batch 8 --seq 128 --budget 120 ($(date -u +%FT%TZ); commit ${NS_COMMIT:-$(git rev-parse --short HEAD)}; ${TIMED:-no lock})" > "$out/train-small/command.txt"
          echo "before: $(uptime)" > "$out/train-small/load.txt"
          ${TIMED:-} python3 bench/train_forward_pairs.py "$tmp/gpt2-small" "$tmp/gpt2-small-exact" --batch 8 --seq 128 \
            --budget 120 --json "$out/train-small/result.json" > "$out/train-small/stdout.txt" 2> "$out/train-small/stderr.txt"
          echo "after: $(uptime)" >> "$out/train-small/load.txt"
          sed -i "s#$tmp/##g" "$out/train-small"/* ;;
    esac
  done
  echo "results: $out"
  exit 0
fi
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
