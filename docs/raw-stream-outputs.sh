#!/usr/bin/env bash
# Regenerates docs/raw-stream-outputs.{md,json}: for each architecture the committed survey refuses because
# its raw residual stream leaves the model, which outputs an exact conversion keeps (tiny instances); the same
# rows go into the package (normswap/architectures/data/raw_stream_outputs.json: the matrix's pooled-exact rows).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 - <<'PY'
import json
from pathlib import Path

from normswap.architectures.survey import declared_outputs_markdown, declared_outputs_one, raw_stream_refusals
from normswap.convert.inplace import convert_tiny

rows = []
for model_type in raw_stream_refusals():
    rows.append(declared_outputs_one(model_type, convert=convert_tiny))
    print(model_type, rows[-1]["status"], rows[-1].get("exact_outputs"), flush=True)
for path in ("docs/raw-stream-outputs.json", "normswap/architectures/data/raw_stream_outputs.json"):
    Path(path).write_text(json.dumps(rows, indent=1) + "\n")
Path("docs/raw-stream-outputs.md").write_text(declared_outputs_markdown(rows, "bash docs/raw-stream-outputs.sh"))
PY
