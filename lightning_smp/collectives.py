"""A small handle on the world's object collectives and rank facts, for code that must not depend on a front end.

The checkpoint and replica code takes one of these instead of a Lightning strategy, so that the Trainer strategy and
a Fabric strategy (or a plain script) can share it. Without an initialised process group it is one process: every
collective returns its own input.
"""

from __future__ import annotations

import atexit
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class Collectives:
    """Rank facts and object collectives over the default (world) process group.

    Attributes:
        rank: global rank of this process.
        world_size: number of ranks.
        device: the root device; tensors of the collectives below live there (NCCL needs them on the GPU).
    """

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @classmethod
    def current(cls, device: torch.device | None = None) -> Collectives:
        """The handle for this process: the world group when one is initialised, else a single process."""
        device = device if device is not None else torch.device("cpu")
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), device)
        return cls(0, 1, device)

    @property
    def distributed(self) -> bool:
        """Whether there is more than one rank to talk to."""
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def broadcast(self, obj: T, src: int = 0) -> T:
        """``obj`` of global rank ``src`` on every rank (any picklable object)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank."""
        if not self.distributed:
            return bool(flag)
        value = torch.tensor(int(bool(flag)), device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return bool(value.item() > 0)

    def barrier(self) -> None:
        """Wait until every rank is here."""
        if not self.distributed:
            return
        if self.device.type != "cpu" and dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.device.index or 0])
        else:
            dist.barrier()


def checkpoint_group(device_type: str) -> dist.ProcessGroup | None:
    """A gloo group of every rank for background checkpoint writes, with the default group's timeout; ``None``
    without one. Collective: every rank creates it at the same point."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from lightning_smp.mesh import default_group_timeout

    return dist.new_group(backend="gloo", timeout=default_group_timeout(device_type))


_exit_hook_registered = False


def release_process_groups_at_exit() -> None:
    """Destroy the process groups while the interpreter is still whole, for every backend.

    Lightning registers this for NCCL only. A gloo process group left to interpreter finalization can abort the
    process (``terminate called without an active exception``, exit code -6) after a run that finished: a worker
    thread freeing its last work's tensors needs the GIL, and one that gets it only once finalization has begun is
    torn down inside a destructor (pytorch/pytorch#190489; measured here: 8 of 15 four-rank gloo runs aborted
    without this, none of 48 with it). Destroying a group is local for gloo, so a peer that already exited cannot
    block it; it does not stop gloo's threads while the mesh or the model still refer to the group, so the handler
    then releases the GIL for a moment, for any worker still waiting for it.
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(_release_process_groups)


def _release_process_groups() -> None:
    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    _destroy_dist_connection()
    time.sleep(0.05)


#: collectives whose ring sends the data twice (a reduce-scatter, then an all-gather)
_RING_FACTOR_TWICE = frozenset({"all_reduce"})


def ring_bytes(op: str, logical_bytes: float, group_size: int) -> float:
    """Bytes one rank sends for a collective ``op`` of ``logical_bytes`` on a ring of ``group_size`` ranks (gloo's and
    NCCL's ring; the cluster tests hold gloo to it)."""
    if group_size <= 1:
        return 0.0
    factor = (group_size - 1) / group_size
    return logical_bytes * factor * (2 if op in _RING_FACTOR_TWICE else 1)


__all__ = ["Collectives", "checkpoint_group", "release_process_groups_at_exit", "ring_bytes"]
