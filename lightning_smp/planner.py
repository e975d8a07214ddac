"""Planning the degree, first part: the model state every rank will hold, predicted before anything is built.

Pure arithmetic over a model's parameter shapes (build it on the meta device: a 70B model costs nothing to plan),
for both engines, with the engines' own padding rules, so that the prediction equals what the memory report measures
to the byte:

- FSDP1 (:mod:`lightning_smp.accounting.shards`): the parameters of each unit are flattened (16-byte aligned) and
  padded to a multiple of the shard group; every rank holds an equal chunk of each unit, its gradient too, and the
  optimizer state of the parts of the original parameters that fall into its chunk;
- FSDP2: each parameter is split along dim 0 by ``torch.chunk`` and padded to ``ceil(rows / shard)`` rows per rank;
  the gradient is padded the same way, the optimizer state is the unpadded local chunk.

The units are the ones the engines build: the modules ``auto_wrap_policy`` selects (:func:`wrap_targets`, the same
walk for both engines) and the root with what is left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import Module, Parameter

from lightning_smp.accounting.shards import local_param_numels, local_shard_numel
from lightning_smp.degree import resolve_layout
from lightning_smp.engines.fsdp2 import wrap_targets
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.names import NO_SHARD

#: Optimizer state per trainable parameter: (state tensors shaped like the parameter, bytes of 0-d state).
OPTIMIZER_STATE = {
    "adam": (2, 4),      # exp_avg, exp_avg_sq; a float32 ``step``
    "adamw": (2, 4),
    "sgd": (0, 0),
    "sgd_momentum": (1, 0),  # momentum_buffer
}


def optimizer_state_layout(optimizer: Any) -> tuple[int, int]:
    """``(tensors shaped like the parameter, fixed bytes)`` of an optimizer given by name or as an instance."""
    if isinstance(optimizer, str):
        name = optimizer.lower()
    elif isinstance(optimizer, torch.optim.SGD):
        name = "sgd_momentum" if any(g.get("momentum", 0) for g in optimizer.param_groups) else "sgd"
    elif isinstance(optimizer, torch.optim.AdamW):
        name = "adamw"
    elif isinstance(optimizer, torch.optim.Adam):
        name = "adam"
    else:
        name = type(optimizer).__name__
    if name not in OPTIMIZER_STATE:
        raise HybridShardConfigError(
            f"optimizer={optimizer!r} is not one the planner knows. Valid names: {', '.join(OPTIMIZER_STATE)}"
            " (or an instance of torch.optim.Adam, AdamW or SGD)."
        )
    return OPTIMIZER_STATE[name]


def fsdp_units(model: Module, auto_wrap_policy: Any = None) -> list[list[Parameter]]:
    """The parameters of every unit the engines build, innermost first and the root last, each in the order FSDP
    flattens them (``named_parameters`` order, a shared parameter once, in the first unit that reaches it)."""
    seen: set[int] = set()
    units: list[list[Parameter]] = []
    for module in [*wrap_targets(model, auto_wrap_policy), model]:
        params = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            units.append(params)
    return units


@dataclass(frozen=True)
class RankState:
    """What one rank holds of the model state (bytes), as the memory report measures it."""

    rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def model_state(model: Module, *, world_size: int, hybrid_shard_degree: int, fsdp_version: int = 1,
                auto_wrap_policy: Any = None, optimizer: Any = "adamw",
                sharding_strategy: str = "HYBRID_SHARD") -> list[RankState]:
    """The model state of every rank of ``world_size`` at ``hybrid_shard_degree``, at the optimizer step.

    Parameters, gradients and optimizer state are taken in the dtype the model's parameters have (``bf16-true``:
    build the model in bf16). Every parameter that requires a gradient is assumed to get one.
    """
    layout = resolve_layout(world_size, hybrid_shard_degree, sharding_strategy)
    shard = layout.shard
    group = world_size if layout.sharding_strategy == NO_SHARD else shard
    tensors, fixed = optimizer_state_layout(optimizer)
    units = fsdp_units(model, auto_wrap_policy)
    states = []
    for rank in range(world_size):
        position = rank % shard
        if fsdp_version == 1:
            states.append(_fsdp1_rank(rank, units, shard, position, group, tensors, fixed))
        else:
            states.append(_fsdp2_rank(rank, units, shard, position, tensors, fixed))
    return states


def _fsdp1_rank(rank: int, units: Sequence[Sequence[Parameter]], shard: int, position: int, group: int,
                tensors: int, fixed: int) -> RankState:
    params = grads = optimizer = 0
    for unit in units:
        size = unit[0].element_size()
        numels = [p.numel() for p in unit]
        chunk = local_shard_numel(numels, shard, group, size) * size
        params += chunk
        if any(p.requires_grad for p in unit):
            grads += chunk  # one flat gradient per unit
        local = local_param_numels(numels, shard, position, group, size)
        optimizer += sum(n * tensors * size + fixed for p, n in zip(unit, local) if n and p.requires_grad)
    return RankState(rank, params, grads, optimizer)


def _fsdp2_chunk(p: Parameter, shard: int) -> tuple[int, int, int]:
    """``(rows, rows per rank after padding, elements per row)`` of ``p`` under FSDP2's ``Shard(0)`` over ``shard``."""
    rows = p.shape[0] if p.dim() else 1
    rest = math.prod(p.shape[1:]) if p.dim() else 1
    return rows, math.ceil(rows / shard), rest


