"""The model state every rank will hold, predicted before anything is built.

Pure arithmetic over a model's parameter shapes (build it on the meta device: a 70B model costs nothing to plan),
with each engine's own padding rules (its :class:`~lightning_smp.engines.prediction.Prediction`), so that the
prediction equals what the memory report measures to the byte.

The units are the ones the engines build: the modules ``auto_wrap_policy`` selects (``Prediction.units_of``, the same
walk for both engines) and the root with what is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import Module, Parameter

from lightning_smp.degree import resolve_layout
from lightning_smp.engines import engine_for_layout
from lightning_smp.engines.prediction import Prediction
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.names import NO_SHARD

#: Optimizer state per trainable parameter: (state tensors shaped like the parameter, bytes of 0-d state).
OPTIMIZER_STATE = {
    "adam": (2, 4),      # exp_avg, exp_avg_sq; a float32 ``step``
    "adamw": (2, 4),
    "adam_amsgrad": (3, 4),  # + max_exp_avg_sq
    "adamw_amsgrad": (3, 4),
    "sgd": (0, 0),
    "sgd_momentum": (1, 0),  # momentum_buffer
}


def _first_optimizer(configured: Any) -> Any:
    """The first optimizer of whatever ``configure_optimizers`` may return (Lightning's accepted forms)."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    return None


def optimizer_name(optimizer: Any) -> str:
    """The :data:`OPTIMIZER_STATE` name of an optimizer given by name or as an instance, or of the first optimizer a
    LightningModule's ``configure_optimizers`` returns (AdamW for a plain module, or when it returns none)."""
    if isinstance(optimizer, Module):
        configure = getattr(optimizer, "configure_optimizers", None)
        found = _first_optimizer(configure()) if callable(configure) else None
        return "adamw" if found is None else optimizer_name(found)
    if isinstance(optimizer, str):
        name = optimizer.lower()
    elif isinstance(optimizer, torch.optim.SGD):
        name = "sgd_momentum" if any(g.get("momentum", 0) for g in optimizer.param_groups) else "sgd"
    elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):  # (AdamW is an Adam in recent torch)
        name = "adamw" if isinstance(optimizer, torch.optim.AdamW) else "adam"
        if any(g.get("amsgrad", False) for g in optimizer.param_groups):
            name += "_amsgrad"
    else:
        name = type(optimizer).__name__
    if name not in OPTIMIZER_STATE:
        raise HybridShardConfigError(
            f"optimizer={optimizer!r} is not one the planner knows. Valid names: {', '.join(OPTIMIZER_STATE)}"
            " (or an instance of torch.optim.Adam, AdamW or SGD). Fix: pass the name whose state per parameter is"
            " closest to your optimizer's (e.g. 'adamw' for two state tensors, 'sgd_momentum' for one)."
        )
    return name


def optimizer_state_layout(optimizer: Any) -> tuple[int, int]:
    """``(tensors shaped like the parameter, fixed bytes)`` of an optimizer given by name or as an instance."""
    return OPTIMIZER_STATE[optimizer_name(optimizer)]


def fsdp_units(model: Module, auto_wrap_policy: Any, prediction: Prediction) -> list[list[Parameter]]:
    """The parameters of every unit ``prediction``'s engine builds (``Prediction.units_of``), innermost first and the
    root last, each in the order FSDP flattens them (``named_parameters`` order, a shared parameter once, in the first
    unit that reaches it)."""
    seen: set[int] = set()
    units: list[list[Parameter]] = []
    for module in [*prediction.units_of(model, auto_wrap_policy), model]:
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
                sharding_strategy: str = "HYBRID_SHARD", cpu_offload: bool = False) -> list[RankState]:
    """The model state of every rank of ``world_size`` at ``hybrid_shard_degree``, at the optimizer step, by the
    layout rules of the engine of ``fsdp_version`` (:class:`~lightning_smp.engines.prediction.Prediction`).

    Parameters, gradients and optimizer state are taken in the dtype the model's parameters have (``bf16-true``:
    build the model in bf16). Every parameter that requires a gradient is assumed to get one. ``cpu_offload``: the
    run offloads parameters to the CPU (a layout with nothing sharded then stays on FSDP).
    """
    layout = resolve_layout(world_size, hybrid_shard_degree, sharding_strategy)
    # the engine that runs the layout: DDP's where nothing is sharded (unless the parameters live on the CPU)
    prediction = engine_for_layout(fsdp_version, layout, cpu_offload=cpu_offload or None).prediction
    shard = layout.shard
    group = world_size if layout.sharding_strategy == NO_SHARD else shard
    tensors, fixed = optimizer_state_layout(optimizer)
    units = fsdp_units(model, auto_wrap_policy, prediction)
    states = []
    for rank in range(world_size):
        held = [prediction.held(unit, shard, rank % shard, group, tensors, fixed) for unit in units]
        states.append(RankState(rank, sum(h.params for h in held), sum(h.grads for h in held),
                                sum(h.optimizer for h in held)))
    return states


__all__ = ["OPTIMIZER_STATE", "RankState", "fsdp_units", "model_state", "optimizer_name", "optimizer_state_layout"]
