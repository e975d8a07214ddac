"""Making every replica start from the same weights (FSDP1 does not broadcast them across replicas)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch.nn import Module

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _broadcast_tensors(
    tensors: "itertools.chain[torch.Tensor]", src: int, group: Optional[dist.ProcessGroup], device: torch.device
) -> None:
    with torch.no_grad():
        for tensor in tensors:
            if tensor.is_meta or tensor.numel() == 0:
                continue
            if tensor.device == device:
                dist.broadcast(tensor.data, src=src, group=group)
            else:
                # e.g. NCCL needs the tensor on the GPU while the unwrapped model still sits on the CPU
                staged = tensor.detach().to(device)
                dist.broadcast(staged, src=src, group=group)
                tensor.data.copy_(staged)


def broadcast_module_state(module: Module, device: torch.device, src: int = 0) -> None:
    """Copy global rank ``src``'s parameters and buffers into ``module`` on every rank (before wrapping).

    This is what DDP does at construction: ranks that initialised the model differently (no seed,
    different seeds) all train from ``src``'s weights.
    """
    _broadcast_tensors(itertools.chain(module.parameters(), module.buffers()), src, None, device)


def broadcast_across_replicas(model: Module, mesh: "DeviceMesh", device: torch.device) -> None:
    """After wrapping: copy each local shard from the first replica of ``mesh`` to the other replicas.

    Used when the unwrapped model never existed in full (meta-device init, or a model the user wrapped
    in ``configure_model``). Each rank of a replicate group holds the same shard index, so sizes match.
    Buffers are not sharded and come from global rank 0.
    """
    from lightning_smp.mesh import REPLICATE_AXIS, axis_group, group_ranks

    replicate_group = axis_group(mesh, REPLICATE_AXIS)
    if replicate_group.size() > 1:
        src = group_ranks(mesh, REPLICATE_AXIS)[0]
        _broadcast_tensors(itertools.chain(model.parameters()), src, replicate_group, device)
    _broadcast_tensors(itertools.chain(model.buffers()), 0, None, device)
