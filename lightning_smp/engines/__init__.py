"""FSDP engines behind one interface (:class:`Engine`): today FSDP1 (``FullyShardedDataParallel``)."""

from __future__ import annotations

from torch.nn import Module

from lightning_smp.engines.base import Engine, ShardingFacts, ShardingPlan, StorageUnit
from lightning_smp.engines.fsdp1 import FSDP1Engine

#: Every engine, in the order a wrapped model is matched against them.
ENGINES: tuple[Engine, ...] = (FSDP1Engine(),)


def engine_of(model: Module) -> Engine | None:
    """The engine that sharded ``model``, or ``None`` for a plain or DDP model."""
    return next((engine for engine in ENGINES if engine.is_sharded(model)), None)


__all__ = ["ENGINES", "Engine", "FSDP1Engine", "ShardingFacts", "ShardingPlan", "StorageUnit", "engine_of"]
