"""Building the 2-D ``(replicate, shard)`` DeviceMesh, checking a mesh the user gave, and reading groups back."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from lightning_smp.degree import Layout
from lightning_smp.names import MESH_AXES, REPLICATE_AXIS, SHARD_AXIS, MeshAxis

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def build_device_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """Create the ``(replicate, shard)`` mesh for ``layout`` on ``device_type`` (``"cpu"``, ``"cuda"``, ...).

    The process group must already be initialised with ``layout.world_size`` ranks. Shard groups are rows of
    ``arange(world_size).view(replicate, shard)``: consecutive global ranks, so a degree that divides the devices
    per node keeps every shard group inside one node. Sub-groups inherit the default group's backend, which is
    how ``process_group_backend="cuda:nccl,cpu:gloo"`` reaches them.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_AXES)
    timeout = default_group_timeout(device_type)
    if timeout is not None:
        # DeviceMesh creates its sub-groups with torch's default timeout (30 min on gloo, 10 on NCCL), not the one the
        # process group was started with (the strategy's ``timeout``): a peer that stopped answering (a node lost)
        # would hold every rank in a replica all-reduce that long
        for dim in range(mesh.ndim):
            dist.distributed_c10d._set_pg_timeout(timeout, mesh.get_group(dim))
    return mesh


def default_group_timeout(device_type: str) -> timedelta | None:
    """How long a collective of the default process group waits for its peers (its backend for ``device_type``);
    ``None`` where the backend does not say."""
    import torch

    group = dist.distributed_c10d._get_default_group()
    try:
        return group._get_backend(torch.device(device_type)).options._timeout
    except (RuntimeError, AttributeError):
        return None


def fsdp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The mesh FSDP receives: the 2-D mesh for hybrid sharding, the 1-D axis it works on otherwise."""
    axis = layout.fsdp_axis
    return mesh if axis == "both" else mesh[REPLICATE_AXIS if axis == "replicate" else SHARD_AXIS]


def axis_group(mesh: DeviceMesh, axis: MeshAxis) -> dist.ProcessGroup:
    """This rank's process group along ``axis`` of a 2-D ``(replicate, shard)`` mesh.

    By position, not by name: a mesh the user built (``init_device_mesh("cuda", (r, s))``) has no axis names.
    """
    return mesh.get_group(MESH_AXES.index(axis))


def group_ranks(mesh: DeviceMesh, axis: MeshAxis) -> list[int]:
    """Global ranks of this rank's group along ``axis``."""
    return dist.get_process_group_ranks(axis_group(mesh, axis))


def shard_group_of(mesh: DeviceMesh, rank: int) -> list[int]:
    """Global ranks of the shard group (a row of the mesh) that holds ``rank``, for any 2-D mesh layout."""
    return next(row for row in mesh.mesh.tolist() if rank in row)


__all__ = [
    "MESH_AXES",
    "REPLICATE_AXIS",
    "SHARD_AXIS",
    "axis_group",
    "build_device_mesh",
    "fsdp_mesh",
    "group_ranks",
    "shard_group_of",
]
