"""FSDP2's internals, read: the ``FSDPParamGroup`` of each ``FSDPModule`` and what it holds.

What FSDP2 does not expose publicly (the padded local shard of each parameter, the partial-reduce buffer of
deferred accumulation, whether a group still defers its all-reduce, the root's forward hooks) is read here and,
with :mod:`~lightning_smp.engines.fsdp2.unused`, only here; the memory-accounting tests check every such read
against the real tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module

from lightning_smp.engines import unused
from lightning_smp.engines.base import ShardingFacts, StorageUnit
from lightning_smp.engines.fsdp2 import unused as fsdp2_unused
from lightning_smp.names import (
    FULL_SHARD,
    HYBRID_SHARD,
    HYBRID_SHARD_ZERO2,
    NO_SHARD,
    REPLICATE_AXIS,
    SHARD_AXIS,
    SHARD_GRAD_OP,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lightning_smp.engines.textbook import FSDPUnitSpec
    from lightning_smp.engines.unused import Presence


def fsdp_module_cls() -> Any:
    """``torch.distributed.fsdp.FSDPModule``, imported when first needed."""
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def fsdp_modules(model: Module) -> list[Any]:
    """Every ``FSDPModule`` in ``model`` (``model`` included), outermost first."""
    cls = fsdp_module_cls()
    return [m for m in model.modules() if isinstance(m, cls)]


def param_groups(model: Module) -> list[tuple[Any, Any]]:
    """``(FSDPModule, FSDPParamGroup)`` for every module of ``model`` that owns parameters."""
    groups: list[tuple[Any, Any]] = []
    for module in fsdp_modules(model):
        state = module._get_fsdp_state()
        # a module may own several groups (torch >= 2.10: ``_fsdp_param_groups``), older versions exactly one
        owned = getattr(state, "_fsdp_param_groups", None)
        if owned is None:
            owned = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        groups.extend((module, group) for group in owned)
    return groups


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def root_forward_hooks(root: Any) -> list[tuple[dict[int, Any], int]]:
    """The sharded ``root``'s pre-forward and post-forward hooks, as ``(hook table, key)`` pairs."""
    state = root._get_fsdp_state()
    return [(root._forward_pre_hooks, state._pre_forward_hook_handle.id),
            (root._forward_hooks, state._post_forward_hook_handle.id)]


# ------------------------------------------------------------------ gradient reduction


def reduction_turned_off(model: Module) -> list[Any]:
    """The parameter groups whose reduce-scatter or all-reduce is turned off."""
    return [group for _, group in param_groups(model) if not (group.reduce_grads and group.all_reduce_grads)]


def holding_unreduced_sums(model: Module) -> list[Any]:
    """The parameter groups holding a deferred gradient sum not yet all-reduced across replicas."""
    return [group for _, group in param_groups(model) if getattr(group, "_partial_reduce_output", None) is not None]


def presences(model: Module) -> list[Presence]:
    """The unused-parameter notes of every parameter group (:mod:`~lightning_smp.engines.fsdp2.unused`)."""
    return fsdp2_unused.presences(group for _, group in param_groups(model))


def unreduced(model: Module) -> unused.Unreduced | None:
    """This rank's unused-parameter notes, for a caller that reduces them itself (:class:`.unused.Unreduced`)."""
    groups = [group for _, group in param_groups(model)]
    return unused.unreduced(fsdp2_unused.presences(groups), groups[0].device) if groups else None


def restore_unused(model: Module) -> None:
    """A parameter no rank used in the window gets its ``.grad`` back as DDP leaves it (:func:`.unused.restore_unused`)."""
    groups = [group for _, group in param_groups(model)]
    if groups:
        mesh = groups[0].mesh_info.mesh  # the root's: every rank that trains this model
        unused.restore_unused(fsdp2_unused.presences(groups), groups[0].device,
                              [mesh.get_group(axis) for axis in range(mesh.ndim)])


# ------------------------------------------------------------------ accounting


