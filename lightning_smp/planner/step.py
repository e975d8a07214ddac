"""What one step of FSDP holds and sends, per engine: the unsharded parameters at the step's peak, the
accumulation buffers, and the textbook traffic of one optimizer step (the figure the memory report checks).

Pure functions over the units (:func:`~.state.fsdp_units`) and a :class:`~lightning_smp.degree.Layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.nn import Parameter

from lightning_smp.names import DEFER_ALL_REDUCE, HYBRID_SHARD_ZERO2, NO_SHARD, NO_SYNC, SHARD_GRAD_OP
from lightning_smp.planner.state import _fsdp2_chunk


def dtype_bytes(precision: str, element_size: int) -> tuple[int, int]:
    """Bytes per element of (gathered parameters, reduced gradients) under a Lightning precision: ``16-mixed``,
    ``bf16-mixed`` and the ``*-true`` 16-bit ones gather and reduce in 16 bits (Lightning's FSDP mixed-precision
    config: ``param_dtype = reduce_dtype`` = the 16-bit type), ``32-true`` in the parameters' own type."""
    if "16" in precision:
        return 2, 2
    return element_size, element_size


def textbook(units: Sequence[Sequence[Parameter]], layout: Any, fsdp_version: int, micro_batches: int,
              accumulation: str, precision: str) -> dict[str, dict[str, dict[str, float]]]:
    from lightning_smp.accounting.comm import FSDPUnitSpec, accumulation_passes, fsdp_step_textbook
    from lightning_smp.accounting.shards import flat_param_numel

    shard = layout.shard
    group = layout.world_size if layout.sharding_strategy == NO_SHARD else shard
    specs = []
    for index, unit in enumerate(units):
        gather, reduce = dtype_bytes(precision, unit[0].element_size())
        reduced: int | None = None
        if fsdp_version == 1:
            padded = flat_param_numel([p.numel() for p in unit], group, unit[0].element_size())
        else:
            padded = reduced = 0
            for p in unit:
                _, per_rank, rest = _fsdp2_chunk(p, shard)
                padded += per_rank * rest * shard
                if p.requires_grad:  # FSDP2 reduces only what has gradients
                    reduced += per_rank * rest * shard
        specs.append(FSDPUnitSpec(padded_numel=padded, is_root=index == len(units) - 1, gather_bytes=gather,
                                  reduce_bytes=reduce, reduce_numel=reduced))
    scattered, synced = accumulation_passes(accumulation, micro_batches)
    replicas = layout.world_size if layout.sharding_strategy == NO_SHARD else layout.replicate
    # the bitmap of parameters no rank used: one byte per parameter (FSDP1: with use_orig_params, the default)
    return fsdp_step_textbook(specs, layout.sharding_strategy, shard, replicas, micro_batches, synced_passes=synced,
                              reduce_scatter_passes=scattered, keep_gathered_unsynced=fsdp_version == 1,
                              unused_bitmap_bytes=sum(len(unit) for unit in units))


def gathered_bytes(units: Sequence[Sequence[Parameter]], root_is_last: bool, layout: Any, fsdp_version: int,
              precision: str) -> int:
    """Unsharded parameters held at a step's peak, which comes at the end of forward, when the activations are all
    alive (measured, see ``benchmarks/planner_peak.py``; a backward holds one more unit but has freed activations):

    - FSDP1: the root (kept gathered from forward to backward) and the unit computing; under ZeRO-2 every unit (none
      is freed after forward); nothing under ``NO_SHARD``, which computes on its own full copy;
    - FSDP2: the same, but a gathered unit is its all-gather buffer and the unsharded parameters copied out of it,
      and the next unit's buffer is already prefetched: the root, three times the unit computing; ZeRO-2 every unit
      and two buffers; at a shard group of one rank the unsharded copies of the root and the unit computing.
    """
    sizes = [sum(p.numel() for p in unit) * dtype_bytes(precision, unit[0].element_size())[0] for unit in units]
    root = sizes[-1] if root_is_last and sizes else 0
    blocks = sizes[:-1] if root_is_last else sizes
    largest = max(blocks, default=0)
    zero2 = layout.sharding_strategy in (SHARD_GRAD_OP, HYBRID_SHARD_ZERO2)
    unsharded = layout.shard <= 1 or layout.sharding_strategy == NO_SHARD
    if fsdp_version == 1:
        return 0 if unsharded else sum(sizes) if zero2 else root + largest
    if unsharded:
        return root + largest
    return sum(sizes) + 2 * largest if zero2 else root + 3 * largest


def transient_bytes(units: Sequence[Sequence[Parameter]], root_is_last: bool, layout: Any, fsdp_version: int,
               micro_batches: int, accumulation: str, precision: str) -> int:
    transient = gathered_bytes(units, root_is_last, layout, fsdp_version, precision)
    full_grads = sum(p.numel() * p.element_size() for unit in units for p in unit if p.requires_grad)
    if micro_batches > 1 and accumulation == NO_SYNC and layout.shard > 1:
        transient += full_grads  # every rank holds the unsharded gradient between micro-batches
    elif micro_batches > 1 and accumulation == DEFER_ALL_REDUCE and layout.shard > 1:
        transient += full_grads // layout.shard  # FSDP2's partial-reduce buffer
    return transient


__all__ = ["dtype_bytes", "gathered_bytes", "textbook", "transient_bytes"]
