"""What both front ends change in the user's optimizers: ``zero_grad()`` that also discards what the engine holds
outside ``.grad``, and (fault-tolerant replica groups) ``step()`` that steps only when every group commits.

DDP accumulates in ``.grad`` alone, so ``zero_grad()`` drops everything a window gathered. Under this library two
things live outside ``.grad``: FSDP2's deferred all-reduce keeps each group's sum of the window's micro-batches, and
both engines note which parameters took part in the window (:mod:`lightning_smp.engines.unused`). A ``zero_grad``
that left them would apply a dropped window's sum at the next step, or let the step's checks see a parameter as used
whose gradient the user threw away. The Trainer (``LightningModule.optimizer_zero_grad``, manual optimization's
``opt.zero_grad()``) and Fabric (the loop's ``optimizer.zero_grad()``) both reach the optimizer's own method, so that
is where the discard goes.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, SupportsIndex, cast

import torch
from torch.optim import Optimizer

from lightning_smp.errors import UnsupportedOptionError

_MARK = "_discards_unreduced_gradients"
_DISCARD = "_lightning_smp_discard"
_GATE_MARK = "_steps_when_committed"
_GATE = "_lightning_smp_commit"
#: each gated scheduler's vote (see skip_uncommitted_steps)
_SCHEDULER_GATES: weakref.WeakKeyDictionary[Any, Callable[[], bool]] = weakref.WeakKeyDictionary()


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


def step_when_committed(optimizer: Optimizer, commit: Callable[[Optimizer], bool]) -> Optimizer:
    """Make ``optimizer.step()`` step only when ``commit(optimizer)`` says so (every replica group voted to commit);
    otherwise the step's gradients are dropped and nothing the optimizer holds changes. A closure (Lightning's
    automatic optimization runs the forward and backward inside ``step``) runs first, and the vote after it.
    Returns ``optimizer`` (its class changed in place, as :func:`discard_on_zero_grad` does, for the same reason)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise UnsupportedOptionError(
            "fault_tolerance with LBFGS: it evaluates its closure several times inside one step, and a step across"
            " replica groups is voted on once. Fix: an optimizer that evaluates the closure once (SGD, Adam, ...)."
        )
    setattr(optimizer, _GATE, commit)
    base = type(optimizer)
    if getattr(base, _GATE_MARK, False):
        return optimizer

    def step(opt: Optimizer, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        inner = getattr(opt, "_optimizer", opt)
        own = getattr(inner, _GATE, None)
        if own is None:
            return base.step(opt, closure, **kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if own(inner):
            base.step(opt, **kwargs)
        else:
            base.zero_grad(opt, set_to_none=True)  # the step's gradients, dropped in every group alike
        return loss

    def __reduce_ex__(opt: Optimizer, protocol: SupportsIndex) -> Any:  # noqa: N807
        return _rebuilt, (base, opt.__getstate__())

    namespace = {"step": step, "__reduce_ex__": __reduce_ex__, _GATE_MARK: True, "__module__": base.__module__,
                 "__qualname__": base.__qualname__}
    optimizer.__class__ = type(base.__name__, (base,), namespace)
    _rewrap_scheduler_patch(optimizer)
    return optimizer


@contextmanager
def ungated(optimizers: Iterable[Any]) -> Iterator[None]:
    """Inside, ``step()`` of the gated ``optimizers`` (:func:`step_when_committed`) steps without a vote: loading a
    checkpoint into an optimizer with no state yet, ``torch.distributed.checkpoint`` creates the state with a step on
    zero gradients at learning rate 0, which is no training step (a vote there would count a step in one group's
    torchft and drop the state it creates, so that the checkpoint's optimizer state would not load)."""
    held = [(optimizer, vars(optimizer).pop(_GATE)) for optimizer in optimizers if _GATE in vars(optimizer)]
    try:
        yield
    finally:
        for optimizer, gate in held:
            setattr(optimizer, _GATE, gate)


def _rewrap_scheduler_patch(optimizer: Optimizer) -> None:
    """A learning-rate scheduler created before (Lightning's ``configure_optimizers``) patched ``optimizer.step`` on
    the instance with a wrapper of the class's step *as it was* (to note that the optimizer stepped): it would call
    around the new class. The same wrapper again, over the class's step as it is now."""
    patched = optimizer.__dict__.get("step")
    if patched is None or not getattr(patched, "_wrapped_by_lr_sched", False):
        return
    owner = weakref.ref(optimizer)
    func = type(optimizer).step

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        opt._opt_called = True  # type: ignore[union-attr]  # what the scheduler's own wrapper notes
        return func(cast(Optimizer, opt), *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def skip_uncommitted_steps(scheduler: Any, committed: Callable[[], bool]) -> Any:
    """Make ``scheduler.step()`` do nothing right after an optimizer step that the replica groups did not commit
    (``committed()`` is false): the learning rate follows committed steps only. Returns ``scheduler`` (its class
    changed in place; the vote is kept beside it, not on it: a scheduler's ``state_dict()`` is its ``__dict__``)."""
    _SCHEDULER_GATES[scheduler] = committed
    base = type(scheduler)
    if getattr(base, _GATE_MARK, False):
        return scheduler

    def step(sched: Any, *args: Any, **kwargs: Any) -> Any:
        own = _SCHEDULER_GATES.get(sched)
        if own is not None and not own():
            return None
        return base.step(sched, *args, **kwargs)

    def __reduce_ex__(sched: Any, protocol: SupportsIndex) -> Any:  # noqa: N807
        return _rebuilt, (base, sched.__dict__)

    namespace = {"step": step, "__reduce_ex__": __reduce_ex__, _GATE_MARK: True, "__module__": base.__module__,
                 "__qualname__": base.__qualname__}
    scheduler.__class__ = type(base.__name__, (base,), namespace)
    return scheduler


def _rebuilt(cls: Any, state: Any) -> Any:
    rebuilt = cls.__new__(cls)
    if hasattr(rebuilt, "__setstate__"):
        rebuilt.__setstate__(state)
    else:  # (a scheduler: its state is its __dict__)
        rebuilt.__dict__.update(state)
    return rebuilt


__all__ = ["discard_on_zero_grad", "skip_uncommitted_steps", "step_when_committed", "ungated"]
