#!/bin/bash
# the timed run: decode (balanced, 3 sessions a graph) then prefill, one flock
set -u
cd /work/wt/serve-wire
OUT=$1
G=/tmp/serve-kv-graphs
ONLY="sliced,sliced int8,original int8"
{ echo "# uptime before"; uptime; } > $OUT/uptime.txt
PYTHONPATH=$PWD python3 -m normswap bench serve --part speed --graphs $G --only "$ONLY" --kinds decode \
  --past-tokens 128 --balanced --sessions 3 --budget 170 --save $OUT/decode.json > $OUT/decode.stdout.txt 2> $OUT/decode.stderr.txt
echo "decode rc $?" >> $OUT/uptime.txt
PYTHONPATH=$PWD python3 -m normswap bench serve --part speed --graphs $G --only "$ONLY" --kinds prefill \
  --prefill-tokens 128 --budget 110 --save $OUT/prefill.json > $OUT/prefill.stdout.txt 2> $OUT/prefill.stderr.txt
echo "prefill rc $?" >> $OUT/uptime.txt
{ echo "# uptime after"; uptime; } >> $OUT/uptime.txt
