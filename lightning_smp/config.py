"""Where ``hybrid_shard_degree`` comes from when the strategy is not given one explicitly."""

from __future__ import annotations

_ACTIVE: dict = {}


def configured_degree() -> int:
    """The degree set by :func:`lightning_smp.init`, else 0 (native FSDP behaviour)."""
    return int(_ACTIVE.get("hybrid_shard_degree", 0))
