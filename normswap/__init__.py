"""normswap: LayerNorm -> fused RMSNorm migration for Hugging Face checkpoints."""

from normswap.version import __version__

__all__ = ["__version__", "load_model", "load_tokenizer"]


def load_model(spec, **kwargs):
    """Load any model normswap accepts (local dir, hub id, ``normswap:NAME``, converted output)."""
    from normswap.checkpoint.load import load_model as _load

    return _load(spec, **kwargs)


def load_tokenizer(spec, **kwargs):
    from normswap.checkpoint.load import load_tokenizer as _load

    return _load(spec, **kwargs)