def _fsdp2_rank(rank: int, units: Sequence[Sequence[Parameter]], shard: int, position: int, tensors: int,
                fixed: int) -> RankState:
    params = grads = optimizer = 0
    for unit in units:
        for p in unit:
            rows, chunk_rows, rest = _fsdp2_chunk(p, shard)
            padded = chunk_rows * rest * p.element_size()
            local = max(0, min(chunk_rows, rows - position * chunk_rows)) * rest * p.element_size()
            params += padded
            if p.requires_grad:
                grads += padded  # the reduce-scatter output, padded like the parameter
                optimizer += local * tensors + fixed  # state of the unpadded chunk; a 0-d step even when empty
    return RankState(rank, params, grads, optimizer)


__all__ = ["OPTIMIZER_STATE", "RankState", "fsdp_units", "model_state", "optimizer_state_layout"]


# ---------------------------------------------------------------------------------------------- choosing the degree


@dataclass(frozen=True)
class DegreePlan:
    """One candidate degree: the largest per-rank figures over the ranks, and whether it fits.

    Attributes:
        degree: the ``hybrid_shard_degree``; ``sharding_strategy``: what FSDP runs for it.
        model_state_bytes: parameters + gradients + optimizer state of the fullest rank (exact, see
            :func:`model_state`).
        transient_bytes: what is gathered on top during a step: the two largest units unsharded (the one computing
            and the one prefetched), and under FSDP1 ``no_sync`` accumulation the unsharded gradients.
        activation_bytes: the caller's estimate for one micro-batch (not measured here).
        peak_bytes: the sum; ``fits``: ``peak_bytes <= budget / (1 + headroom)``.
        shard_bytes, replicate_bytes: logical bytes of one optimizer step inside the shard group and across
            replicas (the textbook figure).
    """

    degree: int
    sharding_strategy: str
    model_state_bytes: int
    transient_bytes: int
    activation_bytes: int
    peak_bytes: int
    fits: bool
    shard_bytes: int
    replicate_bytes: int


def _textbook_bytes(units: Sequence[Sequence[Parameter]], layout: Any, fsdp_version: int, micro_batches: int,
                    accumulation: str) -> tuple[int, int]:
    from lightning_smp.accounting.comm import FSDPUnitSpec, accumulation_passes, fsdp_step_textbook
    from lightning_smp.accounting.shards import flat_param_numel

    shard = layout.shard
    group = layout.world_size if layout.sharding_strategy == NO_SHARD else shard
    specs = []
    for index, unit in enumerate(units):
        size = unit[0].element_size()
        reduced: int | None = None
        if fsdp_version == 1:
            padded = flat_param_numel([p.numel() for p in unit], group, size)  # the flat gradient, frozen parts too
        else:
            padded = reduced = 0
            for p in unit:
                _, per_rank, rest = _fsdp2_chunk(p, shard)
                padded += per_rank * rest * shard
                if p.requires_grad:  # FSDP2 reduces only what has gradients
                    reduced += per_rank * rest * shard
        specs.append(FSDPUnitSpec(padded_numel=padded, is_root=index == len(units) - 1, gather_bytes=size,
                                  reduce_bytes=size, reduce_numel=reduced))
    scattered, synced = accumulation_passes(accumulation, micro_batches)
    replicas = layout.world_size if layout.sharding_strategy == NO_SHARD else layout.replicate
    figure = fsdp_step_textbook(specs, layout.sharding_strategy, shard, replicas, micro_batches, synced_passes=synced,
                                reduce_scatter_passes=scattered, keep_gathered_unsynced=fsdp_version == 1)
    return (int(sum(e["bytes"] for e in figure["shard"].values())),
            int(sum(e["bytes"] for e in figure["replicate"].values())))


