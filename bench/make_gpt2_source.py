#!/usr/bin/env python3
"""Write a GPT-2-small-shaped source checkpoint (random init from its config, no hub) for the
user-path recipe bench/gpt2-small-gpu.yaml: 12 layers, width 768, 12 heads, 1024 positions, with
the shipped kjv-gpt2 tokenizer (vocabulary 4096) so the embedded corpus can be evaluated offline.

    python bench/make_gpt2_source.py OUT_DIR            # GPT-2 small shape
    python bench/make_gpt2_source.py OUT_DIR --tiny     # 2 layers, width 64 (dry runs on CPU)
    python bench/make_gpt2_source.py OUT_DIR --layers 6 --width 384 --heads 6   # any other size
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from normswap.assets.models import GPT2_SMALL, GPT2_TINY, write_gpt2_shaped  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=None, help="another size: layers (with --width, --heads)")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    args = ap.parse_args(argv)
    shape = GPT2_TINY if args.tiny else GPT2_SMALL
    if args.layers:
        shape = dict(n_layer=args.layers, n_embd=args.width, n_head=args.heads, n_positions=1024)
    params = write_gpt2_shaped(args.out, shape)
    print(f"{args.out}: GPT-2 {shape}, {params / 1e6:.1f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
