"""What one step of FSDP holds and sends: the unsharded parameters at the step's peak, the accumulation buffers,
and the textbook traffic of one optimizer step (the figure the memory report checks).

Pure functions over the units (:func:`~.state.fsdp_units`), a :class:`~lightning_smp.degree.Layout` and the engine's
layout rules (:class:`~lightning_smp.engines.prediction.Prediction`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.nn import Parameter

from lightning_smp.engines.prediction import Prediction
from lightning_smp.names import DEFER_ALL_REDUCE, HYBRID_SHARD_ZERO2, NO_SHARD, NO_SYNC, SHARD_GRAD_OP


def dtype_bytes(precision: str, element_size: int) -> tuple[int, int]:
    """Bytes per element of (gathered parameters, reduced gradients) under a Lightning precision: ``16-mixed``,
    ``bf16-mixed`` and the ``*-true`` 16-bit ones gather and reduce in 16 bits (Lightning's FSDP mixed-precision
    config: ``param_dtype = reduce_dtype`` = the 16-bit type), ``32-true`` in the parameters' own type."""
    if "16" in precision:
        return 2, 2
    return element_size, element_size


def textbook(units: Sequence[Sequence[Parameter]], layout: Any, prediction: Prediction, micro_batches: int,
              accumulation: str, precision: str) -> dict[str, dict[str, dict[str, float]]]:
    from lightning_smp.accounting.comm import FSDPUnitSpec, accumulation_passes, fsdp_step_textbook

    shard = layout.shard
    group = layout.world_size if layout.sharding_strategy == NO_SHARD else shard
    specs = []
    for index, unit in enumerate(units):
        gather, reduce = dtype_bytes(precision, unit[0].element_size())
        sizes = prediction.unit_layout(unit, shard, group)
        specs.append(FSDPUnitSpec(padded_numel=sizes.padded, is_root=index == len(units) - 1, gather_bytes=gather,
                                  reduce_bytes=reduce, reduce_numel=sizes.reduced))
    scattered, synced = accumulation_passes(accumulation, micro_batches)
    replicas = layout.world_size if layout.sharding_strategy == NO_SHARD else layout.replicate
    # the bitmap of parameters no rank used: one byte per parameter
    return fsdp_step_textbook(specs, layout.sharding_strategy, shard, replicas, micro_batches, synced_passes=synced,
                              reduce_scatter_passes=scattered,
                              keep_gathered_unsynced=prediction.keeps_gathered_unsynced,
                              unused_bitmap_bytes=sum(len(unit) for unit in units))


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
    if micro_batches > 1 and accumulation == NO_SYNC and layout.shard > 1:
        transient += full_grads  # every rank holds the unsharded gradient between micro-batches
    elif micro_batches > 1 and accumulation == DEFER_ALL_REDUCE and layout.shard > 1:
        transient += full_grads // layout.shard  # FSDP2's partial-reduce buffer
    return transient


__all__ = ["dtype_bytes", "gathered_bytes", "textbook", "transient_bytes"]
