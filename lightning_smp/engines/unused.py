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

The same byte checks the step's gradients against the notes: a parameter that took part on some rank but whose
``.grad`` is ``None`` there at the step (a reduction that never wrote it) would be skipped by the optimizer, silently;
every rank raises instead. And where the optimizer steps a whole tensor of several parameters (FSDP1 with
``use_orig_params=False``), one that no rank used cannot be left out as DDP leaves it: every rank raises, naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_smp.errors import GradientSyncError, ShardedParameterError
from lightning_smp.replicas import local_part

#: the byte per parameter, reduced by MAX: no rank used it; some rank used it; some rank used it and has no ``.grad``;
#: some rank's autograd wrote a gradient into its shard directly (the parameter was read outside the forward of its
#: FSDP unit, where it holds this rank's shard only)
UNUSED, USED, USED_WITHOUT_GRAD, READ_AS_SHARD = 0, 1, 2, 3


class Presence:
    """What one group of parameters (an FSDP2 parameter group, an FSDP1 flat parameter) saw since the last step.

    Args:
        params: returns the parameters the optimizer steps, in a fixed order (the same on every rank).
        names: returns the parameters' names, for messages (default: their positions).
        whole: the parameters are parts of one tensor the optimizer steps whole (FSDP1's flat parameter under
            ``use_orig_params=False``): ``params`` returns that tensor for each of them, none can be left out, and a
            gradient's values cannot tell which part was used (the notes alone decide).
    """

    def __init__(self, params: Callable[[], Sequence[torch.Tensor | None]],
                 names: Callable[[], Sequence[str]] | None = None, whole: bool = False) -> None:
        self.params = params
        self.size = len(params())
        self._names = names
        self.whole = whole
        self.reset()

    @property
    def names(self) -> list[str]:
        return list(self._names()) if self._names else [f"parameter {index}" for index in range(self.size)]

    def reset(self) -> None:
        """A new window: after an optimizer step, or ``zero_grad`` in the middle of one (what it saw was dropped)."""
        self.used = [False] * self.size
        self.was_none: list[bool | None] = [None] * self.size
        self.read_as_shard = [False] * self.size

    def note_start(self) -> None:
        """Before this window first reaches the group: which ``.grad`` was ``None`` (kept from the first call on)."""
        for index, param in enumerate(self.params()):
            if self.was_none[index] is None and param is not None:
                self.was_none[index] = param.grad is None

    def mark_used(self, index: int) -> None:
        self.used[index] = True

    def mark_read_as_shard(self, index: int) -> None:
        self.read_as_shard[index] = True


def restore_unused(presences: Iterable[Presence], device: torch.device, groups: Sequence[ProcessGroup]) -> int:
    """Collective, on every rank before an optimizer step: give back ``None`` to each parameter that no rank gave a
    gradient since the last step and whose ``.grad`` was ``None`` then; start a new window. Returns how many.

    ``groups``: the axes of the model's mesh (together, every rank), reduced one after the other: the maximum over
    each axis in turn is the maximum over all, and each collective is counted on its own axis.

    Raises:
        GradientSyncError: on every rank alike, when a parameter that some rank used has no ``.grad`` there, or when
            a part of a tensor stepped whole was used by no rank.
    """
    notes = unreduced(presences, device)
    if notes is None:
        return 0
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(notes.levels, op=dist.ReduceOp.MAX, group=group)
    return notes.apply(notes.levels)


@dataclass
class Unreduced:
    """This rank's notes of a step, before they are reduced: :func:`restore_unused` in two halves, for a caller that
    reduces them with a collective of its own (fault tolerance: across replica groups inside the gradients' own
    all-reduce, then across the group inside the commit vote, so that the step waits on no extra collective).

    ``levels``: this rank's byte per parameter (:func:`_levels`); reduce it by MAX over every rank, then
    :meth:`apply` the result, on every rank before the optimizer steps."""

    presences: list[Presence]
    levels: torch.Tensor

    #: the levels above :data:`UNUSED`: one indicator each carries a level in a sum (SUM/AVG) reduction
    LEVELS: ClassVar[int] = READ_AS_SHARD

    def apply(self, levels: torch.Tensor) -> int:
        """:func:`restore_unused`'s second half, with ``levels`` reduced over every rank; returns how many ``.grad``
        were given back ``None``."""
        return _apply(self.presences, levels)

    @staticmethod
    def refuses(levels: torch.Tensor) -> bool:
        """Whether :meth:`apply` raises for ``levels`` (reduced): a step that must not be taken."""
        return bool(levels.numel()) and int(levels.max()) >= USED_WITHOUT_GRAD

    def forget(self) -> None:
        """Drop the notes unapplied (the step's gradients were dropped): a new window."""
        forget(self.presences)


def unreduced(presences: Iterable[Presence], device: torch.device) -> Unreduced | None:
    """This rank's notes, for :meth:`Unreduced.apply` once reduced; ``None`` when nothing is noted (no parameter)."""
    presences = list(presences)
    if not any(presence.size for presence in presences):
        return None
    return Unreduced(presences, _levels(presences, device))


