"""The ctrl row converted with --untie and with --beta keep: convert's verification figures."""

import json
import tempfile
from pathlib import Path

from normswap.compat.rows import all_rows, build_original
from normswap.convert.pipeline import convert_checkpoint

KEYS = ("max_abs_diff", "noise_floor", "max_abs_diff_float64_source", "threshold", "passed")
(row,) = [r for r in all_rows() if r.name == "ctrl"]
d = Path(tempfile.mkdtemp(prefix="fast2ctrl"))
build_original(row, d / "o")
for opts in ({"untie": True}, {"beta": "keep"}):
    v = convert_checkpoint(str(d / "o"), str(d / ("c" + "".join(opts))), **opts)["verification"]
    print(opts, json.dumps({k: v.get(k) for k in KEYS}))
