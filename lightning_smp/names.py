"""The library's vocabulary, each name defined once: mesh axes, sharding strategies, start methods, checkpoint
formats, FSDP engines and the registered strategy names.

Every option is a ``Literal`` (for signatures and type checkers) with its values read back by ``typing.get_args``
(for validation, messages and tests), so a value cannot be spelled two ways.
"""

from __future__ import annotations

from typing import Any, Final, Literal, get_args

#: The axes of the 2-D ``DeviceMesh``: outer across replicas, inner inside a shard group (consecutive ranks).
MeshAxis = Literal["replicate", "shard"]
MESH_AXES: Final[tuple[MeshAxis, ...]] = get_args(MeshAxis)
REPLICATE_AXIS: Final[MeshAxis] = "replicate"
SHARD_AXIS: Final[MeshAxis] = "shard"
#: Collectives on a process group that is neither axis (e.g. Lightning's own world-group reductions).
OTHER_AXIS: Final = "other"

#: FSDP sharding strategies, by ``torch.distributed.fsdp.ShardingStrategy`` member name.
ShardingStrategyName = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
SHARDING_STRATEGIES: Final[tuple[ShardingStrategyName, ...]] = get_args(ShardingStrategyName)
FULL_SHARD: Final[ShardingStrategyName] = "FULL_SHARD"
SHARD_GRAD_OP: Final[ShardingStrategyName] = "SHARD_GRAD_OP"
NO_SHARD: Final[ShardingStrategyName] = "NO_SHARD"
HYBRID_SHARD: Final[ShardingStrategyName] = "HYBRID_SHARD"
HYBRID_SHARD_ZERO2: Final[ShardingStrategyName] = "_HYBRID_SHARD_ZERO2"
HYBRID_STRATEGIES: Final[tuple[ShardingStrategyName, ...]] = (HYBRID_SHARD, HYBRID_SHARD_ZERO2)

#: The ``multiprocessing`` start methods, what Lightning's multiprocessing launcher takes.
ProcessStartMethod = Literal["fork", "spawn", "forkserver"]
#: How the ranks are started: ``popen`` re-runs the script per rank (Lightning's FSDP default), the others are
#: ``multiprocessing`` start methods (``fork`` is what notebooks need).
StartMethod = Literal["popen", ProcessStartMethod]
START_METHODS: Final[tuple[StartMethod, ...]] = get_args(StartMethod)

#: Checkpoint formats: a ``torch.distributed.checkpoint`` folder, or one ``torch.save`` file.
StateDictType = Literal["sharded", "full"]
STATE_DICT_TYPES: Final[tuple[StateDictType, ...]] = get_args(StateDictType)
SHARDED: Final[StateDictType] = "sharded"
FULL: Final[StateDictType] = "full"

#: The FSDP implementations a model can be sharded with: 1 is ``FullyShardedDataParallel`` (flat parameters), 2 is
#: ``fully_shard`` (per-parameter ``DTensor`` shards).
FSDPVersion = Literal[1, 2]
FSDP_VERSIONS: Final[tuple[FSDPVersion, ...]] = get_args(FSDPVersion)

#: ``hybrid_shard_degree="auto"``: the planner (:mod:`lightning_smp.planner`) chooses the degree from the real model,
#: the world size and the memory budget, when the model is set up.
AUTO: Final = "auto"

#: What the micro-batches of gradient accumulation before the last one communicate (each mode is described once, in
#: :mod:`lightning_smp.accumulation`).
GradientAccumulation = Literal["no_sync", "every_micro_batch", "defer_all_reduce"]
GRADIENT_ACCUMULATIONS: Final[tuple[GradientAccumulation, ...]] = get_args(GradientAccumulation)
NO_SYNC: Final[GradientAccumulation] = "no_sync"
EVERY_MICRO_BATCH: Final[GradientAccumulation] = "every_micro_batch"
DEFER_ALL_REDUCE: Final[GradientAccumulation] = "defer_all_reduce"

#: Where ``replica_sync``'s outer loop keeps its copies (its ``backup``): beside the parameters, or in host memory.
ReplicaSyncBackup = Literal["device", "cpu"]
REPLICA_SYNC_BACKUPS: Final[tuple[ReplicaSyncBackup, ...]] = get_args(ReplicaSyncBackup)
BACKUP_DEVICE: Final[ReplicaSyncBackup] = "device"
BACKUP_CPU: Final[ReplicaSyncBackup] = "cpu"

