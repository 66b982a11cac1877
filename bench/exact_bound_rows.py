#!/usr/bin/env python3
"""Convert's verification on every row the compat matrix converts exactly (tiny randomised originals,
built as the matrix builds them), causal LMs first; one JSON line a row: max |Δ| against the float32
source, the float64 exactness (converted weights computed in float64 vs the float64 source), the
source's float32 noise floor, the float32 drift from the float64 source, the threshold, the verdict
(normswap/convert/pass_rule.py).

    python bench/exact_bound_rows.py > rows.jsonl
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from normswap.compat.rows import all_rows, build_original, convert  # noqa: E402


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    rows = [r for r in all_rows() if r.exact]
    causal = [r for r in rows if "CausalLM" in r.class_name or "LMHead" in r.class_name]
    for row in causal + [r for r in rows if r not in causal]:
        d = Path(tempfile.mkdtemp(prefix="exact-bound-"))
        try:
            build_original(row, d / "o")
            v = convert(d / "o", d / "c", pooled=row.pooled)["verification"]
            line = {
                "row": row.name,
                "class": row.class_name,
                "metric": v.get("metric"),
                "max_abs_diff": v["max_abs_diff"],
                "exact_float64": v.get("exact_float64"),
                "noise_floor": v.get("noise_floor"),
                "drift_float32": v.get("drift_float32"),
                "threshold": v["threshold"],
                "passed": v["passed"],
            }
        except Exception as e:  # a row this transformers cannot build, or a refused conversion: recorded
            line = {"row": row.name, "error": str(e)[:300]}
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
