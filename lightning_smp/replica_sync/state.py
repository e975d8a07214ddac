"""The outer loop's state in a checkpoint, as one more optimizer's.

A checkpoint of semi-synchronous replica groups is taken at a sync point (the front ends sync every fragment that
trained first), so the parameters saved are the synced ones and the outer loop's own state is its step count and the
outer SGD's momentum. The momentum is written as the state of an SGD over the model's own parameters
(:func:`outer_optimizer`): a ``DTensor`` like each parameter under FSDP2, so that the checkpoint machinery that saves,
reshards and loads any optimizer's state does the same for it, at any degree.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_smp.replica_sync.outer import OuterSync
from lightning_smp.replicas import local_part


def _shaped_like(local: Tensor, param: Tensor) -> Tensor:
    """``local`` (this rank's part of a tensor shaped like ``param``) as ``param`` is laid out: a ``DTensor`` on its
    mesh and placements, sharing ``local``'s storage, or ``local`` itself (a copy on the parameter's device where it
    lives elsewhere: ``backup='cpu'``)."""
    from torch.distributed.tensor import DTensor

    local = local.to(param.device)  # (no copy where it is there already)
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    return local


def outer_optimizer(outer: OuterSync) -> torch.optim.SGD:
    """The outer loop's optimizer state as an SGD over the model's own parameters (never stepped): what a checkpoint
    saves and loads of it. Its momentum buffers share storage with ``outer``'s (this rank's parts; copies on the
    parameters' device under ``backup='cpu'``, which :func:`restore_outer` copies back)."""
    settings = outer.fragments[0].outer.param_groups[0]
    shadow = torch.optim.SGD(outer.parameters, lr=settings["lr"], momentum=settings["momentum"],
                             nesterov=settings["nesterov"])
    for param, buffer in zip(outer.parameters, outer.momentum()):
        shadow.state[param]["momentum_buffer"] = _shaped_like(buffer, param)
    return shadow


def restore_outer(outer: OuterSync, shadow: torch.optim.SGD, steps: int) -> None:
    """After a checkpoint was loaded into the model and into ``shadow`` (:func:`outer_optimizer`): the synced copies
    taken from the parameters, ``steps`` inner steps done, the momentum from ``shadow``."""
    momentum = [local_part(shadow.state[p]["momentum_buffer"]) for p in outer.parameters
                if "momentum_buffer" in shadow.state.get(p, {})]
    outer.restart_from_parameters(steps, momentum if momentum else None)


__all__ = ["outer_optimizer", "restore_outer"]