#: ``replica_sync``'s outer optimizer when its keys are not given (its ``outer``): the groups' mean (outer SGD lr 1, no
#: momentum: plain parameter averaging, which keeps synchronous quality at short windows), or the DiLoCo paper's
#: Nesterov SGD (lr 0.7, momentum 0.9).
ReplicaSyncOuter = Literal["average", "nesterov"]
REPLICA_SYNC_OUTERS: Final[tuple[ReplicaSyncOuter, ...]] = get_args(ReplicaSyncOuter)
OUTER_AVERAGE: Final[ReplicaSyncOuter] = "average"
OUTER_NESTEROV: Final[ReplicaSyncOuter] = "nesterov"

#: How ``replica_sync``'s pseudo-gradients cross the groups (its ``compress``): float32 as trained, bfloat16, or 8 or
#: 4 bits per value with a float32 scale per block (:mod:`lightning_smp.replica_sync.compress`).
ReplicaSyncCompression = Literal["none", "bf16", "int8", "int4"]
REPLICA_SYNC_COMPRESSIONS: Final[tuple[ReplicaSyncCompression, ...]] = get_args(ReplicaSyncCompression)
COMPRESS_NONE: Final[ReplicaSyncCompression] = "none"

#: The front ends, each where an option can act: Lightning's Trainer strategy, Fabric's, and ``lightning_smp.init()``
#: (plain PyTorch ``FSDP(...)``/``fully_shard`` calls). An option declares those it acts in; the others refuse it.
FrontEndName = Literal["trainer", "fabric", "init"]
FRONT_ENDS: Final[tuple[FrontEndName, ...]] = get_args(FrontEndName)

#: Where an option acts, part of its declaration (``config.options.option``, ``config.keys.smp_key``): ``layout``
#: (the core settles the layout, the mesh and the engine from it), ``engines`` (every engine reads it from the
#: ``ShardingPlan``, a field of the option's name that the core fills from the declaration), ``planner`` (what
#: ``hybrid_shard_degree="auto"`` chooses with), ``checkpoint`` (how checkpoints are written), ``front_ends`` (the
#: strategies' own steps and hooks, and what they hand an engine's training calls each step).
ActsIn = Literal["layout", "engines", "planner", "checkpoint", "front_ends"]
ACTS_IN: Final[tuple[ActsIn, ...]] = get_args(ActsIn)

#: Names registered in Lightning's strategy registry on ``import lightning_smp``: (name, description, init args).
STRATEGY_NAMES: Final[tuple[tuple[str, str, dict[str, Any]], ...]] = (
    ("smp_hybrid", "SMP-style hybrid sharded data parallelism (FSDP HYBRID_SHARD)", {"sharding_strategy": HYBRID_SHARD}),
    (
        "smp_hybrid_zero2",
        "SMP-style hybrid sharded data parallelism, ZeRO-2 flavour (FSDP _HYBRID_SHARD_ZERO2)",
        {"sharding_strategy": HYBRID_SHARD_ZERO2},
    ),
    (
        "smp_hybrid_notebook",
        "SMP-style hybrid sharding launched by fork, for Jupyter notebooks",
        {"sharding_strategy": HYBRID_SHARD, "start_method": "fork"},
    ),
    (
        "smp_hybrid_fsdp2",
        "SMP-style hybrid sharded data parallelism on FSDP2 (fully_shard), accumulation with sharded gradients",
        {"sharding_strategy": HYBRID_SHARD, "fsdp_version": 2},
    ),
)

__all__ = [
    "ACTS_IN",
    "AUTO",
    "BACKUP_CPU",
    "COMPRESS_NONE",
    "BACKUP_DEVICE",
    "OUTER_AVERAGE",
    "OUTER_NESTEROV",
    "REPLICA_SYNC_BACKUPS",
    "REPLICA_SYNC_COMPRESSIONS",
    "REPLICA_SYNC_OUTERS",
    "ReplicaSyncCompression",
    "ReplicaSyncOuter",
    "ReplicaSyncBackup",
    "DEFER_ALL_REDUCE",
    "EVERY_MICRO_BATCH",
    "FRONT_ENDS",
    "FSDP_VERSIONS",
    "FULL",
    "GRADIENT_ACCUMULATIONS",
    "NO_SYNC",
    "FSDPVersion",
    "FrontEndName",
    "ActsIn",
    "GradientAccumulation",
    "FULL_SHARD",
    "HYBRID_SHARD",
    "HYBRID_SHARD_ZERO2",
    "HYBRID_STRATEGIES",
    "MESH_AXES",
    "NO_SHARD",
    "OTHER_AXIS",
    "REPLICATE_AXIS",
    "SHARDED",
    "SHARDING_STRATEGIES",
    "SHARD_AXIS",
    "SHARD_GRAD_OP",
    "START_METHODS",
    "STATE_DICT_TYPES",
    "STRATEGY_NAMES",
    "MeshAxis",
    "ProcessStartMethod",
    "ShardingStrategyName",
    "StartMethod",
    "StateDictType",
]
