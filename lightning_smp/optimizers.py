"""``optimizer.zero_grad()`` that also discards what the engine holds outside ``.grad``, for both front ends.

DDP accumulates in ``.grad`` alone, so ``zero_grad()`` drops everything a window gathered. Under this library two
things live outside ``.grad``: FSDP2's deferred all-reduce keeps each group's sum of the window's micro-batches, and
both engines note which parameters took part in the window (:mod:`lightning_smp.engines.unused`). A ``zero_grad``
that left them would apply a dropped window's sum at the next step, or let the step's checks see a parameter as used
whose gradient the user threw away. The Trainer (``LightningModule.optimizer_zero_grad``, manual optimization's
``opt.zero_grad()``) and Fabric (the loop's ``optimizer.zero_grad()``) both reach the optimizer's own method, so that
is where the discard goes.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.optim import Optimizer

_MARK = "_discards_unreduced_gradients"


def discard_on_zero_grad(optimizer: Optimizer, discard: Callable[[], None]) -> Optimizer:
    """Make ``optimizer.zero_grad()`` call ``discard()`` first; returns ``optimizer`` (its class changed in place).

    Through a subclass of the optimizer's class with the same name, not an instance attribute: Lightning's and
    Fabric's optimizer wrappers subclass the optimizer's class and find ``zero_grad`` there, so an attribute of the
    instance would never be called. Calling it again on the same optimizer changes nothing.
    """
    base = type(optimizer)
    if getattr(base, _MARK, False):
        return optimizer

    def zero_grad(opt: Optimizer, set_to_none: bool = True) -> None:
        discard()
        base.zero_grad(opt, set_to_none=set_to_none)

    namespace = {"zero_grad": zero_grad, _MARK: True, "__module__": base.__module__, "__qualname__": base.__qualname__}
    optimizer.__class__ = type(base.__name__, (base,), namespace)
    return optimizer


__all__ = ["discard_on_zero_grad"]
