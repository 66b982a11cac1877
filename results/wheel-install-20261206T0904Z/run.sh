#!/bin/bash
# normswap from a non-editable wheel, run from outside the checkout: every command's --help,
# `bench kernels --quick` and `bench convert` at its smallest setting must exit 0.
# usage: bash run.sh CHECKOUT   (writes the transcript to stdout)
set -u
CHECKOUT=$(cd "${1:?checkout}" && pwd)
WORK=$(mktemp -d)
pip wheel -q --no-deps --no-build-isolation -w "$WORK/wheel" "$CHECKOUT" 2>/dev/null
pip install -q --no-deps --target "$WORK/target" "$WORK"/wheel/*.whl 2>/dev/null
cd "$WORK"   # outside the checkout
export PYTHONPATH="$WORK/target" NORMSWAP_CACHE_DIR="$WORK/cache"
fail=0
run() { echo "\$ normswap $*"; python -m normswap "$@" > out.txt 2>&1; rc=$?; tail -n 4 out.txt; echo "exit $rc"; [ $rc = 0 ] || fail=1; }
echo "normswap imported from: $(python -c 'import normswap; print(normswap.__file__)')"
run --help
for c in $(python -c 'from normswap.cli.main import COMMANDS; print(" ".join(sorted(COMMANDS)))'); do run "$c" --help; done
for c in convert decode kernels onnx; do run bench "$c" --help; done
for c in ppl render report speed tasks-path; do run eval "$c" --help; done
run bench kernels --quick --device cpu --no-tiny --modes fwd
mkdir -p "$WORK/bc"; run bench convert --family gpt2 --params 2e7 --rounds 1 --workdir "$WORK/bc"
echo "all exit 0: $([ $fail = 0 ] && echo yes || echo no)"
rm -rf "$WORK"
exit $fail
