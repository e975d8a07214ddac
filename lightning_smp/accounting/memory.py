"""Measuring what a rank holds and which collectives it should issue, from the real tensors; no Lightning.

Works on any engine's sharded model (through the engine's optional :class:`~lightning_smp.engines.base.Accounting`
role), on DDP and on plain modules, so that the memory report compares them side by side. A model whose engine does
not take that role gets ``None`` ("n/a" in the tables) for what only the engine could say: its shards, gradients and
textbook traffic. The record fields are documented in
:mod:`lightning_smp.callbacks.memory`.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.engines import StorageUnit, engine_of
from lightning_smp.engines.base import Accounting
from lightning_smp.engines.textbook import CommFigure
from lightning_smp.names import NO_SYNC, GradientAccumulation

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Memory fields of a record, in display order (all numeric; logged as ``memory/rank{r}/{field}``).
MEMORY_FIELDS = (
    "params_bytes", "grads_bytes", "optimizer_bytes", "total_bytes",
    "unsharded_params_bytes", "unsharded_grads_bytes", "unsharded_optimizer_bytes", "unsharded_total_bytes",
    "saved_bytes", "saved_ratio", "padding_bytes", "floor_bytes", "measured_over_floor",
    "peak_allocated_bytes", "peak_reserved_bytes", "peak_rss_bytes",
)
#: Fields that depend on the machine and the allocator, not on the model: they differ between runs.
PEAK_FIELDS = ("peak_allocated_bytes", "peak_reserved_bytes", "peak_rss_bytes")


def _nbytes(tensor: torch.Tensor | None) -> int:
    """Bytes this rank holds of ``tensor``: a ``DTensor``'s local shard, not its global size."""
    if tensor is None:
        return 0
    from torch.distributed.tensor import DTensor

    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


class UnaccountedError(LookupError):
    """``model``'s engine does not take the :class:`~lightning_smp.engines.base.Accounting` role."""


def _accounting(model: Module) -> Accounting | None:
    """The accounting of the engine that sharded ``model``; ``None`` for a plain module; raises
    :class:`UnaccountedError` for an engine without the role."""
    engine = engine_of(model)
    if engine is None:
        return None
    if not isinstance(engine, Accounting):
        raise UnaccountedError(engine.name)
    return engine


def accounted(model: Module) -> bool:
    """Whether what ``model``'s ranks hold can be read back: a plain module, or an engine with the accounting role."""
    try:
        _accounting(model)
    except UnaccountedError:
        return False
    return True


def storage_units(model: Module) -> list[StorageUnit]:
    """What this rank stores of every parameter: the engine's shards, or the plain parameters of other models.
    Raises :class:`UnaccountedError` for an engine without the accounting role."""
    accounting = _accounting(model)
    if accounting is not None:
        return accounting.storage(model)
    return [StorageUnit(p, p.numel(), p.numel(), p.numel()) for p in model.parameters()]


def shard_layout(model: Module) -> tuple[str | None, int, int]:
    """``(FSDP sharding strategy name or None, shard degree, replicas)`` read from the model itself. Raises
    :class:`UnaccountedError` for an engine without the accounting role."""
    accounting = _accounting(model)
    facts = accounting.sharding(model) if accounting is not None else None
    if facts is None:
        return None, 1, 1
    return facts.sharding_strategy, facts.shard_degree, facts.replicas


def gradient_bytes(model: Module) -> int | None:
    """Bytes of gradient memory this rank holds now: an engine's sharded gradients (padding included) and, during
    gradient accumulation, its unsharded (``no_sync``) or partially reduced (deferred all-reduce) buffers; ``None``
    for an engine without the accounting role."""
    if not accounted(model):
        return None
    accounting = _accounting(model)
    if accounting is not None:
        return accounting.gradient_bytes(model)
    return sum(_nbytes(p.grad) for p in model.parameters())


def no_sync_extra_bytes(model: Module) -> int:
    """Bytes more than the sharded gradient that each rank holds while accumulating under ``no_sync``: the
    unsharded (padded) gradient of every trainable parameter instead of this rank's shard of it."""
    if not accounted(model):
        return 0  # unknown: the engine does not say what it holds
    return sum((u.padded_numel - u.local_numel) * u.tensor.element_size()
               for u in storage_units(model) if u.tensor.requires_grad)


def _unwrap(optimizer: Any) -> Optimizer:
    # Lightning's LightningOptimizer wraps the real one; its public ``optimizer`` property gives it back
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def optimizer_state_bytes(optimizers: Iterable[Optimizer], full_numel: Mapping[int, int] | None = None) -> tuple[int, int]:
    """``(bytes held, bytes a DDP replica would hold)`` of the optimizers' state tensors, each tensor counted once.

    The unsharded figure uses the full parameter sizes (``full_numel``, by ``id`` of the parameter; default: the
    local size) and, per parameter group, the state layout of the first parameter that has state on this rank:
    state shaped like its parameter is scaled to the full size, other state (``step``) is taken as is, and every
    parameter of the group is assumed to carry that layout, as it would under DDP.
    """
    seen: set[int] = set()
    held = unsharded = 0
    for optimizer in optimizers:
        optimizer = _unwrap(optimizer)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    held += _nbytes(value)
        for group in optimizer.param_groups:
            params = group["params"]
            sample = next((p for p in params if optimizer.state.get(p)), None)
            if sample is None:
                continue
            per_element = fixed = 0
            for value in optimizer.state[sample].values():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.dim() > 0 and value.shape == sample.shape:
                    per_element += value.element_size()
                else:
                    fixed += _nbytes(value)
            for param in params:
                numel = (full_numel or {}).get(id(param), param.numel())
                unsharded += numel * per_element + fixed
    return held, unsharded


