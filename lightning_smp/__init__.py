"""SageMaker SMP v2 hybrid sharded data parallelism for PyTorch Lightning, without SageMaker.

``import lightning_smp`` registers the strategy names ``"smp_hybrid"``, ``"smp_hybrid_zero2"``,
``"smp_hybrid_notebook"`` and ``"smp_hybrid_fsdp2"``, for the Trainer and for Fabric
(:class:`lightning_smp.fabric.HybridShardFSDPStrategy`).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_smp.__about__ import __version__
from lightning_smp.accounting.report import count_communication, memory_report
from lightning_smp.callbacks import MemorySavingsCallback
from lightning_smp.config import SMPConfig, resolve_config
from lightning_smp.degree import Layout, resolve_layout, valid_degrees
from lightning_smp.errors import (
    CheckpointError,
    CheckpointPathError,
    GradientSyncError,
    HybridShardConfigError,
    LightningSMPError,
    ShardedParameterError,
    UnitOrderError,
    UnsupportedOptionError,
)
from lightning_smp.mesh import build_device_mesh
from lightning_smp.names import MESH_AXES, REPLICATE_AXIS, SHARD_AXIS
from lightning_smp.plain import init, is_initialized, shutdown
from lightning_smp.planner import Plan, plan
from lightning_smp.precision import HybridShardPrecision
from lightning_smp.strategy import HybridShardFSDPStrategy

from lightning_smp import fabric as _fabric  # isort: skip  # Fabric's strategy, registered below

HybridShardFSDPStrategy.register_strategies(StrategyRegistry)
_fabric.HybridShardFSDPStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "MESH_AXES",
    "REPLICATE_AXIS",
    "SHARD_AXIS",
    "CheckpointError",
    "CheckpointPathError",
    "GradientSyncError",
    "ShardedParameterError",
    "HybridShardConfigError",
    "HybridShardFSDPStrategy",
    "HybridShardPrecision",
    "Layout",
    "LightningSMPError",
    "MemorySavingsCallback",
    "Plan",
    "SMPConfig",
    "UnitOrderError",
    "UnsupportedOptionError",
    "__version__",
    "build_device_mesh",
    "count_communication",
    "init",
    "is_initialized",
    "memory_report",
    "plan",
    "resolve_config",
    "resolve_layout",
    "shutdown",
    "valid_degrees",
]
