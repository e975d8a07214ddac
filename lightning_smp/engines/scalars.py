"""Scalar (0-dim) parameters under the FSDP engines: CLIP's ``logit_scale``, a learned temperature.

Neither FSDP shards a 0-dim tensor (both raise "doesn't support scalar parameters" and ask the user to change the
model, which a third-party model's user cannot). Sharding a scalar would save nothing anyway, so the engines leave
every scalar parameter out of FSDP (``ignored_states`` / ``ignored_params``): each rank holds it whole, as DDP's
ranks do, and this module does for it what DDP does for every parameter:

- at wrapping, global rank 0's value goes to every rank (:func:`track`);
- after every backward that reduces gradients (not the micro-batches of an accumulation window before the last),
  one all-reduce over the world sums each scalar's gradient and divides by the world size (:func:`reduce`), so
  clipping, by hand or by Lightning, and the optimizer see DDP's gradient. A scalar that no rank gave a gradient
  keeps ``.grad`` ``None``; one that some ranks used gets the others' zeros, as DDP's ``find_unused_parameters``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn import Module, Parameter

from lightning_smp.replicas import broadcast_tensors

_ATTRIBUTE = "_lightning_smp_scalar_parameters"


def scalar_parameters(module: Module) -> list[Parameter]:
    """``module``'s 0-dim parameters, each once (what the engines leave out of FSDP)."""
    seen: dict[int, Parameter] = {}
    for param in module.parameters():
        if param.ndim == 0:
            seen.setdefault(id(param), param)
    return list(seen.values())


def track(root: Module, params: list[Parameter], device: torch.device) -> None:
    """After wrapping ``root``: its scalar parameters ``params`` start from global rank 0's values on every rank and
    are reduced by :func:`reduce`. Collective when ``params`` is not empty."""
    if not params:
        return
    broadcast_tensors(params, 0, None, device)
    setattr(root, _ATTRIBUTE, params)


def reduce(root: Module | None, group: dist.ProcessGroup | None = None) -> None:
    """Collective over ``group`` (``None``: the world; ``replica_sync``: the replica group), after a backward that
    reduced the sharded gradients: every scalar parameter of ``root`` gets the group's mean gradient (``None`` where
    no rank has one). Nothing when it has none."""
    params: list[Parameter] = getattr(root, _ATTRIBUTE, None) or []
    if not params or not dist.is_initialized():
        return
    device = params[0].device
    grads: list[Any] = [p.grad for p in params]
    packed = torch.zeros(2 * len(params), dtype=torch.float64, device=device)
    for index, grad in enumerate(grads):
        if grad is not None:
            packed[index] = grad.detach().double()
            packed[len(params) + index] = 1
    dist.all_reduce(packed, group=group)
    world = dist.get_world_size(group)
    for index, param in enumerate(params):
        if packed[len(params) + index].item() == 0:
            continue  # no rank used it: .grad stays None, as DDP leaves it
        mean = (packed[index] / world).to(param.dtype)
        if param.grad is None:
            param.grad = mean.clone()
        else:
            param.grad.copy_(mean)


__all__ = ["reduce", "scalar_parameters", "track"]
