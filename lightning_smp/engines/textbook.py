"""Collective accounting: the textbook figure of one optimizer step, split by mesh axis, and the conventions that
the counted figures follow too.

Pure "textbook" functions (:func:`fsdp_step_textbook`, :func:`ddp_step_textbook`, :func:`ring_bytes`) give the
figure FSDP1 / FSDP2 / DDP should produce for one optimizer step, usable without Lightning; what a rank really sends
is counted by :class:`~lightning_smp.accounting.counter.CommCounter`.

Conventions (the same for counts and textbook figures, so they compare one to one):

- **logical bytes** of a collective = the size of its full buffer: the gathered output of an all-gather, the
  unreduced input of a reduce-scatter, the tensor of an all-reduce or broadcast (the larger of the op's input and
  output). This is what ``nccl-tests`` calls the size of a collective.
- **ring bytes** = what one rank sends on a ring: ``(n-1)/n`` of the logical bytes for all-gather, reduce-scatter and
  broadcast, ``2(n-1)/n`` for all-reduce, ``n`` being the size of the group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from lightning_smp.collectives import ring_bytes
from lightning_smp.names import (
    FULL_SHARD,
    HYBRID_SHARD,
    HYBRID_SHARD_ZERO2,
    NO_SHARD,
    REPLICATE_AXIS,
    SHARD_AXIS,
    SHARD_GRAD_OP,
)

#: Operation names in counts and textbook figures, in display order.
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "other")
#: ``{axis: {op: {"count", "bytes", "ring_bytes"}}}``: a textbook figure of one step.
CommFigure = dict[str, dict[str, dict[str, float]]]



# ---------------------------------------------------------------------------------------------- textbook figures


@dataclass(frozen=True)
class FSDPUnitSpec:
    """One FSDP unit as far as communication goes.

    Attributes:
        padded_numel: elements of the unit's unsharded flat parameter, padding included
            (:func:`lightning_smp.engines.fsdp1.flat.flat_param_numel`).
        is_root: the root unit keeps its parameters gathered from forward to backward (no second all-gather).
        gather_bytes: element size of the all-gathered parameters (the forward/backward dtype).
        reduce_bytes: element size of the reduced gradients (the reduce dtype).
    """

    padded_numel: int
    is_root: bool = False
    gather_bytes: int = 4
    reduce_bytes: int = 4
    #: elements of the gradients the unit reduces, padding included, when fewer than ``padded_numel`` (FSDP2
    #: reduces only the parameters that require gradients); ``None``: all of them (FSDP1 reduces the flat gradient)
    reduce_numel: int | None = None


def _new_figure(axes: Iterable[str]) -> CommFigure:
    return {axis: {op: {"count": 0, "bytes": 0, "ring_bytes": 0.0} for op in OPS} for axis in axes}


def _add(figure: dict, axis: str, op: str, count: int, size: int, group_size: int) -> None:
    entry = figure[axis][op]
    entry["count"] += count
    entry["bytes"] += count * size
    entry["ring_bytes"] += count * ring_bytes(op, size, group_size)


def fsdp_step_textbook(
    units: Sequence[FSDPUnitSpec],
    sharding_strategy: str,
    shard: int,
    replicate: int,
    backward_passes: int = 1,
    synced_passes: int | None = None,
    shard_axis: str = SHARD_AXIS,
    replicate_axis: str = REPLICATE_AXIS,
    reduce_scatter_passes: int | None = None,
    root_gathered: bool = False,
    keep_gathered_unsynced: bool = False,
    unused_bitmap_bytes: int = 0,
) -> CommFigure:
    """What FSDP issues per rank in one optimizer step: ``{axis: {op: {"count", "bytes", "ring_bytes"}}}``.

    An optimizer step runs ``backward_passes`` forward+backward passes (micro-batches of gradient accumulation), of
    which ``synced_passes`` (default: all) run the cross-replica all-reduce and ``reduce_scatter_passes`` (default:
    ``synced_passes``) the reduce-scatter inside the shard group. Lightning's loop runs every micro-batch but the last
    under ``no_sync`` (neither), so there both are 1; FSDP2's deferred all-reduce (``set_requires_all_reduce``)
    reduce-scatters on every pass and all-reduces on the last (``reduce_scatter_passes=backward_passes``,
    ``synced_passes=1``). Per unit, FSDP1 and FSDP2 alike:

    - ``FULL_SHARD`` / ``HYBRID_SHARD``: one all-gather in forward and one more in backward for a non-root unit
      (the root keeps its parameters gathered until backward), per pass; one reduce-scatter of the full gradient
      per reducing pass; all inside the shard group;
    - ``SHARD_GRAD_OP`` / ``_HYBRID_SHARD_ZERO2``: one all-gather per pass (parameters stay gathered until
      backward) and one reduce-scatter per reducing pass, inside the shard group;
    - the hybrid strategies add one all-reduce of the ``1/shard`` gradient shard across replicas per synced pass;
    - ``NO_SHARD``: one all-reduce of the full gradient across replicas (the whole world) per synced pass.

    ``root_gathered``: the root unit's parameters are still gathered when the step begins, because the last thing
    before it was a forward without backward (Lightning's validation sanity check, or a validation run); the step
    then skips the root's first all-gather. ``keep_gathered_unsynced``: FSDP1 keeps a ZeRO-2 unit's parameters
    gathered after a backward under ``no_sync`` (it frees them only after a synced one), so the micro-batches before
    the last gather once in all. Units without parameters issue nothing and are left out of ``units``.

    ``unused_bitmap_bytes``: before the optimizer step, one all-reduce of one byte per parameter on each axis of more
    than one rank (shard group, then replicas), which finds the parameters no rank used
    (``lightning_smp.engines.unused``).
    """
    synced = backward_passes if synced_passes is None else synced_passes
    scattered = synced if reduce_scatter_passes is None else reduce_scatter_passes
    figure = _new_figure([shard_axis, replicate_axis])
    for unit in units:
        gather = unit.padded_numel * unit.gather_bytes
        grad = (unit.padded_numel if unit.reduce_numel is None else unit.reduce_numel) * unit.reduce_bytes
        if sharding_strategy == NO_SHARD:
            _add(figure, replicate_axis, "all_reduce", synced, grad, replicate)
            continue
        if sharding_strategy in (FULL_SHARD, HYBRID_SHARD):
            gathers = 1 if unit.is_root else 2
        elif sharding_strategy in (SHARD_GRAD_OP, HYBRID_SHARD_ZERO2):
            gathers = 1
        else:
            raise ValueError(f"unknown sharding_strategy {sharding_strategy!r}")
        gathering_passes = backward_passes
        zero2 = sharding_strategy in (SHARD_GRAD_OP, HYBRID_SHARD_ZERO2)
        if keep_gathered_unsynced and zero2 and synced < backward_passes:
            gathering_passes = synced  # the unsynced passes keep the parameters the first one gathered
        skipped = 1 if root_gathered and unit.is_root else 0
        _add(figure, shard_axis, "all_gather", gathers * gathering_passes - skipped, gather, shard)
        _add(figure, shard_axis, "reduce_scatter", scattered, grad, shard)
        if sharding_strategy in (HYBRID_SHARD, HYBRID_SHARD_ZERO2):
            _add(figure, replicate_axis, "all_reduce", synced, grad // shard, replicate)
    if unused_bitmap_bytes:
        axes = [(replicate_axis, replicate)] if sharding_strategy == NO_SHARD else [
            (shard_axis, shard), (replicate_axis, replicate)]
        for axis, size in axes:
            if size > 1:
                _add(figure, axis, "all_reduce", 1, unused_bitmap_bytes, size)
    return figure


def ddp_step_textbook(
    grad_bytes: int, world_size: int, buckets: int = 1, replicate_axis: str = REPLICATE_AXIS, *,
    synced_passes: int = 1, used_bitmap_bytes: int = 0, shard_axis: str = SHARD_AXIS,
) -> CommFigure:
    """What DDP issues per rank in one optimizer step: all-reduces of every gradient across replicas, one per bucket,
    per synced pass; with ``find_unused_parameters``, one more of its used-parameter bitmap (``used_bitmap_bytes``,
    4 per parameter) per synced pass. The shard axis is there, empty, as in the FSDP figures (nothing is sharded).

    Lightning runs gradient accumulation under DDP's ``no_sync``, so only the last micro-batch communicates
    (``synced_passes=1``).
    """
    figure = _new_figure([shard_axis, replicate_axis])
    entry = figure[replicate_axis]["all_reduce"]
    entry["count"] = buckets * synced_passes
    entry["bytes"] = grad_bytes * synced_passes
    entry["ring_bytes"] = ring_bytes("all_reduce", grad_bytes * synced_passes, world_size)
    if used_bitmap_bytes:
        _add(figure, replicate_axis, "all_reduce", synced_passes, used_bitmap_bytes, world_size)
    return figure


def ddp_bucket_count(model: torch.nn.Module) -> int | None:
    """Gradient buckets a ``DistributedDataParallel`` model really all-reduces per step, ``None`` for other models.

    Which parameters share a bucket is DDP's runtime decision (a bucket closes after the parameter that crosses the
    cap, a parameter larger than the cap gets its own, and the buckets are rebuilt after the first step), so the
    count is read from DDP itself rather than estimated from the caps.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return None
    data = model._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
    return len(str(sizes).split(",")) if sizes else None


__all__ = [
    "OPS",
    "CommFigure",
    "FSDPUnitSpec",
    "ddp_bucket_count",
    "ddp_step_textbook",
    "fsdp_step_textbook",
    "ring_bytes",
]
