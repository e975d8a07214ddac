"""Building the 2-D ``(replicate, shard)`` DeviceMesh and reading groups back from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from lightning_smp.degree import Layout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Mesh axis across replicas (outer: a rank's peers holding the same shard).
REPLICATE_AXIS = "replicate"
#: Mesh axis inside a shard group (inner: consecutive global ranks).
SHARD_AXIS = "shard"
MESH_AXES = (REPLICATE_AXIS, SHARD_AXIS)


def build_device_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """Create the ``(replicate, shard)`` mesh for ``layout`` on ``device_type`` (``"cpu"``, ``"cuda"``, ...).

    The process group must already be initialised with ``layout.world_size`` ranks. Shard groups are rows of
    ``arange(world_size).view(replicate, shard)``: consecutive global ranks, so a degree that divides the devices
    per node keeps every shard group inside one node. Sub-groups inherit the default group's backend, which is
    how ``process_group_backend="cuda:nccl,cpu:gloo"`` reaches them.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_AXES)


def fsdp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The mesh FSDP receives: the 2-D mesh for hybrid sharding, the 1-D axis it works on otherwise."""
    axis = layout.fsdp_axis
    return mesh if axis == "both" else mesh[REPLICATE_AXIS if axis == "replicate" else SHARD_AXIS]


def axis_group(mesh: DeviceMesh, axis: str) -> dist.ProcessGroup:
    """This rank's process group along ``axis`` of a 2-D ``(replicate, shard)`` mesh.

    By position, not by name: a mesh the user built (``init_device_mesh("cuda", (r, s))``) has no axis names.
    """
    return mesh.get_group(MESH_AXES.index(axis))


def group_ranks(mesh: DeviceMesh, axis: str) -> list[int]:
    """Global ranks of this rank's group along ``axis``."""
    return dist.get_process_group_ranks(axis_group(mesh, axis))


def shard_group_of(mesh: DeviceMesh, rank: int) -> list[int]:
    """Global ranks of the shard group (a row of the mesh) that holds ``rank``, for any 2-D mesh layout."""
    return next(row for row in mesh.mesh.tolist() if rank in row)
