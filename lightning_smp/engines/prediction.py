"""What an engine predicts of itself before anything is built: the planner's side of the engine seam.

The planner (:mod:`lightning_smp.planner`) works on parameter shapes alone (a model on the meta device) and asks the
engine of the run, through :class:`Prediction`, how it lays a unit out on a rank, what it keeps gathered at the step's
peak and how it communicates; so that a prediction equals what the memory report then measures, to the byte, and a
new engine brings its own rules instead of a branch in the planner. Each engine's rules live beside it
(:mod:`.fsdp1_prediction`, :mod:`.fsdp2_prediction`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch.nn import Module, Parameter

from lightning_smp.accumulation import accumulation_mode
from lightning_smp.names import NO_SHARD

if TYPE_CHECKING:
    from lightning_smp.degree import Layout
    from lightning_smp.engines.textbook import CommFigure


@dataclass(frozen=True)
class UnitLayout:
    """One unit's sizes under an engine, in elements. ``padded``: all ranks' shards together, padding included (what
    an all-gather moves); ``reduced``: the part of it that is reduced (``None``: all of it)."""

    padded: int
    reduced: int | None = None


@dataclass(frozen=True)
class Held:
    """What one rank holds of one unit at the optimizer step, in bytes."""

    params: int
    grads: int
    optimizer: int


class Prediction(Protocol):
    """An engine's layout rules, over parameter shapes (no process group, no data).

    Args shared by the methods: ``unit``, the parameters of one unit in the order the engine flattens them;
    ``shard``, the ranks a parameter is split over; ``group``, the ranks of the unit's process group (the world
    under ``NO_SHARD``, else ``shard``).
    """

    #: whether a unit whose gradients are not synced in a micro-batch stays gathered until the next (FSDP1's
    #: ``no_sync`` keeps the unsharded parameters; FSDP2 reshards after every backward)
    keeps_gathered_unsynced: bool

    def units_of(self, model: Module, auto_wrap_policy: Any) -> list[Module]:
        """The submodules of ``model`` this engine makes units of (innermost first, the root aside): the planner's
        units (:func:`~lightning_smp.planner.state.fsdp_units`)."""
        ...

    def held(self, unit: Sequence[Parameter], shard: int, position: int, group: int, state_tensors: int,
             state_fixed: int) -> Held:
        """What the rank at ``position`` of its shard group holds of ``unit``, with an optimizer of
        ``state_tensors`` tensors shaped like each trainable parameter and ``state_fixed`` bytes per parameter."""
        ...

    def unit_layout(self, unit: Sequence[Parameter], shard: int, group: int, gather_bytes: int) -> UnitLayout:
        """The unit's sizes when its parameters are gathered in elements of ``gather_bytes`` bytes."""
        ...

    def gathered_bytes(self, unit_bytes: Sequence[int], root_bytes: int, zero2: bool, unsharded: bool) -> int:
        """Unsharded parameters held at the step's peak (the end of forward), from each non-root unit's gathered
        size and the root's (``0`` when the root holds no parameters of its own); ``zero2``: SHARD_GRAD_OP or
        _HYBRID_SHARD_ZERO2; ``unsharded``: no sharding at all (a shard group of one, or ``NO_SHARD``)."""
        ...

    def step_textbook(self, units: Sequence[Sequence[Parameter]], layout: Layout, micro_batches: int,
                      accumulation: str, precision: str) -> CommFigure:
        """The textbook traffic of one optimizer step of ``micro_batches`` accumulated as ``accumulation`` says, under
        a Lightning ``precision``; ``units`` in the order :func:`~lightning_smp.planner.state.fsdp_units` gives
        them (the root's last)."""
        ...


def dtype_bytes(precision: str, element_size: int) -> tuple[int, int]:
    """Bytes per element of (gathered parameters, reduced gradients) under a Lightning precision for FSDP, as both
    engines run it: ``16-mixed`` and ``bf16-mixed`` gather in 16 bits and reduce in fp32
    (:func:`lightning_smp.precision.mixed_precision_config`, ``engines/fsdp2_options.py``: DDP's numbers), the
    ``*-true`` 16-bit ones gather and reduce in 16 bits, ``32-true`` in the parameters' own type."""
    if "mixed" in precision:
        return 2, 4
    if "16" in precision:
        return 2, 2
    return element_size, element_size


def fsdp_textbook(prediction: Prediction, units: Sequence[Sequence[Parameter]], layout: Layout, micro_batches: int,
                  accumulation: str, precision: str) -> CommFigure:
    """:meth:`Prediction.step_textbook` of the FSDP engines: all-gathers, reduce-scatters and all-reduces per unit
    (:func:`~lightning_smp.engines.textbook.fsdp_step_textbook`), over the unit sizes of ``prediction``."""
    from lightning_smp.engines.textbook import FSDPUnitSpec, fsdp_step_textbook

    shard = layout.shard
    group = layout.world_size if layout.sharding_strategy == NO_SHARD else shard
    specs = []
    for index, unit in enumerate(units):
        gather, reduce = dtype_bytes(precision, unit[0].element_size())
        sizes = prediction.unit_layout(unit, shard, group, gather)
        specs.append(FSDPUnitSpec(padded_numel=sizes.padded, is_root=index == len(units) - 1, gather_bytes=gather,
                                  reduce_bytes=reduce, reduce_numel=sizes.reduced))
    scattered, synced = accumulation_mode(accumulation).passes(micro_batches)
    replicas = layout.world_size if layout.sharding_strategy == NO_SHARD else layout.replicate
    # the bitmap of parameters no rank used: one byte per parameter
    return fsdp_step_textbook(specs, layout.sharding_strategy, shard, replicas, micro_batches, synced_passes=synced,
                              reduce_scatter_passes=scattered,
                              keep_gathered_unsynced=prediction.keeps_gathered_unsynced,
                              unused_bitmap_bytes=sum(len(unit) for unit in units))


__all__ = ["Held", "Prediction", "UnitLayout", "dtype_bytes", "fsdp_textbook"]
