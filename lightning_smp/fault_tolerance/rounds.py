"""``replica_sync`` (DiLoCo) across fault-tolerant replica groups: each sync a round of torchft's ``Manager``.

Between syncs nothing crosses the groups: no quorum, no crossing, no vote, and every inner step is taken. A sync is
a round: a synchronous quorum (in a sync right after an optimizer step, a group behind the others, restarted after a
failure, receives a live peer's state there: the model, the inner optimizer, the loop's position and the outer loop's
own state, its synced copies and outer momentum, as torchft's DiLoCo registers them; only from a peer at the same
point of its step), then one sum across the groups of each rank's part of the pseudo-gradients, with one flag per
parameter that counts the groups that sent theirs (a group that has just healed holds a peer's pseudo-gradient, not
its own, and sends zeros, as one behind that has not healed yet), then the commit vote. Committed, the outer optimizer
steps; refused (a group died inside the round), the group sets the fragments back to their last synced weights and
drops the window's training, as torchft's DiLoCo does.

The groups agree on which fragments a round syncs by a first sum of their wishes (a group that stops training
between syncs, or takes a checkpoint, syncs every fragment that trained; one that healed syncs what its peers sync),
so that rounds of different kinds never pair different tensors. The same algorithm as one job's replicate axis
(:class:`~lightning_smp.replica_sync.OuterSync`): torchft's ``DiLoCo`` class is not used, because its fragment
schedule follows torchft's commit count (a sync at a checkpoint or at the end would shift it), and for the pitfalls
measured in ``docs/replica-sync.md`` (the step-0 mosaic, a bucketized all-reduce that drops tensors, no final sync).
"""

from __future__ import annotations

import time

import torch

from lightning_smp.collectives import ring_bytes
from lightning_smp.fault_tolerance.flat import pack, unpack
from lightning_smp.fault_tolerance.session import ReplicaGroups
from lightning_smp.fault_tolerance.start import Start
from lightning_smp.replica_sync.outer import OuterSync

#: the kinds of round: after an inner optimizer step (the point of a step where every group's loop counters and
#: schedulers stand alike, the only one a group heals in), and any other (the start, a checkpoint, the end of fit)
AFTER_STEP, BETWEEN_STEPS = "after_step", "between_steps"


class SyncRounds:
    """The syncs of ``replica_sync``'s outer loop, each a round of ``replicas`` (``semi_sync=True``)."""

    def __init__(self, replicas: ReplicaGroups) -> None:
        self.replicas = replicas
        self.started = False

    def start(self, outer: OuterSync) -> None:
        """Once, before the first forward with gradients (after any checkpoint was loaded): a round that syncs nothing
        of its own, where groups that start together at step 0 compare their states (the first group's whole, where
        they differ), again until one commits. A group that (re)joins a running job takes part in its peers' next
        sync without healing (it sends nothing of its own): it heals at its own next sync after an optimizer step,
        from a peer at the same point of its step (where a peer's loop counters, schedulers and data position are what
        this group's would be); a peer's state from another point is not taken."""
        while not self.started:
            self.started = self._round(outer, [], kind=BETWEEN_STEPS)

    def sync(self, outer: OuterSync, indices: list[int], *, after_step: bool) -> None:
        """A round that syncs ``indices`` and whatever fragments the other groups ask for in it (``after_step``: right
        after an inner optimizer step, the only kind of round in which a group behind the others heals)."""
        self._round(outer, indices, kind=AFTER_STEP if after_step else BETWEEN_STEPS)

    @torch.no_grad()
    def _round(self, outer: OuterSync, indices: list[int], *, kind: str) -> bool:
        """One round; whether it committed."""
        replicas = self.replicas
        usable = replicas.begin_round(kind, allow_heal=kind == AFTER_STEP)
        healed = replicas.healed_in_round
        if healed:
            indices = []  # (the outer loop's own state is the peer's now: its wishes are the peer's)
        elif usable and replicas.compared_in_round and replicas.start is Start.MADE_SAME:
            # (the first group's weights and inner state: the anchor of every group's outer loop from now on)
            outer.restart_from_parameters(outer.steps, outer.momentum() or None)
        if usable and not replicas.compared_in_round:
            # (every sync a meeting: the groups at the highest step hold the same synced weights and outer momentum,
            # or the round is dropped and the groups that did not move on last heal from the one that did)
            usable = replicas.meet([copy for fragment in outer.fragments for copy in fragment.synced]
                                   + outer.momentum())
        wished = torch.zeros(len(outer.fragments), dtype=torch.float32, device=replicas.device)
        wished[indices] = 1.0
        agreed = usable and replicas.cross_sum(wished)
        started, payload = time.perf_counter(), 0
        sends_own = replicas.sends_own_part
        trained = {i for i, fragment in enumerate(outer.fragments) if fragment.synced_at < outer.steps}
        if agreed:
            indices = sorted(set(indices) | {i for i, count in enumerate(wished.tolist()) if count > 0})
            payload = self._average(outer, indices)
        seconds = time.perf_counter() - started
        groups = replicas.manager.num_participants() if agreed else 0
        committed = replicas.commit()  # (refused in this group if it failed anywhere in the round)
        if not committed and healed and not agreed:
            # (the peer drops the fragments it wanted: this group, which holds the peer's window now and does not know
            # which, drops every fragment that trained)
            indices = [i for i, fragment in enumerate(outer.fragments) if fragment.synced_at < outer.steps]
        measured = torch.zeros(3, dtype=torch.float64)
        for index in indices:
            fragment = outer.fragments[index]
            if committed:
                # (drift: only what this group trained and sent itself; a group that healed holds its peer's)
                measured += outer.measure(fragment, own=sends_own and index in trained)
                outer.step_outer(fragment)
            else:
                fragment.outer.zero_grad(set_to_none=True)
                outer.roll_back(fragment)
        if committed and indices:
            outer.record(indices, measured, groups=groups, sent_bytes=round(ring_bytes("all_reduce", payload, groups)),
                         seconds=seconds)
        return committed

    def _average(self, outer: OuterSync, indices: list[int]) -> int:
        """The pseudo-gradients of ``indices`` averaged, parameter by parameter, across the groups that sent theirs
        (a fragment that has not trained since its last sync sends nothing), into the synced copies' ``.grad``; the
        buffers of the first up-to-date group ride along, applied when the round commits. A crossing that fails is
        reported to torchft, whose vote then refuses the round. Returns the bytes of this rank's pseudo-gradients
        that crossed."""
        replicas = self.replicas
        synced = [copy for index in indices for copy in outer.fragments[index].synced]
        if replicas.sends_own_part:
            for index in indices:
                fragment = outer.fragments[index]
                if fragment.synced_at < outer.steps:
                    for copy, pseudo in zip(fragment.synced, outer.pseudo_gradients(fragment)):
                        copy.grad = pseudo.to(copy.device)
        payload = 0
        for item in pack(synced, None, outer.buffers, sends_buffers=replicas.first_up_to_date,
                         device=replicas.device):
            if not replicas.cross_sum(item.flat):
                return payload
            payload += sum(item.sizes) * item.flat.element_size()
            # (each parameter's flag summed over the groups: how many sent it; unpack leaves the sums, and
            # None where nobody sent)
            at = sum(item.sizes)
            senders = item.flat[at:at + len(item.parameters)].tolist()
            replicas.apply_when_committed(unpack(item, 1, None))
            for summed, count in zip(item.parameters, senders):
                if summed.grad is not None and count > 1:
                    summed.grad.div_(count)
        return payload


__all__ = ["SyncRounds"]
