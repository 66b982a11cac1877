#!/bin/bash
# OLD (main's tree) then NEW (this branch), the same command, one after the other, each under
# /work/tools/timed (an exclusive lock on the shared 2-core machine); uptime before and after each.
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
OLD=${OLD:-/work/main}
NEW=${NEW:-$(cd "$HERE/../../.." && pwd)}
ARGS="bench kernels --device cpu --threads 1 --shapes 256x256 --dtypes float32 --modes fwd --no-residual --budget 3"
for side in old new; do
  tree=$OLD; [ $side = new ] && tree=$NEW
  { echo "tree: $tree ($(git -C "$tree" rev-parse --short HEAD))"; echo "command: PYTHONPATH=$tree /work/tools/timed python -m normswap $ARGS --out $side.json --markdown $side.md"; echo "uptime before: $(uptime)"; } > "$HERE/$side.txt"
  (cd "$HERE" && PYTHONPATH=$tree /work/tools/timed python -m normswap $ARGS --out $side.json --markdown $side.md > /dev/null 2>> "$HERE/$side.txt")
  echo "uptime after: $(uptime)" >> "$HERE/$side.txt"
done
