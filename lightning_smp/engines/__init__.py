"""The engines behind one interface (:class:`Engine`): FSDP1 (``FullyShardedDataParallel``) and FSDP2
(``fully_shard``), chosen by ``fsdp_version``, and DDP (``DistributedDataParallel``), which runs every layout with
nothing sharded (:func:`engine_for_layout`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.nn import Module

from lightning_smp.config import check_fsdp_version
from lightning_smp.degree import Layout
from lightning_smp.engines.base import Engine, ShardingFacts, ShardingPlan, StorageUnit
from lightning_smp.engines.ddp import engine as ddp
from lightning_smp.engines.ddp.engine import DDPEngine
from lightning_smp.engines.fsdp1.engine import FSDP1Engine
from lightning_smp.engines.fsdp2.engine import FSDP2Engine
from lightning_smp.engines.fsdp2.wrap import wrap_targets
from lightning_smp.names import NO_SHARD

#: The engines ``fsdp_version`` selects.
FSDP_ENGINES: tuple[Engine, ...] = (FSDP1Engine(), FSDP2Engine())
#: The engine of every layout with nothing sharded (where the arguments allow: :func:`engine_for_layout`).
DDP_ENGINE: Engine = DDPEngine()
#: Every engine, in the order a wrapped model is matched against them.
ENGINES: tuple[Engine, ...] = (*FSDP_ENGINES, DDP_ENGINE)


def engine_of(model: Module) -> Engine | None:
    """The engine that sharded ``model``, or ``None`` for a plain or DDP model."""
    return next((engine for engine in ENGINES if engine.has_wrapped(model)), None)


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
    return next(engine for engine in FSDP_ENGINES if engine.version == version)


def options_for(engine: Engine, options: Mapping[str, Any]) -> dict[str, Any]:
    """The user's engine arguments as ``engine`` takes them: DDP's own (:data:`.ddp.DDP_ONLY_OPTIONS`) set aside for
    the FSDP engines, which need none of them."""
    return {k: v for k, v in options.items() if engine is DDP_ENGINE or k not in ddp.DDP_ONLY_OPTIONS}


def engine_for_layout(version: int, layout: Layout | None, *, options: Mapping[str, Any] | None = None,
                      mixed_precision: Any = None, cpu_offload: Any = None) -> Engine:
    """The engine that runs ``layout``: the DDP engine when nothing is sharded (a shard group of one rank, or
    ``NO_SHARD``: degree 1, degree 0 with one rank per node, one rank in all) and the arguments ask for nothing that
    only FSDP does (:func:`.ddp.takes`); else the engine of ``fsdp_version=version``. ``None`` (the layout not known
    yet, ``"auto"``): the engine of ``version``."""
    unsharded = layout is not None and (layout.shard == 1 or layout.sharding_strategy == NO_SHARD)
    if unsharded and ddp.takes(options or {}, mixed_precision, cpu_offload):
        return DDP_ENGINE
    return engine_for(version)


__all__ = [
    "DDP_ENGINE",
    "ENGINES",
    "FSDP_ENGINES",
    "DDPEngine",
    "Engine",
    "FSDP1Engine",
    "FSDP2Engine",
    "ShardingFacts",
    "ShardingPlan",
    "StorageUnit",
    "check_fsdp_version",
    "engine_for",
    "engine_for_layout",
    "engine_of",
    "offloads_parameters",
    "options_for",
    "own_offload_config",
    "wrap_targets",
]
