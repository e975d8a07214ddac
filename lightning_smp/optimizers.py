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
from typing import Any, SupportsIndex

from torch.optim import Optimizer

_MARK = "_discards_unreduced_gradients"
_DISCARD = "_lightning_smp_discard"


def discard_on_zero_grad(optimizer: Optimizer, discard: Callable[[], None]) -> Optimizer:
    """Make ``optimizer.zero_grad()`` call ``discard()`` first; returns ``optimizer`` (its class changed in place).

    Through a subclass of the optimizer's class with the same name, not an instance attribute: Lightning's and
    Fabric's optimizer wrappers subclass the optimizer's class and find ``zero_grad`` there, so an attribute of the
    instance would never be called. The discard itself is the instance's (the strategy set up last wins); a copy
    made by pickling is the plain optimizer again.
    """
    setattr(optimizer, _DISCARD, discard)
    base = type(optimizer)
    if getattr(base, _MARK, False):
        return optimizer

    def zero_grad(opt: Optimizer, *args: Any, **kwargs: Any) -> None:
        # ``opt`` may be Lightning's or Fabric's wrapper, which keeps the optimizer itself as ``_optimizer``
        own = getattr(getattr(opt, "_optimizer", opt), _DISCARD, None)
        if own is not None:
            own()
        base.zero_grad(opt, *args, **kwargs)

    def __reduce_ex__(opt: Optimizer, protocol: SupportsIndex) -> Any:  # noqa: N807
        # pickle finds classes by name, and this one's name is its base's: pickle the optimizer as its base class
        return _rebuilt, (base, opt.__getstate__())

    namespace = {"zero_grad": zero_grad, "__reduce_ex__": __reduce_ex__, _MARK: True, "__module__": base.__module__,
                 "__qualname__": base.__qualname__}
    optimizer.__class__ = type(base.__name__, (base,), namespace)
    return optimizer


def _rebuilt(cls: type[Optimizer], state: Any) -> Optimizer:
    optimizer = cls.__new__(cls)
    optimizer.__setstate__(state)
    return optimizer


__all__ = ["discard_on_zero_grad"]
