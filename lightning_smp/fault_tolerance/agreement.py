"""One state of a step in every group, whatever a partition does: the three decisions the groups take about it.

torchft's commit vote is taken inside each group; that the groups agree is assumed from the crossing (the all-reduce
across groups) having completed everywhere or nowhere. A partition breaks that assumption: measured on the cluster
harness, the survivor left a crossing once the lighthouse stopped hearing from the cut group and committed the step
alone, while the cut group's side of the same crossing completed when its link came back, and it committed the step
from both groups' gradients: one step number, two states. The lighthouse is the one party both sides reach, and it is
what decides who is alive, so the decisions below are taken against it (its status page, :class:`LighthouseView`):

- **leave** (:func:`abandon_reason`): a rank waiting in a crossing leaves it when the lighthouse stopped hearing from
  a participant (the peers leave it too), when the lighthouse has formed a quorum after the one this crossing runs in
  (the peers moved on without this group), or when a group asks for the next quorum while this rank still waits: a
  group asks only once it has left the crossing, and one that completed it has sent everything this rank waits for,
  so a request still there :data:`ASKED_FOR` seconds later (or at once, if this rank lost the lighthouse while waiting:
  it was cut off) is a peer that abandoned it. A rank receiving a peer's state (a heal, inside a quorum the peers are
  in) leaves it on the same signs. Without this, a group that returns to a crossing its peers left would
  wait for its collective's timeout while the lighthouse, hearing it again, made the survivors' next quorum wait for
  it. A left crossing is a dropped step: dropping is always safe, a group behind heals from a peer ahead.
- **fence** (:func:`fence_reason`): after its crossing completed, and before its commit vote, a group asks the
  lighthouse whether the quorum it crossed in is still the last one formed, and every participant still heard (and,
  under ``replica_sync``, where a group asks for a quorum only at its syncs, that no group has asked for the next
  one: a peer that refused this sync). A group that was cut off and returns to find its peers moved on drops the
  step, as its peers did; one that cannot read the lighthouse drops it too. A group passes the fence only while the
  lighthouse holds its quorum and hears from it: the peers cannot have formed another quorum without it before then,
  and cannot afterwards until the lighthouse has missed its heartbeats for the whole timeout.
- **meet** (:func:`compare_at_meeting`): groups that meet in a new quorum at the same step (and, under
  ``replica_sync``, in every sync) compare a fingerprint of what they hold. No protocol over a link that can fail at
  any moment lets both sides of a crossing know that the other completed it (the last packet may always be the one
  lost: a cut in the last fraction of a crossing, lasting longer than the heartbeat timeout, leaves one side complete
  and the other abandoning, and the fence passed before the cut). What remains is caught where it could do harm,
  before anything is averaged: the groups whose last commit is in an older quorum than another's (the group that
  returns from the partition) take the state of the group whose last commit is in the newest one (the lowest group id
  among equals), through torchft's own healing; the step in which they met is dropped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from lightning_smp.fault_tolerance.crossing import LighthouseView

#: a value no fingerprint and no lineage reaches: what a group that does not compare sends to a MAX all-reduce
_NEUTRAL = -(1 << 63)
#: group ids below this fit the lineage key
MAX_GROUPS = 1 << 16
#: how long a group's request for the next quorum is seen by a rank still waiting in a crossing before it leaves it
#: (a peer that completed the crossing sent everything already: what it sent arrives well within this)
ASKED_FOR = 0.5


@dataclass(frozen=True)
class InCrossing:
    """A crossing as the decision to leave it needs it: the quorum it runs in, its participants, whether this rank
    lost the lighthouse while in it, and for how long the reads so far have seen a group ask for the next quorum."""

    quorum_id: int
    participants: tuple[str, ...]
    lost: bool = False
    asked_for: float = 0.0


def abandon_reason(view: LighthouseView | None, crossing: InCrossing) -> str | None:
    """Why a rank waiting in ``crossing`` leaves it now, given the lighthouse's page (``None``: unread, no verdict);
    ``None``: it waits on."""
    if view is None:
        return None
    gone = view.silent(crossing.participants)
    if gone:
        return f"abandoned: the lighthouse stopped hearing from {', '.join(gone)} while it was in flight"
    if view.quorum_id is not None and view.quorum_id != crossing.quorum_id:
        return (f"abandoned: the lighthouse formed quorum {view.quorum_id} after this crossing's quorum"
                f" {crossing.quorum_id} (its peers moved on without this group)")
    if view.pending and (crossing.lost or crossing.asked_for >= ASKED_FOR):
        return ("abandoned: a group asked the lighthouse for a new quorum while this rank still waited"
                f"{' (it had lost the lighthouse)' if crossing.lost else ''}: a peer left this crossing")
    return None


def fence_reason(view: LighthouseView | None, quorum_id: int, participants: Sequence[str], *,
                 asking_is_leaving: bool = False) -> str | None:
    """Why a group whose crossing in quorum ``quorum_id`` completed must not commit its step, given the lighthouse's
    page (``None``: unread); ``None``: it may. ``asking_is_leaving``: a group asking for a quorum now has refused this
    step (``replica_sync``, where a group asks only at its syncs, for a group that lost the lighthouse during this
    one: a peer that asks at once, for a sync right after this one, is a peer that committed it)."""
    if view is None:
        return "the lighthouse could not be read to confirm that every group is still in this step's quorum"
    if view.quorum_id != quorum_id:
        return (f"the lighthouse formed quorum {view.quorum_id} after this step's quorum {quorum_id}: the other groups"
                " moved on without this one, and dropped this step")
    gone = view.silent(participants)
    if gone:
        return f"the lighthouse stopped hearing from {', '.join(gone)} before this step's commit"
    if asking_is_leaving and view.pending:
        return "a group asked the lighthouse for a new quorum before this sync's commit: a peer refused it"
    return None


class Meeting(Enum):
    """What a meeting's comparison found, for this group."""

    #: every group that compared holds the same state (or this group did not compare: it heals, or is alone)
    SAME = "same"
    #: the states differ, and this group's is the one the others take (its step is dropped)
    KEEPS = "keeps"
    #: the states differ, and this group takes another's (its step is dropped, and it steps back to heal)
    HEALS = "heals"
    #: a collective of the comparison failed (the step is dropped; the next quorum compares again)
    FAILED = "failed"


