"""Gradient accumulation, every mode described once: what the micro-batches of one optimizer step communicate, and
what a rank holds between them. The engines (their ``accumulation_context``), the textbook figures, the planner
and the warnings read these records; a new mode is a record here and its name in
:data:`~lightning_smp.names.GradientAccumulation` (``docs/architecture.md``, "How to add").

The last micro-batch of a step always reduces in full (reduce-scatter inside the shard group, then the all-reduce
across the replica groups); the modes differ in the micro-batches before it:

=====================  ===============================  ======================  =================================
mode                   each micro-batch before the last  held between them       one step of ``k`` micro-batches
=====================  ===============================  ======================  =================================
``no_sync``            nothing                           the unsharded gradient  1 reduce-scatter, 1 all-reduce
``every_micro_batch``  reduce-scatter and all-reduce     the sharded gradient    ``k`` reduce-scatters and all-reduces
``defer_all_reduce``   reduce-scatter only               a sharded partial sum   ``k`` reduce-scatters, 1 all-reduce
=====================  ===============================  ======================  =================================

With nothing sharded (the DDP engine) a reduce-scatter is nothing and ``defer_all_reduce`` is ``no_sync``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_smp.names import (
    DEFER_ALL_REDUCE,
    EVERY_MICRO_BATCH,
    GRADIENT_ACCUMULATIONS,
    NO_SYNC,
    GradientAccumulation,
)


@dataclass(frozen=True)
class AccumulationMode:
    """What one gradient-accumulation mode does over the micro-batches of an optimizer step.

    Attributes:
        name: the ``gradient_accumulation`` value.
        reduce_scatter_each: every micro-batch reduce-scatters its gradient inside the shard group (else only the
            last): the gradient stays sharded between micro-batches.
        all_reduce_each: every micro-batch also all-reduces its shard across the replica groups (else only the
            last).
        summary: one line for messages.
    """

    name: GradientAccumulation
    reduce_scatter_each: bool
    all_reduce_each: bool
    summary: str

    @property
    def holds_unsharded(self) -> bool:
        """Whether every rank holds the full, unsharded gradient between micro-batches."""
        return not self.reduce_scatter_each

    def passes(self, micro_batches: int) -> tuple[int, int]:
        """``(reduce-scatter passes, all-reduce passes)`` of one optimizer step of ``micro_batches``."""
        return (micro_batches if self.reduce_scatter_each else 1, micro_batches if self.all_reduce_each else 1)

    def held_between(self, gradient_bytes: int, shard: int) -> int:
        """Gradient bytes a rank holds between micro-batches beyond its reduced shard, for a model whose trainable
        parameters take ``gradient_bytes`` unsharded, on shard groups of ``shard`` ranks: the unsharded gradient, a
        ``1/shard`` partial sum waiting for its all-reduce, or nothing."""
        if shard <= 1 or self.all_reduce_each:
            return 0
        return gradient_bytes if self.holds_unsharded else gradient_bytes // shard


#: Every mode, by name, in :data:`~lightning_smp.names.GRADIENT_ACCUMULATIONS`' order.
ACCUMULATION_MODES: dict[GradientAccumulation, AccumulationMode] = {
    NO_SYNC: AccumulationMode(
        NO_SYNC, reduce_scatter_each=False, all_reduce_each=False,
        summary="nothing is reduced before the last micro-batch; every rank holds the full unsharded gradient"),
    EVERY_MICRO_BATCH: AccumulationMode(
        EVERY_MICRO_BATCH, reduce_scatter_each=True, all_reduce_each=True,
        summary="every micro-batch is reduced in full; gradients stay sharded, at k times the traffic"),
    DEFER_ALL_REDUCE: AccumulationMode(
        DEFER_ALL_REDUCE, reduce_scatter_each=True, all_reduce_each=False,
        summary="every micro-batch is reduce-scattered inside the shard group, the replicas all-reduce once on the"
                " last; gradients stay sharded and cross the replicas once per step"),
}
if tuple(ACCUMULATION_MODES) != GRADIENT_ACCUMULATIONS:  # one list of modes: the Literal and the records agree
    raise RuntimeError("lightning_smp.accumulation: the modes described differ from names.GradientAccumulation")


def accumulation_mode(name: str) -> AccumulationMode:
    """The record of mode ``name`` (``ValueError`` for another name: the strategies check theirs when created)."""
    try:
        return ACCUMULATION_MODES[name]  # type: ignore[index]
    except KeyError:
        raise ValueError(f"unknown gradient accumulation {name!r}; valid: {', '.join(GRADIENT_ACCUMULATIONS)}") from None


__all__ = ["ACCUMULATION_MODES", "AccumulationMode", "accumulation_mode"]
