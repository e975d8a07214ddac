"""A debugging check that every rank runs the same FSDP units in the same order (``LIGHTNING_SMP_CHECK_UNIT_ORDER=1``).

Each FSDP unit gathers its parameters in its forward and reduces its gradients in its backward, a collective of its
group. A unit that one rank runs and another does not (a module used only when a rank's batch meets a condition, as
its own unit) leaves that collective unanswered: the run hangs (gloo and NCCL alike), or, where the other rank's
next collective has the same size (two experts of one shape), the ranks silently exchange the wrong parameters.
Under DDP the same model fails with a clear error unless ``find_unused_parameters=True``; FSDP has no such check.

With the variable set, the forward of every unit below the root first takes part in one all-reduce of two numbers
over all ranks (the unit's index and its negative, maximised), and so does every backward (index -1): where the ranks
disagree, the ranks that meet there raise :class:`~lightning_smp.errors.UnitOrderError`, naming the unit and the fix,
before the mismatched collective. (A rank that is in another collective at that moment, e.g. a metric logged with
``sync_dist``, fails or waits there instead.) It costs one small all-reduce per unit call and a host
synchronisation: a tool to find the cause of a hang, like ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (which does not catch
two units of one size), not a training setting. Forwards that only some ranks run on purpose (a sampling callback on
rank 0) wait in it: leave the variable unset for such runs.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.nn import Module

from lightning_smp.errors import UnitOrderError

#: the environment variable that turns the check on (``1``)
ENV = "LIGHTNING_SMP_CHECK_UNIT_ORDER"
_BACKWARD = -1

_CHECKED: weakref.WeakKeyDictionary[Module, tuple[list[str], torch.device]] = weakref.WeakKeyDictionary()


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def install(root: Module, units: Sequence[tuple[str, Module]], device: torch.device) -> None:
    """Check, before each of ``units`` (name, module) runs its forward, that every rank is about to run the same unit;
    :func:`before_backward` checks each backward of ``root``. Nothing happens unless :func:`enabled`."""
    if not enabled() or not dist.is_initialized() or root in _CHECKED:
        return
    # not the root: its forward runs once per step on every rank, and calls of it inside a step (self(x)) run no
    # collective of their own
    below = [(name, unit) for name, unit in units if unit is not root]
    names = [name for name, _ in below]
    _CHECKED[root] = (names, device)
    for index, (_, unit) in enumerate(below):
        def pre_forward(module: Module, args: object, index: int = index) -> None:
            _agree(names, index, device)

        # prepend: before FSDP2's own pre-forward hook, which gathers (FSDP1 gathers in forward itself)
        unit.register_forward_pre_hook(pre_forward, prepend=True)


def before_backward(root: Module) -> None:
    """The backward's turn: every rank must be about to run it, not another unit's forward."""
    checked = _CHECKED.get(root)
    if checked is not None:
        _agree(checked[0], _BACKWARD, checked[1])


def _agree(names: list[str], index: int, device: torch.device) -> None:
    mine = torch.tensor([index, -index], dtype=torch.int64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    highest, lowest = int(mine[0]), -int(mine[1])
    if highest == lowest:
        return

    def what(i: int) -> str:
        return "the backward" if i == _BACKWARD else f"the forward of FSDP unit {names[i]!r}"

    raise UnitOrderError(
        f"Ranks disagree on what runs next: rank {dist.get_rank()} is about to run {what(index)}, while others run"
        f" {what(highest) if highest != index else what(lowest)}. An FSDP unit must run on every rank of its group or"
        " on none (its all-gather and reduce-scatter are collectives), so a module that only some ranks run - a"
        " branch taken when a rank's batch meets a condition - cannot be a unit of its own. Fix: leave that module"
        " out of auto_wrap_policy, so that it belongs to a unit every rank runs and uses (the root, with the layers"
        " around it), as docs/engines.md describes; or make every rank run it (multiply its loss by 0 where unused)."
    )


__all__ = ["ENV", "before_backward", "enabled", "install"]
