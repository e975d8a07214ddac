"""FSDP1's layout rules for the planner (:class:`~.prediction.Prediction`).

The parameters of each unit are flattened (16-byte aligned) and padded to a multiple of the unit's process group
(:mod:`lightning_smp.engines.fsdp1.flat`); every rank holds an equal chunk of each unit, its gradient too, and the
optimizer state of the parts of the original parameters that fall into its chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch.nn import Parameter

from lightning_smp.engines.fsdp1.flat import flat_param_numel, local_param_numels, local_shard_numel
from lightning_smp.engines.prediction import Held, UnitLayout, fsdp_textbook
from lightning_smp.engines.units import PolicyUnits

if TYPE_CHECKING:
    from lightning_smp.degree import Layout
    from lightning_smp.engines.textbook import CommFigure


class FSDP1Prediction(PolicyUnits):
    keeps_gathered_unsynced = True

    def held(self, unit: Sequence[Parameter], shard: int, position: int, group: int, state_tensors: int,
             state_fixed: int) -> Held:
        size = unit[0].element_size()
        numels = [p.numel() for p in unit]
        chunk = local_shard_numel(numels, shard, group, size) * size
        grads = chunk if any(p.requires_grad for p in unit) else 0  # one flat gradient per unit
        local = local_param_numels(numels, shard, position, group, size)
        optimizer = sum(n * state_tensors * size + state_fixed for p, n in zip(unit, local) if n and p.requires_grad)
        return Held(chunk, grads, optimizer)

    def unit_layout(self, unit: Sequence[Parameter], shard: int, group: int, gather_bytes: int) -> UnitLayout:
        # FSDP1 aligns each parameter in the flat parameter for the forward's dtype (16-bit under mixed precision)
        return UnitLayout(flat_param_numel([p.numel() for p in unit], group, gather_bytes))

    def gathered_bytes(self, unit_bytes: Sequence[int], root_bytes: int, zero2: bool, unsharded: bool) -> int:
        # the root (kept gathered from forward to backward) and the unit computing; under ZeRO-2 every unit (none
        # is freed after forward); nothing without sharding, where each rank computes on its own full copy
        if unsharded:
            return 0
        return root_bytes + sum(unit_bytes) if zero2 else root_bytes + max(unit_bytes, default=0)

    def step_textbook(self, units: Sequence[Sequence[Parameter]], layout: Layout, micro_batches: int,
                      accumulation: str, precision: str) -> CommFigure:
        return fsdp_textbook(self, units, layout, micro_batches, accumulation, precision)


__all__ = ["FSDP1Prediction"]
