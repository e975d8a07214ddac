"""The commit vote inside one replica group (torchft's ``ManagerClient`` with its vote replaced), and the unused-parameter
notes it carries; :class:`~lightning_smp.fault_tolerance.session.ReplicaGroups` installs it in torchft's Manager."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_smp.errors import FaultToleranceError


class UnusedNotes(Protocol):
    """A step's unused-parameter notes before they are reduced (the engines'
    :class:`~lightning_smp.engines.unused.Unreduced`): reduced across the groups inside the gradients' all-reduce, then
    across the group inside the commit vote."""

    #: this rank's byte per parameter; the maximum over every rank is what :meth:`apply` takes
    levels: Tensor
    #: the levels above "unused" (a sum reduction carries each as an indicator)
    LEVELS: ClassVar[int]

    def apply(self, levels: Tensor) -> int: ...

    def refuses(self, levels: Tensor) -> bool: ...

    def forget(self) -> None: ...


class GroupVote:
    """torchft's ``ManagerClient`` (``Manager._client``; torchft 0.2.0 calls its ``_quorum`` and ``should_commit``),
    with the commit vote taken as one all-reduce (MAX) over the group's own ranks, where torchft's own is a gRPC
    barrier at group rank 0's ManagerServer. The decision is the same (commit only if every rank of the group votes
    to), and the all-reduce also carries the step's unused-parameter notes (:attr:`notes`): it is the only
    collective inside the group between the all-reduce across groups and the optimizer step, as, in a run without
    fault tolerance, the engine's own reduction of the notes is."""

    def __init__(self, client: Any, device: torch.device, wait: timedelta | None = None, group: int = 0) -> None:
        self._client = client
        self._device = device
        #: how long a rank waits for the group's other ranks (``None``: torchft's timeout): as long as one of them may
        #: still be in the step's quorum, its process group's setup, its crossing or its heal
        self._wait = wait
        self._group = group
        #: the step's notes, if any (their ``levels``: this rank's, or this rank's pair's across the groups)
        self.notes: UnusedNotes | None = None
        #: every rank's levels (MAX), after :meth:`should_commit`
        self.levels: Tensor | None = None
        #: whether the last vote refused a step that the notes show wrong (a gradient missing on some rank)
        self.refused = False
        #: whether this rank asks its group to give up (set before the vote), and whether some rank did (after it)
        self.give_up = False
        self.gave_up = False
        #: whether this rank lacks its part of a heal begun in this step (asked inside the vote, after torchft handed
        #: the peer's state over), and whether some rank of the group did (after it)
        self.missing: Callable[[], bool] | None = None
        self.heal_missing = False
        #: the last quorum torchft received (its participants, the step-0 state, the healing source)
        self.quorum: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self.quorum = quorum
        return quorum

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        notes = self.notes
        missing = self.missing is not None and self.missing()
        votes = torch.tensor([int(missing), int(self.give_up), 0 if should_commit else 1], dtype=torch.uint8,
                             device=self._device)
        if notes is not None:
            votes = torch.cat([notes.levels.to(votes.device, torch.uint8), votes])
        if dist.get_world_size() > 1:
            wait = self._wait or timeout
            try:
                dist.all_reduce(votes, op=dist.ReduceOp.MAX, async_op=True).wait(wait)
            except RuntimeError as err:
                raise FaultToleranceError(
                    f"replica group {self._group}: rank {group_rank}'s commit vote waited {wait.total_seconds():g} s"
                    f" for the group's other ranks ({err}): one of them is stuck or gone (its step's quorum, the"
                    " process group across groups, its crossing and its heal each end within their timeout). Fix:"
                    " look at that rank's log; restart the group (it heals from a live peer)."
                ) from err
        self.levels = votes[:-3] if notes is not None else None
        self.refused = notes is not None and notes.refuses(votes[:-3])
        # (a rank that lacks its part of a heal reported it to torchft, and votes not to commit)
        self.heal_missing = int(votes[-3]) > 0
        committed = int(votes[-1]) == 0 and not self.refused and not self.heal_missing
        self.gave_up = int(votes[-2]) > 0 and not committed
        return committed


__all__ = ["GroupVote", "UnusedNotes"]
