"""The engines behind one interface (:class:`Engine`): FSDP1 (``FullyShardedDataParallel``) and FSDP2
(``fully_shard``), chosen by ``fsdp_version``, and DDP (``DistributedDataParallel``), which runs every layout with
nothing sharded (:func:`engine_for_layout`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch.nn import Module

from lightning_smp.config import check_fsdp_version
from lightning_smp.config.keys import FSDP_VERSION_ENGINES
from lightning_smp.degree import Layout
from lightning_smp.engines.base import Capabilities, Engine, ShardingFacts, ShardingPlan, StorageUnit
from lightning_smp.engines.ddp import engine as ddp
from lightning_smp.engines.ddp.engine import DDPEngine
from lightning_smp.engines.fsdp1.engine import FSDP1Engine
from lightning_smp.engines.fsdp2.engine import FSDP2Engine
from lightning_smp.engines.units import wrap_targets
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.names import NO_SHARD

#: The engines ``fsdp_version`` selects (:func:`register` adds one).
FSDP_ENGINES: list[Engine] = [FSDP1Engine(), FSDP2Engine()]
#: The engine of every layout with nothing sharded (where the arguments allow: :func:`engine_for_layout`).
DDP_ENGINE: Engine = DDPEngine()
#: Every engine, in the order a wrapped model is matched against them (a registered one first).
ENGINES: list[Engine] = [*FSDP_ENGINES, DDP_ENGINE]


def register(engine: Engine) -> Engine:
    """Make ``engine`` one of the engines (docs/architecture.md, "How to add an engine"): ``fsdp_version=<its
    version>`` selects it from every configuration source, :func:`engine_of` finds the models it wrapped (asked
    before the others, as it may recognise what one of them wraps too, being a subclass of it), and the planner, the
    memory report and every message that names an ``fsdp_version`` read its ``Capabilities`` and ``prediction``.
    Its ``has_wrapped`` must recognise only the models it wrapped: an engine that extends one of the library's
    (a subclass) marks what it wraps, or it would claim that engine's models too.
    Call it where every rank runs it (the training script, at import). Registering an engine of the same class again
    replaces it (a notebook cell run twice); a name or a version another engine has is refused."""
    if not isinstance(engine, Engine):
        raise TypeError(f"{engine!r} does not implement lightning_smp.engines.Engine (its four roles).")
    again = [other for other in ENGINES if type(other) is type(engine)]
    for other in ENGINES:
        if other not in again and (other.name == engine.name or other.version == engine.version):
            raise HybridShardConfigError(
                f"engine {engine.name!r} (fsdp_version={engine.version}) cannot be registered: engine {other.name!r}"
                f" has {'that name' if other.name == engine.name else 'that version'}. Fix: give it a name and a"
                f" version of its own (taken: {', '.join(f'{e.name} {e.version}' for e in ENGINES)})."
            )
    for other in again:
        unregister(other)
    FSDP_ENGINES.append(engine)
    ENGINES.insert(0, engine)
    FSDP_VERSION_ENGINES[engine.version] = f"the {engine.name} engine"
    return engine


def unregister(engine: Engine) -> None:
    """Undo :func:`register` (the library's own engines stay)."""
    if engine in _BUILT_IN:
        raise HybridShardConfigError(f"the {engine.name} engine is the library's own and stays registered.")
    FSDP_ENGINES.remove(engine)
    ENGINES.remove(engine)
    del FSDP_VERSION_ENGINES[engine.version]


_BUILT_IN = tuple(ENGINES)


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
    """The user's engine arguments as ``engine`` takes them: those another engine alone takes
    (``Capabilities.own_options``: DDP's ``find_unused_parameters``) set aside, as ``engine`` needs none of them."""
    others = {name for other in ENGINES if other is not engine for name in other.capabilities.own_options}
    return {k: v for k, v in options.items() if k not in others or k in engine.capabilities.own_options}


def selected_by(capable: Callable[[Capabilities], bool]) -> str:
    """How a user selects an engine whose capabilities ``capable`` accepts (for the fix a message names):
    ``fsdp_version=2``, ``fsdp_version=1 or fsdp_version=2``, or ``no fsdp_version`` when none does."""
    versions = [engine.version for engine in FSDP_ENGINES if capable(engine.capabilities)]
    return " or ".join(f"fsdp_version={version}" for version in versions) or "no fsdp_version"


def replica_sync_refusal(engine: Engine) -> str | None:
    """Why ``engine`` cannot run ``replica_sync`` (its ``Capabilities.replica_sync``), naming the ``fsdp_version``
    that can, or ``None`` where it can: the strategies' refusal when they are created, and the planner's reason to
    leave out a degree this engine would run."""
    if engine.capabilities.replica_sync:
        return None
    return (f"replica_sync does not run on the {engine.name} engine: the outer loop averages each rank's part of each"
            " parameter with the same part in the other groups, and its flat parameters are not cut per parameter."
            f" Fix: pass {selected_by(lambda capabilities: capabilities.replica_sync)}.")


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
    "Capabilities",
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
    "register",
    "replica_sync_refusal",
    "selected_by",
    "unregister",
    "wrap_targets",
]
