"""Why normswap:kjv-gpt2's perplexity reads differently in different places: the same model scored
on the different texts each place uses (README "Shipped models and data" quotes this output).

    python bench/kjv_perplexity_figures.py > results/kjv-perplexity-figures-20261201T1634Z/kjv-perplexity-figures.txt

Nothing is timed. Scored: the whole validation and test splits with normswap's evaluation
(128-token windows, stride 128 and 64), and the fine-tune's held-out set (the first N tokens of the
validation split in 128-token blocks, as `normswap finetune --eval-tokens N` scores it) for the
original model and for its approximate conversion with β dropped (the demo fine-tune's starting
point).
"""

from __future__ import annotations

import math

import torch

import normswap
from normswap.convert import convert_model
from normswap.data import load_text
from normswap.evaluate.perplexity import perplexity
from normswap.finetune.batches import eval_blocks
from normswap.finetune.objectives import heldout_loss

MODEL = "normswap:kjv-gpt2"


def main(argv=None) -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(1)
    model, tok = normswap.load_model(MODEL), normswap.load_tokenizer(MODEL)
    print(f"{MODEL}, normswap {normswap.__version__}, torch {torch.__version__}")
    for split in ("validation", "test"):
        text = load_text("embedded", split)
        for stride in (128, 64):
            p = perplexity(model, tok, text, seq_len=128, stride=stride)
            print(
                f"whole {split} split ({p.tokens:,} tokens), seq_len 128, stride {stride}: "
                f"perplexity {p.perplexity:.2f}"
            )
    approx = normswap.load_model(MODEL)
    convert_model(approx, mode="approx", beta="drop")
    for n in (4096, 16384):
        blocks = eval_blocks(tok, "embedded", 128, n, split="validation")
        for name, m in (("original", model), ("approx, beta dropped", approx)):
            print(
                f"first {n:,} validation tokens (finetune --eval-tokens {n}), {name}: perplexity "
                f"{math.exp(heldout_loss(m, blocks)):.2f}"
            )


if __name__ == "__main__":
    main()
