"""Wrapping with FSDP2: which submodules become ``fully_shard`` units (``auto_wrap_policy``, walked as FSDP1 walks
it), and the root, sharded last, with every parameter in a unit and meta-device parameters materialized."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Module

from lightning_smp.engines.base import ShardingPlan
from lightning_smp.engines.fsdp2.groups import fsdp_module_cls, fsdp_modules, track_unused
from lightning_smp.engines.units import wrap_targets
from lightning_smp.errors import UnsupportedOptionError


def materialize_where_shards_cannot_draw(module: Module, plan: ShardingPlan) -> None:
    """Meta-device parameters in full, before sharding, where DTensor's random ops do not run (CPU: they need a
    CUDA-like device). Materialized after sharding there, each rank's ``reset_parameters`` would draw the first
    numbers of the same stream for its own shard, and every full weight would repeat one block of rows. In full, every
    rank draws what a non-sharded model seeded alike draws; rank 0's weights then go to every rank (ranks need not be
    seeded alike), and ``fully_shard`` splits real tensors. Costs the full model on each rank for a moment."""
    from lightning.fabric.strategies.model_parallel import _materialize_distributed_module
    from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers
    from torch.distributed.tensor._random import is_rng_supported_mesh

    from lightning_smp.replicas import broadcast_module_state

    if not _has_meta_device_parameters_or_buffers(module):
        return
    if plan.mesh is not None and is_rng_supported_mesh(plan.mesh):
        return
    _materialize_distributed_module(module, plan.device)  # to_empty, then reset_parameters() in module order
    broadcast_module_state(module, plan.device, src=0)


def shard_root(module: Module, kwargs: dict[str, Any], plan: ShardingPlan) -> Module:
    """Shard ``module`` itself, last, with ``kwargs`` (:func:`.fsdp2_options.shard_kwargs`): under manual
    optimization every parameter first goes into a unit below it; then its meta-device parameters become real
    local shards."""
    from lightning.fabric.strategies.model_parallel import _materialize_distributed_module
    from torch.distributed.fsdp import fully_shard

    if plan.steps_inside_a_step:
        _shard_below_the_root(module, kwargs)
    # the root keeps its parameters gathered from forward to backward, as FSDP1's root does (it is needed again
    # at once); under ZeRO-2 nothing reshards after forward anyway
    fully_shard(module, **{**kwargs, "reshard_after_forward": None if kwargs["reshard_after_forward"] else False})
    # every parameter that requires a gradient takes part in every reduction (zeros when a micro-batch did not use
    # it), as DDP's buckets do: the pending sum of a deferred all-reduce keeps one layout for the whole window.
    # Otherwise its layout follows the parameters each micro-batch used, and a head left out of the last
    # micro-batch is never all-reduced (its .grad stays None) or receives another head's sum
    for unit in fsdp_modules(module):
        unit.set_reduce_scatter_unused_params(True, recurse=False)
    # ... and a parameter that no rank used in the window gets its .grad back before the step (engines/unused.py)
    track_unused(module)
    # meta-device parameters become real local shards, initialised by each module's reset_parameters()
    _materialize_distributed_module(module, plan.device)
    return module


def _shard_below_the_root(module: Module, kwargs: dict[str, Any]) -> None:
    """Manual optimization: every parameter in a unit below the root, each child that holds some a unit of its own.

    Lightning's step runs as the root's forward (:meth:`.FSDP2Engine.call_through_root`), so a backward inside it
    comes before the root's post-forward, which is what hooks the root's parameters into a backward: their gradients
    would stay None, and the step would silently skip them. A unit below the root gathers, hooks and reduces around
    each of its own calls, and follows ``requires_grad`` as ``toggle_optimizer`` sets it, whatever the step does
    between. Frozen parameters count too (a finetuning callback may unfreeze them later); the elements of a
    ``ModuleList`` or ``ModuleDict`` become the units (``fully_shard`` refuses containers).
    """
    from torch.distributed.fsdp import fully_shard

    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise UnsupportedOptionError(
            f"automatic_optimization=False with parameters held by the LightningModule itself ({', '.join(own)}):"
            " under fsdp_version=2 every parameter must be in a submodule, whose FSDP unit takes part in each"
            " backward inside the step. Fix: move them into a submodule (e.g. a small nn.Module holding them)."
        )
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)
    pending = list(module.children())
    while pending:
        child = pending.pop(0)
        if isinstance(child, fsdp_module_cls()) or not any(True for _ in child.parameters()):
            continue
        if isinstance(child, containers):
            pending.extend(child.children())
        else:
            fully_shard(child, **kwargs)


__all__ = ["materialize_where_shards_cannot_draw", "shard_root", "wrap_targets"]
