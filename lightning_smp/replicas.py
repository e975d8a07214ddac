"""Making every replica start from the same weights (FSDP1 does not broadcast them across replicas, FSDP2 has no
``sync_module_states`` at all)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.nn import Module

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


#: Largest bucket of one weight broadcast, in bytes (FSDP's ``sync_module_states`` uses the same size).
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def broadcast_tensors(
    tensors: Iterable[torch.Tensor], src: int, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Broadcast ``tensors`` in place from global rank ``src`` over ``group`` (the world when ``None``).

    Tensors travel in buckets of up to :data:`BROADCAST_BUCKET_BYTES`, each one coalesced broadcast per dtype
    (c10d's ``_broadcast_coalesced``, what DDP and FSDP use for their own start-up sync), not one collective per
    tensor. Tensors that are not on ``device`` (the unwrapped model still on the CPU under NCCL) are staged there
    one bucket at a time, so the device never holds more than one extra bucket.
    """
    # torch types ``group.WORLD`` as optional; it is set whenever the default process group exists, as it must here
    group = group if group is not None else cast(dist.ProcessGroup, dist.group.WORLD)
    group_src = dist.get_group_rank(group, src)
    bucket: list[torch.Tensor] = []
    bucket_bytes = 0

    def flush() -> None:
        staged = [tensor.to(device) for tensor in bucket]  # the tensor itself when it is already on ``device``
        dist._broadcast_coalesced(group, staged, BROADCAST_BUCKET_BYTES, group_src)
        for tensor, on_device in zip(bucket, staged):
            if on_device is not tensor:
                tensor.copy_(on_device)

    with torch.no_grad():
        for tensor in tensors:
            if tensor.is_meta or tensor.numel() == 0:
                continue
            bucket.append(tensor.detach())
            bucket_bytes += tensor.numel() * tensor.element_size()
            if bucket_bytes >= BROADCAST_BUCKET_BYTES:
                flush()
                bucket, bucket_bytes = [], 0
        if bucket:
            flush()


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a ``DTensor``'s local shard (under ``no_grad``, the shard itself: writing it
    writes the tensor), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_tensors(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Each tensor's local shard (:func:`local_part`), consumed under ``no_grad`` in :func:`broadcast_tensors`."""
    for tensor in tensors:
        yield local_part(tensor)


def broadcast_module_state(module: Module, device: torch.device, src: int = 0) -> None:
    """Copy global rank ``src``'s parameters and buffers into ``module`` on every rank (before wrapping).

    This is what DDP does at construction: ranks that initialised the model differently (no seed,
    different seeds) all train from ``src``'s weights.
    """
    broadcast_tensors(itertools.chain(module.parameters(), module.buffers()), src, None, device)


def broadcast_before_wrapping(module: Module, device: torch.device,
                              is_shard: Callable[[torch.Tensor], bool] | None = None) -> bool:
    """Give every rank global rank 0's weights now if ``module`` exists in full; return whether it did.

    A module with parameters or buffers on the meta device has nothing to send yet: it returns ``False``, and the
    caller syncs the replicas after wrapping with :func:`broadcast_across_replicas`. Parameters for which
    ``is_shard`` is true are an inner unit's shards (wrapped by hand before this outer call, and synced then): their
    sizes and contents differ between ranks by design, and rank 0's would overwrite the others'.
    """
    from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers

    if _has_meta_device_parameters_or_buffers(module):
        return False
    parameters = [p for p in module.parameters() if is_shard is None or not is_shard(p)]
    broadcast_tensors(itertools.chain(parameters, module.buffers()), 0, None, device)
    return True


def broadcast_across_replicas(model: Module, mesh: "DeviceMesh", device: torch.device) -> None:
    """After wrapping: copy each local shard from the first replica of ``mesh`` to the other replicas.

    Used when the unwrapped model never existed in full (meta-device init, or a model the user wrapped
    in ``configure_model``). Each rank of a replicate group holds the same shard index, so sizes match.
    Buffers are not sharded and come from global rank 0.
    """
    from lightning_smp.mesh import axis_group, group_ranks
    from lightning_smp.names import REPLICATE_AXIS

    replicate_group = axis_group(mesh, REPLICATE_AXIS)
    if replicate_group.size() > 1:
        src = group_ranks(mesh, REPLICATE_AXIS)[0]
        broadcast_tensors(_local_tensors(model.parameters()), src, replicate_group, device)
    broadcast_tensors(itertools.chain(model.buffers()), 0, None, device)
