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
Every decision is the same on every rank of every group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
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


def fingerprints(named: Sequence[tuple[str, Tensor]]) -> tuple[int, int]:
    """(values, structure) of a rank's state: a fingerprint of every tensor's bits (``torch.hash_tensor``, on its own
    device; one transfer of the per-tensor hashes), and of their names, shapes and dtypes. 62-bit each, so that their
    negatives fit an int64."""
    nonempty = [tensor.detach() for _, tensor in named if tensor.numel() > 0]
    hashes = torch.stack([torch.hash_tensor(t).view(torch.int64) for t in nonempty]).cpu() if nonempty else None
    values = _sixty_two_bits(hashes.numpy().tobytes() if hashes is not None else b"")
    structure = _sixty_two_bits(repr([(name, tuple(t.shape), str(t.dtype)) for name, t in named]).encode())
    return values, structure


def agree_on_start(named: Sequence[tuple[str, Tensor]], *, compared: Callable[[str], bool], device: torch.device,
                   all_reduce_max: Callable[[Tensor], None], broadcast_from_first: Callable[[Tensor], None],
                   group: int) -> Start:
    """Compare this rank's state (the values of the tensors whose name ``compared`` accepts, the structure of all)
    with the same rank of every other group (``all_reduce_max``: a MAX all-reduce across the groups), agree inside the
    group, and, where the values differ, take every tensor from the first group (``broadcast_from_first``, in place).
    Raises :class:`FaultToleranceError` (every rank of every group alike) when the structures differ; a failed
    collective raises whatever the collective raised."""
    values, _ = fingerprints([(name, tensor) for name, tensor in named if compared(name)])
    _, structure = fingerprints(named)
    probe = torch.tensor([values, structure, -values, -structure], dtype=torch.int64, device=device)
    all_reduce_max(probe)  # max(x) == -max(-x): every group holds x
    differs = torch.tensor([int(probe[0]) != -int(probe[2]), int(probe[1]) != -int(probe[3])], dtype=torch.uint8,
                           device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)  # (inside the group: its ranks decide alike)
    values_differ, structure_differs = (bool(flag) for flag in differs.tolist())
    if structure_differs:
        raise FaultToleranceError(
            f"replica group {group}: at step 0 the replica groups hold models or optimizer states of another"
            " structure (parameter, buffer or optimizer-state names, shapes or dtypes differ), so no group's state"
            " could be copied into another's. Fix: start every group with the same script, model, optimizers and"
            " hybrid_shard_degree."
        )
    if not values_differ:
        return Start.SAME
    with torch.no_grad():
        for _, tensor in named:
            sent = tensor if tensor.is_contiguous() else tensor.contiguous()
            broadcast_from_first(sent)
            if sent is not tensor:
                tensor.copy_(sent)
    return Start.MADE_SAME


__all__ = ["Start", "agree_on_start", "fingerprints"]
