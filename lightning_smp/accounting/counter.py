"""Counting the collectives a rank really issues: :class:`CommCounter`, a context manager that counts every
``torch.distributed`` collective issued while it is active (number of calls and logical bytes per operation),
attributed to a mesh axis by its process group. Usable without Lightning; the bytes follow the conventions of
:mod:`lightning_smp.engines.textbook`, so counts compare one to one with its textbook figures.

Example::

    from lightning_smp.accounting import CommCounter

    with CommCounter(strategy.device_mesh) as counter:
        loss = model(batch).sum(); loss.backward()
    counter.counts()["shard"]["all_gather"]      # {"count": 4, "bytes": 8992}

When no counter is active nothing is installed, so accounting costs nothing. While one is active every tensor
operation of the current thread passes through a Python ``TorchDispatchMode`` (a few microseconds per op; the
memory report therefore counts one optimizer step, not all of them). Counting never changes a result: each call is
forwarded unchanged.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_smp.engines.textbook import OPS
from lightning_smp.names import OTHER_AXIS

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# c10d dispatcher ops (what every torch.distributed collective becomes, gloo and NCCL alike) -> operation name.
_C10D_OPS = {
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "alltoall_base_": "other",
}

# Functional collectives (``torch.distributed._functional_collectives``: DTensor's redistributions, ``full_tensor()``,
# the state dict API under FSDP2) are ops of their own namespace: they name their group by its name, return a new
# tensor (an all-gather's input is the shard) and complete with ``wait_tensor``, which is not a collective.
_FUNCTIONAL_OPS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
    "all_to_all_single": "other",
}


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _logical_bytes(args: Sequence[Any]) -> int:
    # The full buffer is the larger side: output for all-gather, input for reduce-scatter, the only one otherwise.
    return max((_tensor_bytes(a) for a in args), default=0)


def _empty_axis() -> dict[str, dict[str, int]]:
    return {op: {"count": 0, "bytes": 0} for op in OPS}


class _CollectiveMode(TorchDispatchMode):
    def __init__(self, counter: CommCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "c10d":
            self.counter._record(func._opname, args)
        elif func.namespace == "_c10d_functional" and func._opname in _FUNCTIONAL_OPS:
            self.counter._record_functional(func._opname, args)
        return func(*args, **(kwargs or {}))


class CommCounter:
    """Counts the collectives issued while active, per mesh axis and operation: number of calls and logical bytes.

    Args:
        mesh: a ``DeviceMesh`` whose dimensions name the axes (``("replicate", "shard")`` for
            :class:`~lightning_smp.HybridShardFSDPStrategy`). A 1-D mesh without names gives the axis ``"dim0"``.
        groups: instead of (or on top of) a mesh, ``{axis name: ProcessGroup}``; ``None`` as a group means the
            default (world) group.

    A collective is attributed to the axis whose process group it runs on (by group identity, not by ranks, so the
    world group and a shard group with the same ranks stay apart); anything else goes to ``"other"``. Counts are
    kept for the current thread and the threads autograd runs backward on; the counter can be entered again to
    keep adding (``reset()`` clears it).
    """

    def __init__(self, mesh: DeviceMesh | None = None, groups: Mapping[str, Any] | None = None) -> None:
        self._axes: dict[str, str] = {}  # group name -> axis
        self.axis_names: list[str] = []
        if mesh is not None:
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            for i, name in enumerate(names):
                self._add_axis(name, mesh.get_group(i))
        for name, group in (groups or {}).items():
            self._add_axis(name, group)
        self._lock = threading.Lock()
        self._mode: _CollectiveMode | None = None
        self._tally: dict[str, dict[str, dict[str, int]]] = {}
        self.reset()

    def _add_axis(self, name: str, group: Any) -> None:
        group = group if group is not None else dist.group.WORLD
        # first name wins when two axes share a group (e.g. a size-1 axis)
        self._axes.setdefault(group.group_name, name)
        if name not in self.axis_names:
            self.axis_names.append(name)

    def reset(self) -> None:
        """Forget everything counted so far."""
        self._tally = {name: _empty_axis() for name in [*self.axis_names, OTHER_AXIS]}

    @property
    def active(self) -> bool:
        """Whether the counter is installed right now."""
        return self._mode is not None

    def __enter__(self) -> CommCounter:
        if self._mode is not None:
            raise RuntimeError("CommCounter is already active; a counter cannot be nested in itself.")
        self._mode = _CollectiveMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)

    def axis_of(self, group: Any) -> str:
        """The axis a process group (a ``ProcessGroup`` or its boxed ``ScriptObject``) is counted on."""
        if isinstance(group, torch.ScriptObject):
            group = dist.ProcessGroup.unbox(group)
        return self._axes.get(group.group_name, OTHER_AXIS)

    def _record(self, opname: str, args: Sequence[Any]) -> None:
        op = _C10D_OPS.get(opname, "other")
        group = next((a for a in args if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())), None)
        axis = self.axis_of(group) if group is not None else OTHER_AXIS
        self._add(axis, op, _logical_bytes(args))

    def _record_functional(self, opname: str, args: Sequence[Any]) -> None:
        op = _FUNCTIONAL_OPS[opname]
        name = args[-1]  # the group: by name (or, in some versions, the group itself)
        if isinstance(name, torch.ScriptObject):
            axis = self.axis_of(name)
        else:
            axis = self._axes.get(name.group_name if isinstance(name, dist.ProcessGroup) else str(name), OTHER_AXIS)
        size = _tensor_bytes(args[0])
        if op == "all_gather":  # the logical size is the gathered output: the shard times the group's size
            size *= int(args[1])
        self._add(axis, op, size)

    def _add(self, axis: str, op: str, size: int) -> None:
        with self._lock:
            entry = self._tally[axis][op]
            entry["count"] += 1
            entry["bytes"] += size

    def counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{axis: {op: {"count": calls, "bytes": logical bytes}}}`` for every axis, ``"other"`` included (a copy)."""
        with self._lock:
            return copy.deepcopy(self._tally)


__all__ = ["CommCounter"]
