"""FSDP engines behind one interface (:class:`Engine`): FSDP1 (``FullyShardedDataParallel``) and FSDP2
(``fully_shard``)."""

from __future__ import annotations

from torch.nn import Module

from lightning_smp.config import check_fsdp_version
from lightning_smp.engines.base import Engine, ShardingFacts, ShardingPlan, StorageUnit
from lightning_smp.engines.fsdp1 import FSDP1Engine
from lightning_smp.engines.fsdp2 import FSDP2Engine

#: Every engine, in the order a wrapped model is matched against them.
ENGINES: tuple[Engine, ...] = (FSDP1Engine(), FSDP2Engine())


def engine_of(model: Module) -> Engine | None:
    """The engine that sharded ``model``, or ``None`` for a plain or DDP model."""
    return next((engine for engine in ENGINES if engine.is_sharded(model)), None)


def engine_for(version: int) -> Engine:
    """The engine of ``fsdp_version=version``."""
    version = check_fsdp_version(version)
    return next(engine for engine in ENGINES if engine.version == version)


__all__ = [
    "ENGINES",
    "Engine",
    "FSDP1Engine",
    "FSDP2Engine",
    "ShardingFacts",
    "ShardingPlan",
    "StorageUnit",
    "check_fsdp_version",
    "engine_for",
    "engine_of",
]