def gradient_bytes(model: Module) -> int:
    """Gradient memory ``model`` holds now, accumulation buffers included."""
    # sharded gradients are views of one reduce-scatter output per module: count each storage once
    held: dict[int, int] = {}

    def add(tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        local = _local(tensor)
        storage = local.untyped_storage()
        held[storage.data_ptr()] = max(held.get(storage.data_ptr(), 0), storage.nbytes())

    managed: set[int] = set()
    for _, group in param_groups(model):
        add(group._partial_reduce_output)  # deferred all-reduce: the 1/degree partial sum
        for fsdp_param in group.fsdp_params:
            managed.add(id(fsdp_param.sharded_param))
            add(fsdp_param.sharded_param.grad)
            add(fsdp_param.unsharded_accumulated_grad)  # no_sync in a lower reduce dtype
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            add(None if unsharded is None else unsharded.grad)  # no_sync: the unsharded gradient
    for param in model.parameters():
        if id(param) not in managed:
            add(param.grad)
    return sum(held.values())


def storage(model: Module) -> list[StorageUnit]:
    """What this rank allocates for each parameter of ``model``: the padded local shard of a sharded one."""
    units: list[StorageUnit] = []
    managed: set[int] = set()
    for _, group in param_groups(model):
        ranks = group.mesh_info.shard_mesh_size
        for fsdp_param in group.fsdp_params:
            param = fsdp_param.sharded_param
            local = fsdp_param._sharded_param_data.numel()  # the padded local shard the rank allocates
            units.append(StorageUnit(param, local, param.numel(), local * ranks))
            managed.add(id(param))
            # while a module is gathered its registered parameters are the unsharded ones: the same storage
            managed.add(id(getattr(fsdp_param, "_unsharded_param", None)))
    for param in model.parameters():
        if id(param) not in managed:
            units.append(StorageUnit(param, param.numel(), param.numel(), param.numel()))
    return units


def sharding(model: Module, known: str | None) -> ShardingFacts | None:
    """How ``model`` is sharded, read from its mesh; ``known``: the sharding strategy it was sharded with, if this
    engine sharded it (FSDP2 keeps no such name)."""
    groups = param_groups(model)
    if not groups:
        return None
    info = groups[0][1].mesh_info
    shard = info.shard_mesh_size
    replicate_group: Any = getattr(info, "replicate_process_group", None)  # HSDP meshes only
    replicas = info.replicate_mesh_size if replicate_group is not None else 1
    if shard == 1:
        return ShardingFacts(NO_SHARD, 1, replicas, {REPLICATE_AXIS: replicate_group})
    if known is not None:
        zero2 = known in (HYBRID_SHARD_ZERO2, SHARD_GRAD_OP)
    else:
        # sharded by hand: ZeRO-2 when the non-root modules keep their parameters gathered after forward
        inner = [g for m, g in groups if not m._get_fsdp_state()._is_root]
        zero2 = bool(inner) and all(g.post_forward_mesh_info is None for g in inner)
    facts_groups: dict[str, ProcessGroup] = {SHARD_AXIS: info.shard_process_group}
    if replicate_group is not None and replicas > 1:
        facts_groups[REPLICATE_AXIS] = replicate_group
        name = HYBRID_SHARD_ZERO2 if zero2 else HYBRID_SHARD
    else:
        name = SHARD_GRAD_OP if zero2 else FULL_SHARD
    return ShardingFacts(name, shard, replicas, facts_groups)


def comm_units(model: Module) -> list[FSDPUnitSpec]:
    """One :class:`~lightning_smp.engines.textbook.FSDPUnitSpec` per module that owns parameters: one all-gather
    and one reduce-scatter each, of all its parameters' padded shards together."""
    from lightning_smp.engines.textbook import FSDPUnitSpec

    specs = []
    for module, group in param_groups(model):
        params = group.fsdp_params
        shard = group.mesh_info.shard_mesh_size
        padded = sum(p._sharded_param_data.numel() for p in params) * shard
        # only the parameters that require gradients are reduce-scattered (and all-reduced)
        reduced = sum(p._sharded_param_data.numel() for p in params if p.sharded_param.requires_grad) * shard
        gather_dtype = params[0].param_dtype or params[0].orig_dtype
        reduce_dtype = params[0].reduce_dtype or gather_dtype
        specs.append(FSDPUnitSpec(
            padded_numel=padded,
            is_root=bool(module._get_fsdp_state()._is_root),
            gather_bytes=torch.empty((), dtype=gather_dtype).element_size(),
            reduce_bytes=torch.empty((), dtype=reduce_dtype).element_size(),
            reduce_numel=reduced,
        ))
    return specs


def track_unused(module: Module) -> None:
    """Note, in every parameter group of ``module``, which parameters each backward used (:func:`.fsdp2_unused.track`)."""
    for group in (group for _, group in param_groups(module)):
        fsdp2_unused.track(group)


__all__ = [
    "comm_units",
    "fsdp_module_cls",
    "fsdp_modules",
    "gradient_bytes",
    "holding_unreduced_sums",
    "param_groups",
    "presences",
    "reduction_turned_off",
    "restore_unused",
    "unreduced",
    "root_forward_hooks",
    "sharding",
    "storage",
    "track_unused",
]
