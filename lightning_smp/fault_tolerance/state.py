"""What a healing group copies from a live peer, rank by rank: each rank's own shards of the parameters and buffers,
each optimizer's state as this rank holds it, and the front end's other state (schedulers, loop counters, the data
position). A rank fetches from the rank with the same group rank in the peer group, which holds the same shards when
both groups run the same degree (checked: a shape that differs is an error, never a silent partial copy)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.replicas import local_part


def _to_local(value: Any) -> Any:
    if isinstance(value, Tensor):
        return local_part(value).detach()
    if isinstance(value, dict):
        return {k: _to_local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_local(v) for v in value)
    return value


def _like(value: Any, parameter: Tensor) -> Any:
    """An optimizer state tensor received as a local shard, laid out as ``parameter`` is (a ``DTensor`` over the same
    mesh); a scalar (``step``) stays one. Copied: the optimizer's own from then on, whatever the received one shares
    storage with."""
    if not isinstance(value, Tensor):
        return value
    if isinstance(parameter, DTensor) and value.dim() > 0:
        return DTensor.from_local(value.to(parameter.device, copy=True), parameter.device_mesh, parameter.placements,
                                  run_check=False, shape=parameter.shape, stride=parameter.stride())
    return value.clone()


def optimizer_local_state(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every tensor this rank's part of it."""
    return _to_local(optimizer.state_dict())


def load_optimizer_local_state(optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load a state :func:`optimizer_local_state` took on the peer's rank of the same group rank."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    laid_out = {index: {key: _like(value, parameters[int(index)]) for key, value in entry.items()}
                for index, entry in state["state"].items()}
    optimizer.load_state_dict({"state": laid_out, "param_groups": state["param_groups"]})


@dataclass
class TrackedState:
    """The state a healing group copies, as one rank holds it.

    Attributes:
        tensors: the module's parameters and buffers by name, captured once outside any forward (FSDP2 swaps the
            module's parameters for unsharded ones during a forward; these are the shards the optimizer steps).
        buffers: the names among ``tensors`` that are buffers (what crosses the groups with the gradients when
            buffers are broadcast, DDP's ``broadcast_buffers``).
        optimizers: the optimizers, read when the state is taken.
        extra: the front end's other state (schedulers, loop counters, data position), read when the state is taken.
        load_extra: applies a peer's ``extra``.
    """

    tensors: Sequence[tuple[str, Tensor]]
    optimizers: Callable[[], Sequence[Optimizer]]
    extra: Callable[[], dict[str, Any]] = dict
    load_extra: Callable[[dict[str, Any]], None] = lambda state: None
    buffers: frozenset[str] = frozenset()

    @classmethod
    def of(cls, module: Module, optimizers: Callable[[], Sequence[Optimizer]],
           extra: Callable[[], dict[str, Any]] = dict,
           load_extra: Callable[[dict[str, Any]], None] = lambda state: None) -> TrackedState:
        buffers = list(module.named_buffers())
        named: Iterable[tuple[str, Tensor]] = (*module.named_parameters(), *buffers)
        return cls(list(named), optimizers, extra, load_extra, frozenset(name for name, _ in buffers))

    def buffer_tensors(self) -> list[Tensor]:
        """This rank's buffers, in the module's order."""
        return [tensor for name, tensor in self.tensors if name in self.buffers]

    def local_tensors(self) -> list[tuple[str, Tensor]]:
        """Every tensor this rank holds of the state by name, as views of the live ones: its shards of the parameters,
        its buffers, each optimizer's state tensors (in the parameters' order)."""
        named = [(name, local_part(tensor)) for name, tensor in self.tensors]
        for index, optimizer in enumerate(self.optimizers()):
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
            for position, parameter in enumerate(parameters):
                entry = optimizer.state.get(parameter, {})
                named += [(f"optimizer{index}.{position}.{key}", local_part(value)) for key, value in sorted(entry.items())
                          if isinstance(value, Tensor)]
        return named

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, its tensors sharing storage with the live ones (torchft's transport serves them only
        until this group's next commit vote, before which nothing changes them)."""
        return {"tensors": {name: local_part(tensor).detach() for name, tensor in self.tensors},
                "optimizers": [optimizer_local_state(o) for o in self.optimizers()],
                "extra": self.extra()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy a peer's state (its rank of the same group rank) into this rank's tensors, optimizers and extra."""
        received = state["tensors"]
        mine = dict(self.tensors)
        if set(received) != set(mine):
            raise RuntimeError(
                "the live peer's model has other parameters than this group's: "
                f"{sorted(set(received) ^ set(mine))[:3]}. Every replica group must train the same model."
            )
        with torch.no_grad():
            for name, tensor in mine.items():
                target, source = local_part(tensor), received[name]
                if tuple(target.shape) != tuple(source.shape):
                    raise RuntimeError(
                        f"{name}: this rank holds a shard of shape {tuple(target.shape)}, the peer's rank sent"
                        f" {tuple(source.shape)}. Every replica group must run the same hybrid_shard_degree."
                    )
                target.copy_(source)
        optimizers = list(self.optimizers())
        if len(optimizers) != len(state["optimizers"]):
            raise RuntimeError(f"the live peer has {len(state['optimizers'])} optimizers, this group"
                               f" {len(optimizers)}.")
        for optimizer, optimizer_state in zip(optimizers, state["optimizers"]):
            load_optimizer_local_state(optimizer, optimizer_state)
        self.load_extra(state["extra"])


__all__ = ["TrackedState", "load_optimizer_local_state", "optimizer_local_state"]
