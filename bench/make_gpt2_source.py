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
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from normswap.assets.models import MODELS_DIR  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=None, help="another size: layers (with --width, --heads)")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    args = ap.parse_args(argv)
    from transformers import GPT2Config, GPT2LMHeadModel

    tok_dir = MODELS_DIR / "kjv-gpt2"
    shape = (
        dict(n_layer=2, n_embd=64, n_head=4, n_positions=128)
        if args.tiny
        else dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
    )
    if args.layers:
        shape = dict(n_layer=args.layers, n_embd=args.width, n_head=args.heads, n_positions=1024)
    config = GPT2Config(vocab_size=4096, bos_token_id=0, eos_token_id=0, pad_token_id=0, **shape)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, out / name)
    print(f"{out}: GPT-2 {shape}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