def measure_memory(model: Module, optimizers: Sequence[Optimizer], grads_bytes: int | None = None) -> dict[str, Any]:
    """Memory fields of one rank, from the real tensors: works on sharded, DDP and plain modules, without Lightning.

    ``grads_bytes`` overrides the gradients measured now (they may be gone after ``zero_grad``); the unsharded
    gradient figure is the unsharded parameter figure when gradients exist, else 0. A model whose engine does not take
    the accounting role: every field ``None``.
    """
    if not accounted(model):
        return {"sharding_strategy": None, "shard_degree": None, "replicas": None,
                **dict.fromkeys(f for f in MEMORY_FIELDS if f not in PEAK_FIELDS)}
    accounting = _accounting(model)
    units = storage_units(model)
    full_numel = (accounting.full_numels(model) if accounting is not None
                  else {id(u.tensor): u.full_numel for u in units})
    name, shard, replicas = shard_layout(model)
    params = sum(u.local_numel * u.tensor.element_size() for u in units)
    grads = (gradient_bytes(model) or 0) if grads_bytes is None else grads_bytes  # (accounted: never None)
    unsharded_params = sum(u.full_numel * u.tensor.element_size() for u in units)
    unsharded_grads = unsharded_params if grads else 0
    # average padding per rank of one tensor kind (parameters, and gradients when held)
    padding = sum((u.padded_numel - u.full_numel) * u.tensor.element_size() for u in units) / shard
    padding *= 2 if grads else 1
    optimizer, unsharded_optimizer = optimizer_state_bytes(optimizers, full_numel)
    total = params + grads + optimizer
    unsharded_total = unsharded_params + unsharded_grads + unsharded_optimizer
    floor = unsharded_total / shard + padding
    return {
        "sharding_strategy": name,
        "shard_degree": shard,
        "replicas": replicas,
        "params_bytes": params,
        "grads_bytes": grads,
        "optimizer_bytes": optimizer,
        "total_bytes": total,
        "unsharded_params_bytes": unsharded_params,
        "unsharded_grads_bytes": unsharded_grads,
        "unsharded_optimizer_bytes": unsharded_optimizer,
        "unsharded_total_bytes": unsharded_total,
        "saved_bytes": unsharded_total - total,
        "saved_ratio": (unsharded_total - total) / unsharded_total if unsharded_total else 0.0,
        "padding_bytes": padding,
        "floor_bytes": floor,
        "measured_over_floor": total / floor if floor else 1.0,
    }


def peak_memory(device: torch.device) -> dict[str, int | None]:
    """Peak allocated/reserved bytes of ``device`` when it is the accelerator's (CUDA, XPU, ...; ``None`` on the CPU)
    and the process's peak RSS."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024  # kilobytes on Linux, bytes on macOS
    allocated = reserved = None
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is not None and device.type == accelerator.type:
        allocated = torch.accelerator.max_memory_allocated(device)
        reserved = torch.accelerator.max_memory_reserved(device)
    return {"peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved, "peak_rss_bytes": rss}


def comm_groups(model: Module, mesh: DeviceMesh | None = None) -> dict[str, Any]:
    """``{axis: ProcessGroup}`` to attribute collectives by: ``mesh``'s named axes, else the engine's groups."""
    if mesh is not None and mesh.mesh_dim_names:
        return {name: mesh.get_group(name) for name in mesh.mesh_dim_names}
    accounting = _accounting(model) if accounted(model) else None
    facts = accounting.sharding(model) if accounting is not None else None
    return dict(facts.groups) if facts is not None else {}


def textbook(model: Module, backward_passes: int, accumulation: GradientAccumulation = NO_SYNC,
             root_gathered: bool = False) -> CommFigure | None:
    """The textbook communication of one optimizer step of ``model`` (sharded or DDP) under Lightning's loop, with
    ``backward_passes`` micro-batches accumulated as ``accumulation`` says (Lightning's own FSDP and DDP strategies:
    ``no_sync``); ``root_gathered``: a forward without backward (validation) came right before the step. ``None`` on
    one device, and for an engine without the accounting role."""
    accounting = _accounting(model) if accounted(model) else None
    if accounting is not None:
        return accounting.step_textbook(model, backward_passes, accumulation, root_gathered=root_gathered)
    return None


__all__ = [
    "MEMORY_FIELDS",
    "PEAK_FIELDS",
    "UnaccountedError",
    "accounted",
    "comm_groups",
    "gradient_bytes",
    "measure_memory",
    "no_sync_extra_bytes",
    "optimizer_state_bytes",
    "peak_memory",
    "shard_layout",
    "storage_units",
    "textbook",
]
