"""Building the 2-D ``(replicate, shard)`` DeviceMesh, checking a mesh the user gave, and reading groups back."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_smp.degree import Layout
from lightning_smp.errors import HybridShardConfigError
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


def check_device_mesh(device_mesh: Any) -> tuple[DeviceMesh | None, int | None]:
    """Static checks of a ``device_mesh`` argument: returns (the user's mesh or None, the shard degree it implies).

    Accepts ``None``, a tuple ``(replicas, shard_degree)`` or a 2-D ``DeviceMesh`` whose shard groups hold more than
    one rank.
    """
    if device_mesh is None:
        return None, None
    if isinstance(device_mesh, (tuple, list)):
        if len(device_mesh) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in device_mesh):
            raise HybridShardConfigError(
                f"device_mesh={device_mesh!r} must be a tuple (replicas, shard_degree) of two positive integers."
                " Fix: e.g. device_mesh=(2, 4), or pass hybrid_shard_degree=4 instead."
            )
        return None, device_mesh[1]
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 2:
        raise HybridShardConfigError(
            f"device_mesh={device_mesh!r} must be a 2-D DeviceMesh (replicate, shard) or a tuple (replicas, shard_degree)."
        )
    if device_mesh.size(1) == 1:
        raise HybridShardConfigError(
            f"device_mesh of shape {tuple(device_mesh.shape)} has shard groups of one rank: FSDP would all-reduce over"
            " size-1 groups and replicas would never synchronise. Fix: pass hybrid_shard_degree=1 instead."
        )
    return device_mesh, device_mesh.size(1)


def process_group_degree(process_group: Any) -> int | None:
    """The shard degree of an FSDP ``process_group`` argument (a group, or a hybrid ``(intra, inter)`` pair)."""
    if process_group is None:
        return None
    intra = process_group[0] if isinstance(process_group, tuple) else process_group
    return intra.size()


__all__ = [
    "MESH_AXES",
    "REPLICATE_AXIS",
    "SHARD_AXIS",
    "axis_group",
    "build_device_mesh",
    "check_device_mesh",
    "fsdp_mesh",
    "group_ranks",
    "process_group_degree",
    "shard_group_of",
]
