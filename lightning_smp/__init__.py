"""SageMaker SMP v2 hybrid sharded data parallelism for PyTorch Lightning, without SageMaker.

``import lightning_smp`` registers the Trainer strategy names ``"smp_hybrid"``, ``"smp_hybrid_zero2"`` and
``"smp_hybrid_notebook"``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_smp.__about__ import __version__
from lightning_smp.degree import Layout, resolve_layout, valid_degrees
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.mesh import MESH_AXES, REPLICATE_AXIS, SHARD_AXIS, build_device_mesh
from lightning_smp.precision import HybridShardPrecision
from lightning_smp.strategy import HybridShardFSDPStrategy

HybridShardFSDPStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "MESH_AXES",
    "REPLICATE_AXIS",
    "SHARD_AXIS",
    "HybridShardConfigError",
    "HybridShardFSDPStrategy",
    "HybridShardPrecision",
    "Layout",
    "__version__",
    "build_device_mesh",
    "resolve_layout",
    "valid_degrees",
]
