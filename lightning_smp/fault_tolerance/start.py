"""Replica groups that meet at step 0: the same state in every group before the first step, whole.

torchft's ``init_sync`` (its default) heals every group at step 0 from a source chosen per group rank (rank ``r``
from participant ``r mod groups``): the model after it is a mosaic of shards from different groups, and a healing
rank's gradient is left out of that step's average while the divisor still counts it (measured: 6.0e-3 from DDP after
one step). Here torchft's ``init_sync`` is off and, at a quorum whose every participant is at step 0, before the step's first
forward, every rank compares a fingerprint of its parameters and optimizer state (:func:`fingerprints`; the buffers
cross the groups with every step's gradients) with the same rank of the other groups, in one all-reduce of four
numbers. Groups that are equal (a seeded model, a common checkpoint) go on untouched; groups whose values differ (an
unseeded model) all take the state of the group with the lowest id, rank by rank, every tensor whole (buffers
included), before the first forward; groups whose models or optimizer states have another structure are refused.
Every decision is the same on every rank of every group; a collective of the comparison that failed on any rank of a
group drops the step on all of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from enum import Enum

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_smp.errors import FaultToleranceError


class Start(Enum):
    """How a step-0 quorum found the groups."""

    SAME = "same"
    MADE_SAME = "made_same"


def _sixty_two_bits(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


#: bytes of a tensor weighed at once by :func:`_positional` (bounds the temporary int64 copy: 8 x this)
_CHUNK = 1 << 24


def _positional(tensor: Tensor) -> Tensor:
    """A sum of ``tensor``'s bytes, each weighed by an odd number that grows with its position (int64, wrapping), on
    its own device: it changes when elements move, which an XOR of the values (``torch.hash_tensor``) does not see."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, data.numel(), _CHUNK):
        part = data[start:start + _CHUNK].to(torch.int64)
        total += (part * (2 * torch.arange(start, start + part.numel(), device=data.device) + 1)).sum()
    return total


def fingerprints(named: Sequence[tuple[str, Tensor]]) -> tuple[int, int]:
    """(values, structure) of a rank's state: a fingerprint of every tensor's bits (``torch.hash_tensor``, an XOR of
    its values, and :func:`_positional`, computed on the tensor's device; each brought to the CPU, at the start only),
    and of their names, shapes and dtypes. 62-bit each, so that their negatives fit an int64."""
    per_tensor = [torch.stack([torch.hash_tensor(t.detach()).view(torch.int64), _positional(t)]).cpu()
                  for _, t in named if t.numel() > 0]
    values = _sixty_two_bits(torch.cat(per_tensor).numpy().tobytes() if per_tensor else b"")
    structure = _sixty_two_bits(repr([(name, tuple(t.shape), str(t.dtype)) for name, t in named]).encode())
    return values, structure


def agree(flags: list[int], device: torch.device, wait: timedelta | None = None) -> list[int]:
    """Each flag's maximum over the group's ranks (one all-reduce; every rank of the group calls it, whatever
    happened before): its ranks decide alike. ``wait``: how long a rank waits for the others (``None``: the process
    group's timeout); past it, :class:`FaultToleranceError`."""
    values = torch.tensor(flags, dtype=torch.uint8, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if wait is None:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        else:
            try:
                dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True).wait(wait)
            except RuntimeError as err:
                raise FaultToleranceError(
                    f"rank {dist.get_rank()} waited {wait.total_seconds():g} s for its replica group's other ranks"
                    f" ({err}): one of them is stuck or gone. Fix: look at that rank's log; restart the group (it"
                    " heals from a live peer)."
                ) from err
    return [int(value) for value in values.tolist()]


def agree_on_start(named: Sequence[tuple[str, Tensor]], *, compared: Callable[[str], bool], device: torch.device,
                   all_reduce_max: Callable[[Tensor], bool], broadcast_from_first: Callable[[Tensor], bool],
                   group: int, usable: bool = True) -> Start | None:
    """Compare this rank's state (the values of the tensors whose name ``compared`` accepts, the structure of all)
    with the same rank of every other group (``all_reduce_max``: a MAX all-reduce across the groups, ``False`` if it
    failed), agree inside the group, and, where the values differ, take every tensor from the first group
    (``broadcast_from_first``, in place, ``False`` if it failed). ``usable``: whether this rank's process group across
    groups can be used at all (torchft holds no error). Returns ``None`` when a collective failed on some rank of the
    group (every rank returns it: the step is dropped, and the next quorum compares again); raises
    :class:`FaultToleranceError` (every rank of every group alike) when the structures differ."""
    values, _ = fingerprints([(name, tensor) for name, tensor in named if compared(name)])
    _, structure = fingerprints(named)
    probe = torch.tensor([values, structure, -values, -structure], dtype=torch.int64, device=device)
    compared_ok = usable and all_reduce_max(probe)  # max(x) == -max(-x): every group holds x
    values_differ, structure_differs, failed = agree(
        [compared_ok and int(probe[0]) != -int(probe[2]), compared_ok and int(probe[1]) != -int(probe[3]),
         not compared_ok], device)
    if failed:
        return None
    if structure_differs:
        raise FaultToleranceError(
            f"replica group {group}: at step 0 the replica groups hold models or optimizer states of another"
            " structure (parameter, buffer or optimizer-state names, shapes or dtypes differ), so no group's state"
            " could be copied into another's. Fix: start every group with the same script, model, optimizers and"
            " hybrid_shard_degree."
        )
    if not values_differ:
        return Start.SAME
    copied = True
    with torch.no_grad():
        for _, tensor in named:
            sent = tensor if tensor.is_contiguous() else tensor.contiguous()
            copied = copied and broadcast_from_first(sent)
            if copied and sent is not tensor:
                tensor.copy_(sent)
    (failed,) = agree([not copied], device)
    return None if failed else Start.MADE_SAME


__all__ = ["Start", "agree", "agree_on_start", "fingerprints"]