def plan(model: Module, *, world_size: int, devices_per_node: int | None = None, budget_bytes: int,
         fsdp_version: int = 1, auto_wrap_policy: Any = None, optimizer: Any = "adamw", micro_batches: int = 1,
         accumulation: str | None = None, activation_bytes: int = 0, headroom: float = 0.1,
         ) -> tuple[int, list[DegreePlan], str]:
    """Every valid degree's figures, the recommended degree and the reason.

    The recommendation is the smallest degree whose peak fits ``budget_bytes`` with ``headroom`` to spare (the
    fewer ranks in a shard group, the cheaper and more local its collectives), among the divisors of
    ``devices_per_node`` first (the frequent all-gathers stay on the intra-node links), then whole nodes.

    Raises:
        HybridShardConfigError: no degree fits; the message says what would help.
    """
    from lightning_smp.degree import valid_degrees
    from lightning_smp.names import EVERY_MICRO_BATCH, NO_SYNC

    mode = accumulation or (NO_SYNC if fsdp_version == 1 else "defer_all_reduce")
    units = fsdp_units(model, auto_wrap_policy)
    unit_bytes = sorted((sum(p.numel() * p.element_size() for p in unit) for unit in units), reverse=True)
    full_grads = sum(p.numel() * p.element_size() for unit in units for p in unit if p.requires_grad)
    rows = []
    for degree in [d for d in valid_degrees(world_size) if d >= 1]:
        layout = resolve_layout(world_size, degree)
        state = max(s.total_bytes for s in model_state(model, world_size=world_size, hybrid_shard_degree=degree,
                                                        fsdp_version=fsdp_version, auto_wrap_policy=auto_wrap_policy,
                                                        optimizer=optimizer))
        transient = sum(unit_bytes[:2]) if layout.shard > 1 else 0
        if micro_batches > 1 and mode == NO_SYNC and layout.shard > 1:
            transient += full_grads  # every rank holds the unsharded gradient between micro-batches
        elif micro_batches > 1 and mode not in (NO_SYNC, EVERY_MICRO_BATCH):
            transient += full_grads // layout.shard  # FSDP2's partial-reduce buffer
        peak = state + transient + activation_bytes
        shard_bytes, replicate_bytes = _textbook_bytes(units, layout, fsdp_version, micro_batches, mode)
        rows.append(DegreePlan(degree, layout.sharding_strategy, state, transient, activation_bytes, peak,
                               peak <= budget_bytes / (1 + headroom), shard_bytes, replicate_bytes))
    per_node = devices_per_node or world_size
    fitting = [r for r in rows if r.fits]
    if not fitting:
        smallest = min(rows, key=lambda r: r.peak_bytes)
        raise HybridShardConfigError(
            f"no hybrid_shard_degree fits budget_bytes={budget_bytes} with {headroom:.0%} headroom on {world_size}"
            f" rank(s): the least is {smallest.peak_bytes} bytes per rank at degree {smallest.degree}. Fix: more"
            " devices, activation checkpointing or a smaller micro-batch (activations), CPU offload, or"
            " fsdp_version=2 for accumulation without unsharded gradients."
        )
    inside = [r for r in fitting if per_node % r.degree == 0]
    chosen = min(inside or fitting, key=lambda r: r.degree)
    where = "inside one node" if per_node % chosen.degree == 0 else "spanning whole nodes"
    reason = (f"degree {chosen.degree} is the smallest that fits ({chosen.peak_bytes} of {budget_bytes} bytes per"
              f" rank with {headroom:.0%} headroom), its shard groups {where}")
    return chosen.degree, rows, reason


__all__ += ["DegreePlan", "plan"]
