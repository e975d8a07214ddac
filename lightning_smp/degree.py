"""SMP v2 semantics of ``hybrid_shard_degree``, as pure functions (no processes, no torch).

The contract (SageMaker SMP v2, "hybrid sharded data parallelism"):

======================  ==========================================================================
``hybrid_shard_degree``  what runs
======================  ==========================================================================
``0`` (default)          native FSDP: ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2`` shard inside one node
                         and replicate across nodes; ``FULL_SHARD`` / ``SHARD_GRAD_OP`` shard over all
                         ranks; ``NO_SHARD`` replicates everywhere.
``1``                    no sharding: every rank holds a full replica, synchronised like DDP.
``d >= 2``               shard groups of ``d`` consecutive ranks, ``world_size / d`` replicas;
                         ``HYBRID_SHARD`` unless ``_HYBRID_SHARD_ZERO2`` was chosen.
======================  ==========================================================================

A layout whose shard group is the whole world runs ``FULL_SHARD`` (``SHARD_GRAD_OP`` for ZeRO-2) so
that no all-reduce over size-1 replica groups is issued; a layout whose shard group is one rank runs
``NO_SHARD`` over the whole world, which is what keeps replicas synchronised.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

from lightning_smp.errors import HybridShardConfigError
from lightning_smp.names import (
    AUTO,
    FULL_SHARD,
    HYBRID_SHARD,
    HYBRID_SHARD_ZERO2,
    HYBRID_STRATEGIES,
    NO_SHARD,
    SHARD_GRAD_OP,
    SHARDING_STRATEGIES,
    ShardingStrategyName,
)

#: Which part of the ``(replicate, shard)`` mesh FSDP receives.
FSDPAxis = Literal["both", "shard", "replicate"]


def check_degree(value: Any, parameter: str = "hybrid_shard_degree") -> int:
    """Return ``value`` as an ``int`` if it is a valid degree on its own (no world size needed).

    Raises:
        HybridShardConfigError: for booleans, non-integers and negative numbers.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise HybridShardConfigError(
            f"{parameter}={value!r} ({type(value).__name__}) is not an integer. Fix: pass a whole number, 0 for"
            " native FSDP behaviour, 1 for no sharding, or the number of ranks in a shard group (>= 2)."
        )
    if value < 0:
        raise HybridShardConfigError(
            f"{parameter}={value} is negative. Fix: pass 0 for native FSDP behaviour, 1 for no sharding,"
            " or the number of ranks in a shard group (>= 2)."
        )
    return int(value)


