"""Model and optimizer state dicts of a sharded model: full (assembled once) or sharded (this rank's DTensors).

Every function takes a :class:`ShardedModel`: the wrapped model, its engine, its mesh and a collectives handle,
so the Trainer strategy and other front ends share them. Sharded state dicts use
``torch.distributed.checkpoint.state_dict``, which works for every engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.collectives import Collectives
from lightning_smp.engines.base import StateDicts
from lightning_smp.mesh import axis_group, group_ranks, shard_group_of
from lightning_smp.names import FULL, REPLICATE_AXIS, SHARD_AXIS, StateDictType

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ShardedModel:
    """A wrapped model and what its state-dict code needs to know about where it lives.

    Attributes:
        module: the root of the wrapped model.
        engine: the engine that sharded it.
        mesh: the 2-D ``(replicate, shard)`` mesh it was wrapped with; ``None`` when FSDP was given a
            ``process_group`` (then every rank is treated as one shard group).
        collectives: rank facts and object collectives; its device is the root device.
    """

    module: Module
    engine: StateDicts
    mesh: DeviceMesh | None
    collectives: Collectives

    @property
    def rank(self) -> int:
        return self.collectives.rank

    def writer_ranks(self) -> list[int]:
        """Global ranks that assemble a full state dict: replica group 0 (the shard group of rank 0).

        The other replicas hold identical shards; letting them gather too would build the full model once per
        replica group (FSDP1's ``rank0_only`` means rank 0 *of each shard group* under hybrid sharding). Read from
        the mesh the model was wrapped with: a user's mesh need not hold consecutive ranks per row.
        """
        if self.mesh is None:
            return list(range(self.collectives.world_size))
        return shard_group_of(self.mesh, 0)

    def writes_data(self) -> bool:
        """Whether this rank's shards are the ones a sharded checkpoint stores: it is the lowest rank of its replica
        group (DCP gives each replicated chunk to the lowest rank holding it). Every rank, without a mesh."""
        if self.mesh is None:
            return True
        return self.rank == min(group_ranks(self.mesh, REPLICATE_AXIS))

    def writer_group(self) -> ProcessGroup | None:
        """The process group full optimizer state is gathered over: this rank's shard group (the world without a
        mesh)."""
        return None if self.mesh is None else axis_group(self.mesh, SHARD_AXIS)


def full_model_state(model: ShardedModel) -> dict[str, Any]:
    """The unsharded model state on global rank 0 (CPU tensors); an empty dict elsewhere. Call it on every rank."""
    if model.rank not in model.writer_ranks():
        return {}
    state = model.engine.full_model_state(model.module, model.collectives.device)
    return state if model.rank == 0 else {}


def any_rank_has_state(model: ShardedModel, optimizer: Optimizer) -> bool:
    """Whether any rank's optimizer holds state. Decided together: a rank whose shard holds none of the optimizer's
    parameters has no state of its own (e.g. an optimizer over the head only), yet must join the collective."""
    return model.collectives.any(bool(optimizer.state))


def full_optimizer_state(model: ShardedModel, optimizer: Optimizer) -> dict[str, Any]:
    """The unsharded optimizer state on global rank 0 in torch's standard layout; empty elsewhere. Collective.

    State and ``param_groups`` are keyed by parameter index in the optimizer's own order, so a plain (unwrapped)
    optimizer of the same model loads it with ``optimizer.load_state_dict``.
    """
    has_state = any_rank_has_state(model, optimizer)
    if model.rank not in model.writer_ranks():
        return {}
    if not has_state:
        # nothing sharded to gather (plain SGD, or no step yet): the local dict is already the full one
        return optimizer.state_dict() if model.rank == 0 else {}
    state = model.engine.full_optimizer_state(model.module, optimizer, model.collectives.device, model.writer_group())
    return state if model.rank == 0 else {}


def full_optimizer_states_of_groups(model: ShardedModel, optimizer: Optimizer, across: ProcessGroup) -> list[Any]:
    """Each replica group's unsharded state of ``optimizer`` (``replica_sync``: the groups' inner optimizers differ
    between syncs), in torch's standard layout, on global rank 0 in the order of ``across`` (the replicate axis's
    group of rank 0); an empty list elsewhere. Collective."""
    import torch.distributed as dist

    has_state = any_rank_has_state(model, optimizer)
    state = (model.engine.full_optimizer_state(model.module, optimizer, model.collectives.device, model.writer_group())
             if has_state else optimizer.state_dict())
    if dist.get_rank(model.writer_group()) != 0:
        return []  # (this group's first rank sends its state)
    states: list[Any] = [None] * dist.get_world_size(across) if model.rank == 0 else []
    dist.gather_object(state, states if model.rank == 0 else None, dst=0, group=across)
    return states


def module_state_dict(model: ShardedModel, kind: StateDictType) -> dict[str, Any]:
    """What a checkpoint's ``state_dict`` holds: full weights on rank 0, or this rank's DTensor shards."""
    if kind == FULL:
        return full_model_state(model)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model.module)


def optimizer_state(model: ShardedModel, optimizer: Optimizer, kind: StateDictType) -> dict[str, Any]:
    """What a checkpoint holds of ``optimizer``: the full state on rank 0, or this rank's shards keyed by name."""
    if kind == FULL:
        return full_optimizer_state(model, optimizer)
    if not any_rank_has_state(model, optimizer):
        # DCP's getter would run a zero step to create the state (Adam's step count would become 1): save as is
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with model.engine.optimizer_state_context(model.module, optimizer):
        return get_optimizer_state_dict(model.module, optimizer)


__all__ = [
    "ShardedModel",
    "any_rank_has_state",
    "full_model_state",
    "full_optimizer_state",
    "full_optimizer_states_of_groups",
    "module_state_dict",
    "optimizer_state",
]
