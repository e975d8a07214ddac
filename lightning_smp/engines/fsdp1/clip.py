"""``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` on an FSDP1 model, as DDP would compute it.

Under FSDP1 a parameter's ``.grad`` outside the forward is this rank's shard of the gradient (a view of the flat
parameter's sharded gradient; the flat parameter itself with ``use_orig_params=False``). torch's ``clip_grad_norm_``
takes the norm of what it is given, so each rank clipped by the norm of its own shard: silently not DDP's (FSDP2's
gradients are ``DTensor``s, whose norm torch reduces itself). The plain call is what many scripts keep in
``on_before_optimizer_step`` or a Fabric loop, so it is made right rather than refused: :func:`install` replaces, once,
the function behind torch's public ``clip_grad_norm_`` (the one every ``from torch.nn.utils import clip_grad_norm_``
holds) with one that, when some of the parameters are shards of a model this engine sharded, sums each shard's part
of the norm over its shard group (the replicas hold equal gradients and are not counted again) and clips with that
total; every other call runs torch's own function unchanged. Which parameters are shards is read from the parameter
objects, the same on every rank, so every rank takes the same path and joins the same collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

_INSTALLED: list[bool] = []


def install(shard_groups: Callable[[], dict[int, dist.ProcessGroup]]) -> None:
    """Route torch's ``clip_grad_norm_`` through :func:`total_norm` for parameters in ``shard_groups()`` (``id`` of
    a sharded parameter -> its shard group, over the live models this engine sharded). Once per process."""
    if _INSTALLED:
        return
    wrapper = torch.nn.utils.clip_grad.clip_grad_norm_
    # torch's public function is a no_grad wrapper around the implementation, which it holds in a closure cell:
    # replacing the cell's content reaches every reference to the public function, however it was imported
    cell = wrapper.__closure__[wrapper.__code__.co_freevars.index("func")]  # type: ignore[index]
    original = cell.cell_contents

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        groups = shard_groups()
        sharded = {id(p): groups[id(p)] for p in params if id(p) in groups}
        if not sharded:
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        total = total_norm(params, float(norm_type), sharded)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be"
                " clipped. To disable this error and scale the gradients by the non-finite norm anyway, set"
                " `error_if_nonfinite=False`"
            )
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        return total

    cell.cell_contents = clip_grad_norm_
    _INSTALLED.append(True)


def total_norm(params: Iterable[torch.Tensor], norm_type: float,
               sharded: dict[int, dist.ProcessGroup]) -> torch.Tensor:
    """The ``norm_type``-norm of the gradients of ``params`` as DDP's full gradients give it: the parts of the
    parameters in ``sharded`` (``id`` -> shard group) reduced over their groups, the others (whole on every rank)
    counted once. Collective over every group in ``sharded`` (every rank must call it with the same parameters)."""
    params = list(params)
    device = next((p.grad.device for p in params if p.grad is not None), None)
    if device is None:
        device = next(iter(params)).device
    infinite = norm_type == float("inf")
    parts: dict[Any, torch.Tensor] = {None: torch.zeros((), device=device)}  # None: the whole gradients
    for group in dict.fromkeys(sharded.values()):
        parts[group] = torch.zeros((), device=device)
    for param in params:
        if param.grad is None or param.grad.numel() == 0:
            continue
        grad = param.grad.detach().float()
        key = sharded.get(id(param))
        if infinite:
            parts[key] = torch.maximum(parts[key], grad.abs().max())
        else:
            parts[key] = parts[key] + grad.abs().pow(norm_type).sum()
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    for group, part in parts.items():
        if group is not None:
            dist.all_reduce(part, op=op, group=group)
    if infinite:
        return torch.stack(list(parts.values())).max()
    return torch.stack(list(parts.values())).sum().pow(1.0 / norm_type)


def shard_ids(handles: Sequence[Any]) -> dict[int, dist.ProcessGroup]:
    """``id`` -> shard group of every parameter of ``handles`` (FSDP1 flat-parameter handles) that holds a shard:
    the flat parameters of sharded handles and their original parameters."""
    groups: dict[int, dist.ProcessGroup] = {}
    for handle in handles:
        if not handle.uses_sharded_strategy:
            continue  # NO_SHARD: every rank holds the whole gradient
        flat = handle.flat_param
        groups[id(flat)] = handle.process_group
        for param in flat._params or ():
            groups[id(param)] = handle.process_group
    return groups


__all__ = ["install", "shard_ids", "total_norm"]
