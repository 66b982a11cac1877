#!/usr/bin/env python3
"""Python calls per generated token (greedy, batch 1, `sys.setprofile`: frames entered) of each family's
tiny randomised model (tests/helpers.py, first test config) and of its exact conversion, loaded as users
load them: stock transformers (`from_pretrained(OUT, trust_remote_code=True)`) and `normswap.load_model`.
"before": the conversion on the stock path with its class answering `is_remote_code()` as transformers
does for a class loaded as remote code (what it did before), so transformers reads
`inspect.signature(self.forward)` every step. Counts, not time: deterministic on any machine.

    python bench/generate_calls.py [FAMILY ...] > calls.txt
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test suite's tiny models

import transformers  # noqa: E402
from helpers import family_variants, tiny_config, tiny_model  # noqa: E402
from test_generate_host_work import calls_per_token  # noqa: E402

from normswap import load_model  # noqa: E402
from normswap.convert.pipeline import convert_checkpoint  # noqa: E402


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", help="only these families (default: every one with a causal LM)")
    wanted = set(ap.parse_args(argv).families)
    auto = transformers.AutoModelForCausalLM
    print(f"{'family':<14} {'original':>9} {'converted, stock':>17} {'normswap':>9} {'before (stock)':>15}")
    with tempfile.TemporaryDirectory() as tmp:
        for family, variant in family_variants():
            if variant or (wanted and family not in wanted):
                continue
            if type(tiny_config(family, variant)) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
                continue
            src, out = Path(tmp) / family, Path(tmp) / f"{family}-converted"
            tiny_model(family, variant, task="causal-lm").save_pretrained(src)
            convert_checkpoint(str(src), str(out), verify=False)
            original = calls_per_token(auto.from_pretrained(str(src)))
            stock = auto.from_pretrained(str(out), trust_remote_code=True)
            after = calls_per_token(stock)
            ours = calls_per_token(load_model(str(out)))
            cls = type(stock)
            cls.is_remote_code = classmethod(lambda c: c._auto_class is not None)  # transformers' own answer
            before = calls_per_token(stock)
            print(f"{family:<14} {original:>9.0f} {after:>17.0f} {ours:>9.0f} {before:>15.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
