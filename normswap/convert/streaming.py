"""Streaming conversion (tensor by tensor, shard by shard). Not implemented yet: in-memory only."""

from normswap.errors import NormswapError


def should_stream(resolved, local, requested) -> bool:
    if requested:
        raise NormswapError("--streaming is not available in this build yet")
    return False
