"""What one step of FSDP holds and sends: the unsharded parameters at the step's peak, the accumulation buffers,
and the textbook traffic of one optimizer step (the figure the memory report checks).

Pure functions over the units (:func:`~.state.fsdp_units`), a :class:`~lightning_smp.degree.Layout` and the engine's
layout rules (:class:`~lightning_smp.engines.prediction.Prediction`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.nn import Parameter

from lightning_smp.accumulation import accumulation_mode
from lightning_smp.engines.prediction import Prediction, dtype_bytes
from lightning_smp.names import HYBRID_SHARD_ZERO2, NO_SHARD, SHARD_GRAD_OP


def textbook(units: Sequence[Sequence[Parameter]], layout: Any, prediction: Prediction, micro_batches: int,
             accumulation: str, precision: str) -> dict[str, dict[str, dict[str, float]]]:
    """The textbook traffic of one optimizer step, by the engine's rule
    (:meth:`~lightning_smp.engines.prediction.Prediction.step_textbook`)."""
    return prediction.step_textbook(units, layout, micro_batches, accumulation, precision)


def gathered_bytes(units: Sequence[Sequence[Parameter]], root_is_last: bool, layout: Any, prediction: Prediction,
                   precision: str) -> int:
    """Unsharded parameters held at a step's peak, which comes at the end of forward, when the activations are all
    alive (measured, see ``benchmarks/planner_peak.py``; a backward holds one more unit but has freed activations):
    the engine's rule (:meth:`~lightning_smp.engines.prediction.Prediction.gathered_bytes`) over each unit's size."""
    sizes = [sum(p.numel() for p in unit) * dtype_bytes(precision, unit[0].element_size())[0] for unit in units]
    root = sizes[-1] if root_is_last and sizes else 0
    blocks = sizes[:-1] if root_is_last else sizes
    zero2 = layout.sharding_strategy in (SHARD_GRAD_OP, HYBRID_SHARD_ZERO2)
    unsharded = layout.shard <= 1 or layout.sharding_strategy == NO_SHARD
    return prediction.gathered_bytes(blocks, root, zero2, unsharded)


def transient_bytes(units: Sequence[Sequence[Parameter]], root_is_last: bool, layout: Any, prediction: Prediction,
                    micro_batches: int, accumulation: str, precision: str) -> int:
    transient = gathered_bytes(units, root_is_last, layout, prediction, precision)
    full_grads = sum(p.numel() * p.element_size() for unit in units for p in unit if p.requires_grad)
    if micro_batches > 1:  # what the mode holds between micro-batches: the unsharded gradient, or a partial sum
        transient += accumulation_mode(accumulation).held_between(full_grads, layout.shard)
    return transient


__all__ = ["dtype_bytes", "gathered_bytes", "textbook", "transient_bytes"]