def counters_of(value: Any, prefix: str = "") -> list[str]:
    """The plain values (numbers, strings, booleans) in a nested state, each with its path: the loop's counters and
    schedulers' positions, without the tensors (compared by value apart)."""
    if isinstance(value, Tensor):
        return []
    if isinstance(value, Mapping):
        return [item for key in sorted(value, key=repr) for item in counters_of(value[key], f"{prefix}/{key}")]
    if isinstance(value, (list, tuple)):
        return [item for index, entry in enumerate(value) for item in counters_of(entry, f"{prefix}/{index}")]
    if value is None or isinstance(value, (bool, int, float, str)):
        return [f"{prefix}={value!r}"]
    return []


def _words_sum(tensor: Tensor) -> Tensor:
    """The sum of ``tensor``'s bytes, in int64 (read as bytes: a view of any tensor at any offset, on every rank)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).sum(dtype=torch.int64).reshape(1)


def quick_fingerprint(tensors: Sequence[Tensor], counters: Sequence[str] = ()) -> int:
    """A 62-bit fingerprint of ``tensors``' values and of ``counters``: per tensor, on its device, an XOR of its
    words (``torch.hash_tensor``) and their sum (which sees a change an XOR cancels: the same change to two equal
    values), one read of each tensor, then one small copy to the CPU. A step changes values everywhere; the start's
    fingerprint (:func:`~lightning_smp.fault_tolerance.start.fingerprints`) also sees values that only moved, at eight
    times the cost."""
    hashes = [torch.cat([torch.hash_tensor(t.detach()).view(torch.int64).reshape(1), _words_sum(t)]).cpu()
              for t in tensors if t.numel() > 0]
    data = (torch.cat(hashes).numpy().tobytes() if hashes else b"") + "\n".join(counters).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def lineage(last_commit_quorum: int, group: int) -> int:
    """The key that picks which group's state the others take when states differ: the newest quorum a group last
    committed in (the groups that moved on without another), then the lowest group id."""
    return (last_commit_quorum + 1) * MAX_GROUPS + (MAX_GROUPS - 1 - group % MAX_GROUPS)


def compare_at_meeting(fingerprint: int | None, key: int, *, device: torch.device,
                       all_reduce_max: Callable[[Tensor], bool], agree: Callable[[list[int]], list[int]]) -> Meeting:
    """Compare this rank's ``fingerprint`` (``None``: this group does not compare, it is behind and heals, and sends
    what changes nobody's maximum; it still learns whether the others differ, and then heals again, from the one
    group left at the highest step) with the same rank of every other group, in one MAX all-reduce of four numbers
    across the groups (``all_reduce_max``: ``False`` if it failed), then agree inside the group (``agree``: each
    flag's maximum over the group's ranks, every rank calling it whatever happened before). ``key``: this group's
    :func:`lineage`."""
    values = (fingerprint, -fingerprint, key, 0) if fingerprint is not None else (_NEUTRAL, _NEUTRAL, _NEUTRAL, 0)
    probe = torch.tensor(values, dtype=torch.int64, device=device)
    crossed = all_reduce_max(probe)
    # (max(x) == -max(-x): every group that compared holds x; the group with the greatest key is the source. A
    # group that does not compare reads the outcome too: it may be healing from the group the meeting drops, as
    # torchft picks a source per rank among the groups at the highest step, and then steps back with the others)
    differ = crossed and int(probe[0]) != _NEUTRAL and int(probe[0]) != -int(probe[1])
    source = crossed and fingerprint is not None and int(probe[2]) == key
    failed, differs, not_source = agree([int(not crossed), int(differ), int(differ and not source)])
    if failed:
        return Meeting.FAILED
    if not differs:
        return Meeting.SAME
    return Meeting.HEALS if not_source else Meeting.KEEPS


__all__ = ["ASKED_FOR", "InCrossing", "MAX_GROUPS", "Meeting", "abandon_reason", "compare_at_meeting", "counters_of", "fence_reason",
           "lineage", "quick_fingerprint"]
