"""Evaluation: perplexity, speed/memory, training diagnostics, lm-eval tasks (see runner.py)."""

from normswap.evaluate.perplexity import PerplexityResult, document_perplexity, perplexity, window_plan

__all__ = ["PerplexityResult", "document_perplexity", "perplexity", "window_plan"]