def check_degree_setting(value: Any, parameter: str = "hybrid_shard_degree") -> int | str:
    """A degree as it may be configured: :func:`check_degree`'s, or ``"auto"`` (any case) for the planner's choice."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    if isinstance(value, str):
        raise HybridShardConfigError(
            f"{parameter}={value!r} (str) is not a degree. Fix: pass a whole number (0 native FSDP, 1 no sharding,"
            " >= 2 the ranks of a shard group) or 'auto' to let the planner choose from the memory budget."
        )
    return check_degree(value, parameter)


def check_sharding_strategy(value: Any, parameter: str = "sharding_strategy") -> ShardingStrategyName:
    """Normalise a sharding strategy given as a string (any case) or a ``ShardingStrategy`` member."""
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.upper() in SHARDING_STRATEGIES:
        return cast(ShardingStrategyName, name.upper())
    raise HybridShardConfigError(
        f"{parameter}={value!r} is not a sharding strategy. Valid values: {', '.join(SHARDING_STRATEGIES)}."
    )


def valid_degrees(world_size: int) -> list[int]:
    """The degrees that are legal for ``world_size`` ranks: 0 (native) and every divisor."""
    return [0] + [d for d in range(1, world_size + 1) if world_size % d == 0]


@dataclass(frozen=True)
class Layout:
    """How ``world_size`` ranks are split into shard groups and replicas, and what FSDP runs."""

    world_size: int
    degree: int
    replicate: int
    shard: int
    requested_strategy: ShardingStrategyName
    sharding_strategy: ShardingStrategyName

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """Shape of the 2-D mesh ``(replicate, shard)``."""
        return (self.replicate, self.shard)

    @property
    def fsdp_axis(self) -> FSDPAxis:
        """The mesh FSDP is given: both axes for hybrid sharding, else the 1-D axis it shards or replicates over."""
        if self.sharding_strategy in HYBRID_STRATEGIES:
            return "both"
        if self.sharding_strategy == NO_SHARD:
            return "replicate"
        return "shard"

    @property
    def overridden(self) -> bool:
        """Whether a degree >= 2 replaced the user's non-hybrid sharding strategy (SMP's override rule)."""
        return self.degree >= 2 and self.requested_strategy not in HYBRID_STRATEGIES

    def override_message(self) -> str:
        """The warning for :attr:`overridden`, naming both strategies."""
        return (
            f"hybrid_shard_degree={self.degree} overrides sharding_strategy={self.requested_strategy}:"
            f" FSDP runs {self.sharding_strategy} (SMP semantics: a degree >= 2 means hybrid sharding;"
            " choose _HYBRID_SHARD_ZERO2 for the ZeRO-2 flavour)."
        )

    def shard_group(self, rank: int) -> list[int]:
        """Global ranks that shard the model together with ``rank`` (consecutive ranks)."""
        start = (rank // self.shard) * self.shard
        return list(range(start, start + self.shard))

    def replicate_group(self, rank: int) -> list[int]:
        """Global ranks that hold the same shard as ``rank``, one per replica."""
        return list(range(rank % self.shard, self.world_size, self.shard))

    def given(self) -> str:
        """The degree as the user gave it and, where SMP's rules made the shard group another size, that size and
        the rule (for messages: a user who gave 0 never wrote the size it resolved to)."""
        if self.degree == self.shard:
            return f"hybrid_shard_degree={self.degree}"
        if self.requested_strategy in HYBRID_STRATEGIES:
            rule = f"0 with {self.requested_strategy} shards inside each node, and a node here has {self.shard} rank(s)"
        elif self.requested_strategy == NO_SHARD:
            rule = f"0 with {NO_SHARD} shards nothing"
        else:
            rule = f"0 with {self.requested_strategy} shards over all {self.world_size} rank(s)"
        return f"hybrid_shard_degree={self.degree}, which resolves to {self.shard} (native FSDP rules: {rule})"

    def describe(self) -> str:
        """One line for logs: the degree, the mesh and what FSDP runs."""
        return (
            f"hybrid_shard_degree={self.degree}: {self.replicate} replica(s) x {self.shard} shard(s) over"
            f" {self.world_size} rank(s), FSDP sharding_strategy={self.sharding_strategy}"
        )


def resolve_layout(
    world_size: int,
    hybrid_shard_degree: int,
    sharding_strategy: Any = HYBRID_SHARD,
    devices_per_node: int | None = None,
) -> Layout:
    """Apply SMP's rules for ``hybrid_shard_degree`` to a world of ``world_size`` ranks.

    Args:
        world_size: number of ranks (``num_nodes * devices``), at least 1.
        hybrid_shard_degree: 0 (native), 1 (no sharding) or the size of a shard group; must divide ``world_size``.
        sharding_strategy: what the user asked FSDP for (string or ``ShardingStrategy``).
        devices_per_node: ranks per node; the shard group of native hybrid sharding (degree 0).
            Defaults to ``world_size`` (one node).

    Raises:
        HybridShardConfigError: the degree is not valid for this world size.
    """
    degree = check_degree(hybrid_shard_degree)
    requested = check_sharding_strategy(sharding_strategy)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise HybridShardConfigError(f"world_size={world_size!r} must be a positive integer.")
    valid = ", ".join(str(d) for d in valid_degrees(world_size))
    if degree > world_size:
        raise HybridShardConfigError(
            f"hybrid_shard_degree={degree} is larger than world_size={world_size} (num_nodes x devices)."
            f" Valid degrees for this world size: {valid}. Fix: lower hybrid_shard_degree or add devices/nodes."
        )
    if degree and world_size % degree:
        raise HybridShardConfigError(
            f"hybrid_shard_degree={degree} does not divide world_size={world_size} (num_nodes x devices)."
            f" Valid degrees for this world size: {valid}. Fix: pick one of them or change devices/num_nodes."
        )

    zero2 = requested in (HYBRID_SHARD_ZERO2, SHARD_GRAD_OP)
    if degree == 0:
        if requested in HYBRID_STRATEGIES:
            shard = devices_per_node or world_size
            if world_size % shard:
                raise HybridShardConfigError(
                    f"devices_per_node={shard} does not divide world_size={world_size}; native hybrid sharding"
                    " needs the same number of devices on every node."
                )
        else:
            shard = 1 if requested == NO_SHARD else world_size
    else:
        shard = degree
        # SMP forces HYBRID_SHARD for degree >= 2 unless the user chose _HYBRID_SHARD_ZERO2.
        zero2 = requested == HYBRID_SHARD_ZERO2

    effective: ShardingStrategyName
    if shard == 1:
        effective = NO_SHARD
    elif shard == world_size:
        effective = SHARD_GRAD_OP if zero2 else FULL_SHARD
    else:
        effective = HYBRID_SHARD_ZERO2 if zero2 else HYBRID_SHARD
    return Layout(
        world_size=world_size,
        degree=degree,
        replicate=world_size // shard,
        shard=shard,
        requested_strategy=requested,
        sharding_strategy=effective,
    )


def reconcile_degree(source: str, implied: int | None, degree: int | None) -> int | None:
    """Merge the shard degree implied by ``source`` (a ``device_mesh`` or ``process_group``) with
    ``hybrid_shard_degree``; ``None`` means "not given"."""
    if implied is None:
        return degree
    if degree not in (None, 0, implied):
        raise HybridShardConfigError(
            f"hybrid_shard_degree={degree} contradicts {source}, whose shard group has {implied} rank(s)."
            f" Fix: pass only one of them, or make them agree (hybrid_shard_degree={implied})."
        )
    return implied


def resolve_strategy_layout(
    num_nodes: int,
    devices: int,
    hybrid_shard_degree: int,
    sharding_strategy: Any,
    mesh_shape: tuple[int, ...] | None = None,
    user_mesh: bool = False,
) -> Layout:
    """The layout a strategy runs on ``num_nodes x devices`` ranks (:func:`resolve_layout` with devices per node).

    ``mesh_shape`` is the shape of a ``device_mesh`` the user gave (a tuple or a ``DeviceMesh``); it must match.
    A ``DeviceMesh`` of the user's own (``user_mesh``) is handed to FSDP as it is, which needs a hybrid strategy.

    Raises:
        HybridShardConfigError: the degree does not fit the world, or the given mesh shape does not.
    """
    world_size = num_nodes * devices
    layout = resolve_layout(world_size, hybrid_shard_degree, sharding_strategy, devices_per_node=devices)
    if user_mesh and layout.sharding_strategy not in HYBRID_STRATEGIES:
        hybrid = HYBRID_SHARD_ZERO2 if "ZERO2" in layout.requested_strategy else HYBRID_SHARD
        layout = replace(layout, sharding_strategy=hybrid)
    if mesh_shape is not None and tuple(mesh_shape) != layout.mesh_shape:
        raise HybridShardConfigError(
            f"device_mesh of shape {tuple(mesh_shape)} does not fit world_size={world_size}"
            f" (num_nodes={num_nodes} x devices={devices}). Fix: use shape"
            f" {layout.mesh_shape} or pass hybrid_shard_degree instead."
        )
    return layout
