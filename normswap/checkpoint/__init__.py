"""Checkpoint I/O: resolve a model spec, load it, write normswap's checkpoint format atomically."""
