"""What one crossing carries: per dtype, one flat buffer summed across the replica groups.

Each rank's buffer holds, in this order (only the first dtype's holds the parts marked *first*):

- its local gradient (its shards, under FSDP2) of every trainable parameter of that dtype, zeros where it has none:
  summed, then divided by the participating groups (a group that does not take part, one that heals, sends zeros);
- one flag per parameter, 1 where this group gave it a gradient: the sum is 0 only where no group did, and that
  parameter keeps ``.grad`` ``None``, as DDP leaves it;
- *first*, the engine's unused-parameter notes, one indicator per parameter and level (``level >= 1, 2, ...``), so that
  their sum is positive where some group's level reached it and the count of positive indicators is the maximum;
- the buffers of that dtype, and *first* every integer buffer as 8-bit pieces (exact in any floating dtype): sent by
  the first participating group alone, the others sending zeros, so that the sum is that group's buffers bit for bit
  (``x + 0 == x``), as DDP broadcasts rank 0's (``broadcast_buffers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_smp.replicas import local_part

#: bits per piece of an integer buffer: 0..255 is exact in every floating dtype (bfloat16 holds integers up to 256)
_PIECE_BITS = 8


class Levels(Protocol):
    """The unused-parameter notes as the crossing reads them (:class:`~lightning_smp.fault_tolerance.vote.UnusedNotes`)."""

    levels: Tensor
    LEVELS: ClassVar[int]


@dataclass
class Packed:
    """One dtype's flat buffer and what it carries (see the module's docstring)."""

    flat: Tensor
    parameters: list[Tensor]
    sizes: list[int]
    marks: int = 0
    buffers: list[Tensor] = field(default_factory=list)
    integers: list[Tensor] = field(default_factory=list)

    @property
    def _flags_at(self) -> int:
        return sum(self.sizes)

    @property
    def _buffers_at(self) -> int:
        return self._flags_at + len(self.parameters) + self.marks


def _pieces(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size() * 8 // _PIECE_BITS


def _to_pieces(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return raw.to(dtype)


def _from_pieces(pieces: Tensor, like: Tensor) -> Tensor:
    raw = pieces.round().to(torch.uint8)
    return raw.view(like.dtype).view(like.shape)


def pack(parameters: Sequence[Tensor], notes: Levels | None, buffers: Sequence[Tensor], *, sends_buffers: bool,
         device: torch.device) -> list[Packed]:
    """This rank's flat buffers, one per dtype (the first one also carries the notes and the integer buffers)."""
    trainable = [p for p in parameters if p.requires_grad]
    floating = [b for b in buffers if b.is_floating_point()]
    integers = [b for b in buffers if not b.is_floating_point()]
    dtypes: list[torch.dtype] = []
    for tensor in (*trainable, *floating):
        if tensor.dtype not in dtypes:
            dtypes.append(tensor.dtype)
    if not dtypes and (notes is not None or integers):
        dtypes.append(torch.float32)
    packed = []
    for position, dtype in enumerate(dtypes):
        group = [p for p in trainable if p.dtype == dtype]
        sizes = [local_part(p).numel() for p in group]
        mine = [b for b in floating if b.dtype == dtype]
        first = position == 0
        marks = notes.LEVELS * notes.levels.numel() if first and notes is not None else 0
        extra = sum(b.numel() for b in mine) + (sum(_pieces(b) for b in integers) if first else 0)
        where = local_part(group[0]).device if group else device
        flat = torch.zeros(sum(sizes) + len(group) + marks + extra, dtype=dtype, device=where)
        item = Packed(flat, group, sizes, marks, mine, integers if first else [])
        offset = 0
        for parameter, size in zip(group, sizes):
            if parameter.grad is not None:
                flat[offset:offset + size].copy_(local_part(parameter.grad).reshape(-1))
            offset += size
        flat[offset:offset + len(group)] = torch.tensor([p.grad is not None for p in group], dtype=dtype)
        offset += len(group)
        if marks and notes is not None:
            thresholds = torch.arange(1, notes.LEVELS + 1, device=notes.levels.device)
            flat[offset:offset + marks] = (notes.levels.view(-1, 1) >= thresholds).reshape(-1).to(where, dtype)
            offset += marks
        if sends_buffers:
            for buffer in item.buffers:
                flat[offset:offset + buffer.numel()].copy_(buffer.detach().reshape(-1))
                offset += buffer.numel()
            for integer in item.integers:
                pieces = _to_pieces(integer, dtype)
                flat[offset:offset + pieces.numel()].copy_(pieces)
                offset += pieces.numel()
        packed.append(item)
    return packed


def unpack(item: Packed, participants: int, notes: Levels | None) -> list[tuple[Tensor, Tensor]]:
    """After the sum across groups: every parameter's gradient averaged over the ``participants`` (``None`` where no
    group gave one), the notes' levels (the maximum over the groups), and the buffers' values as pairs ``(buffer,
    value)`` (applied once the step commits)."""
    flat = item.flat
    given = flat[item._flags_at:item._flags_at + len(item.parameters)].tolist()  # (one read, not one per parameter)
    offset = 0
    for parameter, size, anywhere in zip(item.parameters, item.sizes, given):
        summed = flat[offset:offset + size]
        offset += size
        if anywhere == 0:
            parameter.grad = None
            continue
        averaged = summed.div_(participants)
        if parameter.grad is not None:
            local_part(parameter.grad).copy_(averaged.view_as(local_part(parameter.grad)))
        else:
            parameter.grad = _grad_like(parameter, averaged)
    if item.marks and notes is not None:
        start = item._flags_at + len(item.parameters)
        marked = flat[start:start + item.marks].view(-1, notes.LEVELS) > 0
        notes.levels = marked.sum(dim=1).to(notes.levels.device, torch.uint8)
    values = []
    offset = item._buffers_at
    for buffer in item.buffers:
        values.append((buffer, flat[offset:offset + buffer.numel()].view(buffer.shape).to(buffer.device)))
        offset += buffer.numel()
    for integer in item.integers:
        count = _pieces(integer)
        values.append((integer, _from_pieces(flat[offset:offset + count], integer).to(integer.device)))
        offset += count
    return values


def _grad_like(parameter: Tensor, values: Tensor) -> Tensor:
    """A gradient for ``parameter`` (none on this group) holding ``values``, laid out as the parameter."""
    if isinstance(parameter, DTensor):
        shard = values.view(parameter.to_local().shape).clone()
        return DTensor.from_local(shard, parameter.device_mesh, parameter.placements, run_check=False,
                                  shape=parameter.shape, stride=parameter.stride())
    return values.view(parameter.shape).clone()


__all__ = ["Packed", "pack", "unpack"]
