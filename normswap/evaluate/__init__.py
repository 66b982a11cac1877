"""Evaluation: perplexity, speed/memory, training diagnostics, lm-eval tasks (see side_by_side.py).

The package imports nothing itself (import from the modules, e.g. normswap.evaluate.perplexity),
so that `normswap eval tasks-path` and the hub check read lm_eval_adapter without paying for torch.
"""
