"""A parameter that no rank gave a gradient since the last optimizer step keeps the ``.grad`` it had, as under DDP.

DDP (with ``find_unused_parameters=True``, the only DDP that runs such a model) never touches the ``.grad`` of a
parameter that no rank used in an iteration: it stays ``None`` after ``zero_grad()`` and AdamW skips it. FSDP reduces
whole units: a parameter that no rank used but that shares a reduction with used ones (FSDP2 reduce-scatters every
parameter that requires a gradient, with zeros for unused ones; FSDP1 reduces a flat parameter whole) gets a zero
``.grad``, and AdamW then moves it by momentum and weight decay, silently.

So each engine notes, per parameter, whether autograd gave it a gradient on this rank (:meth:`Presence.mark_used`),
and whether its ``.grad`` was ``None`` when the window began (:meth:`Presence.note_start`). Before the optimizer
steps, an all-reduce (MAX, one byte per parameter) on each axis of the mesh in turn (shard group, replicas: every rank;
DDP's reducer all-reduces the same kind of bitmap) tells each rank which parameters some rank used; a parameter none
used whose ``.grad`` was ``None`` gets ``None`` again (:func:`restore_unused`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class Presence:
    """What one group of parameters (an FSDP2 parameter group, an FSDP1 flat parameter) saw since the last step.

    Args:
        params: returns the parameters the optimizer steps, in a fixed order (the same on every rank).
    """

    def __init__(self, params: Callable[[], Sequence[torch.Tensor | None]]) -> None:
        self.params = params
        self.size = len(params())
        self.reset()

    def reset(self) -> None:
        """A new window: after an optimizer step, or ``zero_grad`` in the middle of one (what it saw was dropped)."""
        self.used = [False] * self.size
        self.was_none: list[bool | None] = [None] * self.size

    def note_start(self) -> None:
        """Before this window first reaches the group: which ``.grad`` was ``None`` (kept from the first call on)."""
        for index, param in enumerate(self.params()):
            if self.was_none[index] is None and param is not None:
                self.was_none[index] = param.grad is None

    def mark_used(self, index: int) -> None:
        self.used[index] = True


def restore_unused(presences: Iterable[Presence], device: torch.device, groups: Sequence[ProcessGroup]) -> int:
    """Collective, on every rank before an optimizer step: give back ``None`` to each parameter that no rank gave a
    gradient since the last step and whose ``.grad`` was ``None`` then; start a new window. Returns how many.

    ``groups``: the axes of the model's mesh (together, every rank), reduced one after the other: the maximum over
    each axis in turn is the maximum over all, and each collective is counted on its own axis."""
    presences = list(presences)
    flags = [flag for presence in presences for flag in presence.used]
    if not flags:
        return 0
    used = torch.tensor(flags, dtype=torch.bool, device=device)
    # a safety net under the engines' notes: a gradient that is not zero was used, whatever the notes missed (so a
    # gradient is never dropped; only exact zeros can be). One small reduction per parameter, no host sync here.
    nonzero = [_nonzero(param, device) for presence in presences for param in presence.params()]
    used = (used | torch.stack(nonzero)).to(torch.uint8)
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=group)
    used_anywhere = iter(used.tolist())
    reset = 0
    for presence in presences:
        for param, was_none in zip(presence.params(), presence.was_none):
            if not next(used_anywhere) and was_none and param is not None and param.grad is not None:
                param.grad = None
                reset += 1
        presence.reset()
    return reset


def _nonzero(param: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    grad = None if param is None else param.grad
    local = grad.to_local() if grad is not None and hasattr(grad, "to_local") else grad  # a DTensor: this rank's
    if local is None or not local.numel():
        return torch.zeros((), dtype=torch.bool, device=device)
    return local.ne(0).any().to(device)


def bitmap_bytes(presences: Iterable[Presence]) -> int:
    """Bytes of the all-reduce :func:`restore_unused` issues (one per parameter)."""
    return sum(presence.size for presence in presences)


def forget(presences: Iterable[Presence]) -> None:
    """``zero_grad`` in the middle of a window: what the window used so far was dropped with its gradients."""
    for presence in presences:
        presence.reset()
