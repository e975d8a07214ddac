"""The DDP engine's rules over parameter shapes, for the planner: nothing sharded, nothing gathered, DDP's buckets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch.nn import Parameter

from lightning_smp.accumulation import accumulation_mode
from lightning_smp.degree import Layout
from lightning_smp.engines.prediction import Held, UnitLayout
from lightning_smp.engines.units import PolicyUnits

if TYPE_CHECKING:
    from lightning_smp.engines.textbook import CommFigure

#: bytes per parameter of DDP's used-parameter bitmap (``find_unused_parameters``: an ``int32`` per parameter)
BITMAP_BYTES = 4


class DDPPrediction(PolicyUnits):
    """The planner's rules: every rank holds every parameter, its gradient and its optimizer state, whole; nothing is
    gathered; the gradients cross the ranks once per synced backward in DDP's buckets."""

    keeps_gathered_unsynced = False

    def held(self, unit: Sequence[Parameter], shard: int, position: int, group: int, state_tensors: int,
             state_fixed: int) -> Held:
        params = sum(p.numel() * p.element_size() for p in unit)
        trainable = [p for p in unit if p.requires_grad]
        grads = sum(p.numel() * p.element_size() for p in trainable)
        return Held(params, grads, sum(p.numel() * p.element_size() * state_tensors + state_fixed for p in trainable))

    def unit_layout(self, unit: Sequence[Parameter], shard: int, group: int, gather_bytes: int) -> UnitLayout:
        return UnitLayout(sum(p.numel() for p in unit), sum(p.numel() for p in unit if p.requires_grad))

    def gathered_bytes(self, unit_bytes: Sequence[int], root_bytes: int, zero2: bool, unsharded: bool) -> int:
        return 0  # each rank computes on its own whole copy

    def step_textbook(self, units: Sequence[Sequence[Parameter]], layout: Layout, micro_batches: int,
                      accumulation: str, precision: str) -> CommFigure:
        """DDP's traffic: the gradients (in the parameters' dtype: autocast leaves them in it) and the bitmap, once
        per synced pass, in one bucket per 25 MiB (DDP's default cap; the count is only the latency term)."""
        from lightning_smp.engines.textbook import ddp_step_textbook

        trainable = [p for unit in units for p in unit if p.requires_grad]
        grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
        buckets = max(1, -(-grad_bytes // (25 * 1024 * 1024)))
        return ddp_step_textbook(grad_bytes, layout.world_size, buckets,
                                 synced_passes=accumulation_mode(accumulation).passes(micro_batches)[1],
                                 used_bitmap_bytes=len(trainable) * BITMAP_BYTES)
