"""FSDP2's full state dicts: every ``DTensor`` gathered over its shard axis onto the CPU, and the optimizer's state
keyed by parameter name (the names ``torch.distributed.checkpoint.state_dict`` uses)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer


def full_tensor(value: Any, device: torch.device) -> torch.Tensor:
    """``value`` unsharded (collective over its shard axis only), on the CPU."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    if value.device.type != device.type:
        # CPU-offloaded shards: the collective runs on the mesh's device (NCCL cannot move CPU tensors)
        value = DTensor.from_local(value.to_local().to(device), value.device_mesh, value.placements,
                                   run_check=False, shape=value.shape, stride=value.stride())
    return value.full_tensor().detach().cpu()


def clean_fqn(name: str) -> str:
    """``name`` as ``torch.distributed.checkpoint.state_dict`` names it: without activation-checkpointing wrappers."""
    return name.replace("_checkpoint_wrapped_module.", "")


def full_model_state(model: Module, device: torch.device) -> dict[str, Any]:
    """``model``'s state dict, every tensor in full on the CPU."""
    # collective over the shard axis only (the replicate axis is Replicate): shard group members call together
    return {key: full_tensor(value, device) for key, value in model.state_dict().items()}


def full_optimizer_state(optimizer: Optimizer, device: torch.device) -> dict[str, Any]:
    """``optimizer``'s state dict in torch's own layout (keyed by index in the optimizer's order), every tensor in
    full on the CPU: each DTensor state gathered over its shard axis."""
    local = optimizer.state_dict()
    state = {index: {key: full_tensor(value, device) for key, value in entry.items()}
             for index, entry in local["state"].items()}
    return {"state": state, "param_groups": [dict(g) for g in local["param_groups"]]}


def optimizer_state_by_name(model: Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (``optimizer``'s, keyed by index) keyed by the parameter names of ``model``."""
    names = {id(p): clean_fqn(name) for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {order[int(index)]: entry for index, entry in state["state"].items()},
        "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in state["param_groups"]],
    }


__all__ = ["clean_fqn", "full_model_state", "full_optimizer_state", "full_tensor", "optimizer_state_by_name"]
