"""FSDP2's layout rules for the planner (:class:`~.prediction.Prediction`).

Each parameter is split along dim 0 by ``torch.chunk`` and padded to ``ceil(rows / shard)`` rows per rank; the
gradient is padded the same way, the optimizer state is the unpadded local chunk. Only parameters that require a
gradient are reduced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch.nn import Parameter

from lightning_smp.engines.prediction import Held, UnitLayout, fsdp_textbook
from lightning_smp.engines.units import PolicyUnits

if TYPE_CHECKING:
    from lightning_smp.degree import Layout
    from lightning_smp.engines.textbook import CommFigure


def chunk(p: Parameter, shard: int) -> tuple[int, int, int]:
    """``(rows, rows per rank after padding, elements per row)`` of ``p`` under FSDP2's ``Shard(0)`` over ``shard``."""
    rows = p.shape[0] if p.dim() else 1
    rest = math.prod(p.shape[1:]) if p.dim() else 1
    return rows, math.ceil(rows / shard), rest


class FSDP2Prediction(PolicyUnits):
    keeps_gathered_unsynced = False

    def held(self, unit: Sequence[Parameter], shard: int, position: int, group: int, state_tensors: int,
             state_fixed: int) -> Held:
        params = grads = optimizer = 0
        for p in unit:
            rows, chunk_rows, rest = chunk(p, shard)
            padded = chunk_rows * rest * p.element_size()
            local = max(0, min(chunk_rows, rows - position * chunk_rows)) * rest * p.element_size()
            params += padded
            if p.requires_grad:
                grads += padded  # the reduce-scatter output, padded like the parameter
                optimizer += local * state_tensors + state_fixed  # the unpadded chunk's; a 0-d step even when empty
        return Held(params, grads, optimizer)

    def unit_layout(self, unit: Sequence[Parameter], shard: int, group: int, gather_bytes: int) -> UnitLayout:
        padded = reduced = 0
        for p in unit:
            _, per_rank, rest = chunk(p, shard)
            padded += per_rank * rest * shard
            if p.requires_grad:  # FSDP2 reduces only what has gradients
                reduced += per_rank * rest * shard
        return UnitLayout(padded, reduced)

    def gathered_bytes(self, unit_bytes: Sequence[int], root_bytes: int, zero2: bool, unsharded: bool) -> int:
        # a gathered unit is its all-gather buffer and the unsharded parameters copied out of it, and the next
        # unit's buffer is already prefetched: the root and three times the unit computing; ZeRO-2 every unit and two
        # buffers; without sharding the unsharded copies of the root and the unit computing
        largest = max(unit_bytes, default=0)
        if unsharded:
            return root_bytes + largest
        return root_bytes + sum(unit_bytes) + 2 * largest if zero2 else root_bytes + 3 * largest

    def step_textbook(self, units: Sequence[Sequence[Parameter]], layout: Layout, micro_batches: int,
                      accumulation: str, precision: str) -> CommFigure:
        return fsdp_textbook(self, units, layout, micro_batches, accumulation, precision)


__all__ = ["FSDP2Prediction", "chunk"]
