"""FSDP engines behind one interface (:class:`Engine`): FSDP1 (``FullyShardedDataParallel``) and FSDP2
(``fully_shard``)."""

from __future__ import annotations

from typing import Any

from torch.nn import Module

from lightning_smp.config import check_fsdp_version
from lightning_smp.engines.base import Engine, ShardingFacts, ShardingPlan, StorageUnit
from lightning_smp.engines.fsdp1 import FSDP1Engine
from lightning_smp.engines.fsdp2 import FSDP2Engine, wrap_targets

#: Every engine, in the order a wrapped model is matched against them.
ENGINES: tuple[Engine, ...] = (FSDP1Engine(), FSDP2Engine())


def engine_of(model: Module) -> Engine | None:
    """The engine that sharded ``model``, or ``None`` for a plain or DDP model."""
    return next((engine for engine in ENGINES if engine.is_sharded(model)), None)


def own_offload_config(value: Any) -> bool:
    """Whether ``value`` is FSDP2's own offload config (an ``OffloadPolicy``), kept as the user gave it: Lightning's
    ``FSDPStrategy`` would turn it into FSDP1's ``CPUOffload`` and lose its settings."""
    from torch.distributed.fsdp import OffloadPolicy

    return isinstance(value, OffloadPolicy)


def offloads_parameters(value: Any) -> bool:
    """Whether a ``cpu_offload`` argument (``True``, FSDP1's ``CPUOffload``, FSDP2's ``CPUOffloadPolicy``) keeps the
    parameters on the CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return value is True or bool(getattr(value, "offload_params", False)) or isinstance(value, CPUOffloadPolicy)


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
    "offloads_parameters",
    "own_offload_config",
    "wrap_targets",
]
