"""Pieces of a tensor that one rank holds, in the form ``torch.distributed.checkpoint`` writes as they are.

An engine whose shards are not rectangular blocks of each parameter (FSDP1 shards a *flat* concatenation of
parameters: a rank's part of a parameter is a range of its row-major elements) can still hand DCP its shards without
gathering anything: the range is a few rectangles (:func:`flat_range_boxes`), each written as one chunk. The chunks
of all ranks tile the tensor, so DCP loads them at any other layout, degree or engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The rectangles ``(offsets, sizes)`` that elements ``[start, stop)`` of a row-major tensor of ``shape`` form,
    in order; each is a contiguous run of those elements (at most two per dimension)."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner

    def within(row: int, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo, hi)]

    if first == last:
        return within(first, start - first * inner, stop - first * inner)
    boxes = []
    full_from, full_to = first, last + 1
    if start % inner:
        boxes += within(first, start % inner, inner)
        full_from = first + 1
    tail = []
    if stop % inner:
        tail = within(last, 0, stop % inner)
        full_to = last
    if full_to > full_from:
        boxes.append(((full_from, *([0] * (len(shape) - 1))), (full_to - full_from, *shape[1:])))
    return boxes + tail


@dataclass(frozen=True)
class TensorChunks:
    """This rank's pieces of one tensor of ``shape``: ``(offsets, data)`` pairs, ``data`` of the piece's size.

    Implements DCP's write protocol (``__create_write_items__``): each piece is one chunk. A rank with no piece
    declares nothing; the other ranks' pieces cover the tensor.
    """

    shape: torch.Size
    pieces: tuple[tuple[tuple[int, ...], torch.Tensor], ...]

    @classmethod
    def of_flat_range(cls, shape: Sequence[int], start: int, local: torch.Tensor) -> TensorChunks:
        """The pieces of a tensor of ``shape`` whose row-major elements ``[start, start + local.numel())`` are the
        1-D tensor ``local`` (views of it, no copy)."""
        pieces, position = [], 0
        for offsets, sizes in flat_range_boxes(shape, start, start + local.numel()):
            count = math.prod(sizes)
            pieces.append((offsets, local[position:position + count].view(sizes)))
            position += count
        return cls(torch.Size(shape), tuple(pieces))

    def map_tensors(self, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> TensorChunks:
        """The same pieces with ``fn(data, index)`` as their data (e.g. a copy)."""
        return TensorChunks(self.shape, tuple((offsets, fn(data, i)) for i, (offsets, data) in enumerate(self.pieces)))

    def tensor_at(self, offsets: Sequence[int]) -> torch.Tensor:
        """The data of the piece at ``offsets``."""
        wanted = tuple(offsets)
        for start, data in self.pieces:
            if start == wanted:
                return data
        raise KeyError(f"no piece at offsets {wanted} of a tensor of shape {tuple(self.shape)}")

    @property
    def dtype(self) -> torch.dtype | None:
        return self.pieces[0][1].dtype if self.pieces else None

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=data.size()),
                    properties=TensorProperties.create_from_tensor(data),
                    size=self.shape,
                ),
            )
            for offsets, data in self.pieces
        ]


__all__ = ["TensorChunks", "flat_range_boxes"]