def _apply(presences: Sequence[Presence], levels: torch.Tensor) -> int:
    anywhere = iter(levels.tolist())
    reset, missing, stepped_whole, read_as_shard = 0, [], [], []
    for presence in presences:
        for name, param, was_none in zip(presence.names, presence.params(), presence.was_none):
            level = next(anywhere)
            if level == READ_AS_SHARD:
                read_as_shard.append(name)
            elif level == USED_WITHOUT_GRAD:
                missing.append(name)
            elif level == UNUSED and was_none and param is not None and param.grad is not None:
                if presence.whole:
                    stepped_whole.append(name)
                else:
                    param.grad = None
                    reset += 1
        presence.reset()
    if read_as_shard:
        raise ShardedParameterError(read_outside_forward_message(read_as_shard))
    if missing:
        raise GradientSyncError(
            f"{len(missing)} parameter(s) took part in this optimizer step's backward on some rank but have no"
            f" gradient there as the optimizer is about to step ({_some(missing)}): the step would silently skip"
            " them. Fix: do not set .grad to None between the backward and the step (call optimizer.zero_grad() to"
            " drop a window); if no code of yours does, report this with the model."
        )
    if stepped_whole:
        raise GradientSyncError(
            f"{len(stepped_whole)} parameter(s) got no gradient on any rank in this optimizer step"
            f" ({_some(stepped_whole)}), but they share an FSDP flat parameter with parameters that did: with"
            " use_orig_params=False the optimizer steps the flat parameter whole, so momentum and weight decay would"
            " move them where DDP leaves them untouched. Fix: use_orig_params=True (the optimizer then steps each"
            " parameter, and these keep .grad None), or fsdp_version=2."
        )
    return reset


def _levels(presences: Sequence[Presence], device: torch.device) -> torch.Tensor:
    """This rank's byte for every parameter (:data:`USED_WITHOUT_GRAD`, :data:`USED` or :data:`UNUSED`), as one
    tensor on ``device``.

    The notes decide in Python; only a parameter the notes did not see used, but that holds a gradient, is read: a
    safety net under the notes (a gradient that is not zero was used, whatever the notes missed, so a gradient is
    never dropped; only exact zeros can be). In the common step, every parameter used, nothing is read, and the
    check costs one small tensor (it runs before every optimizer step)."""
    levels: list[int] = []
    unnoted: list[tuple[int, torch.Tensor]] = []  # (position, gradient) of parameters to read
    for presence in presences:
        for index, param in enumerate(presence.params()):
            if presence.read_as_shard[index]:
                levels.append(READ_AS_SHARD)
                continue
            noted = presence.used[index]
            # a frozen parameter's view in a trainable flat parameter (FSDP1) gets a gradient FSDP drops: not stepped
            if noted and param is not None and param.requires_grad and param.grad is None and local_part(param).numel():
                levels.append(USED_WITHOUT_GRAD)
                continue
            levels.append(USED if noted else UNUSED)
            grad = None if noted or presence.whole or param is None or param.grad is None else local_part(param.grad)
            if grad is not None and grad.numel():
                unnoted.append((len(levels) - 1, grad))
    result = torch.tensor(levels, dtype=torch.uint8, device=device)
    if unnoted:
        positions = torch.tensor([position for position, _ in unnoted], device=device)
        read = torch.stack([grad.ne(0).any().to(device) for _, grad in unnoted]).to(torch.uint8)
        result[positions] = read  # UNUSED (0) or USED (1)
    return result


def read_outside_forward_message(names: Sequence[str] = ()) -> str:
    """The error for parameters a loss read outside their FSDP unit's forward (both engines say the same);
    ``names``: those parameters, where the engine can tell."""
    which = f" {len(names)} sharded parameter(s)" if names else " sharded parameters"
    return (
        f"The loss reads{which} outside the forward of their FSDP unit{f' ({_some(names)})' if names else ''},"
        " e.g. an L2 penalty `loss + c * sum(p.pow(2).sum() for p in self.parameters())` in training_step: there a"
        " parameter holds only this rank's shard, so the term would be computed from a fraction of the weights and"
        " its gradient never reduced across ranks (DDP would give a different result). Fix: for an L2 penalty, use"
        " the optimizer's weight decay (torch.optim.SGD/Adam(weight_decay=2 * c) adds exactly the gradient of"
        " c * sum(p ** 2)); for another term over the weights (a distance to a reference model), compute it inside"
        " the forward of the module that owns them and return it with that module's output; or use"
        " hybrid_shard_degree=1 (nothing sharded)."
    )


def _some(names: Sequence[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def bitmap_bytes(presences: Iterable[Presence]) -> int:
    """Bytes of the all-reduce :func:`restore_unused` issues (one per parameter)."""
    return sum(presence.size for presence in presences)


def forget(presences: Iterable[Presence]) -> None:
    """``zero_grad`` in the middle of a window: what the window used so far was dropped with its gradients."""
    for presence in presences:
        presence.reset()
