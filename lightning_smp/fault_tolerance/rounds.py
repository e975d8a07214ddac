"""``replica_sync`` (DiLoCo) across fault-tolerant replica groups: each sync a round of torchft's ``Manager``.

Between syncs nothing crosses the groups: no quorum, no crossing, no vote, and every inner step is taken. A sync is
a round: a synchronous quorum (a group behind the others, restarted after a failure, receives a live peer's state
there: the model, the inner optimizer, the loop's position and the outer loop's own state, its synced copies and
outer momentum, as torchft's DiLoCo registers them), then one sum across the groups of each rank's part of the
pseudo-gradients, with one flag per parameter that counts the groups that sent theirs (a group that has just healed
holds a peer's pseudo-gradient, not its own, and sends zeros), then the commit vote. Committed, the outer optimizer
steps in every group alike; refused (a group died inside the round), every group sets the fragments back to their
last synced weights and drops the window's training, as torchft's DiLoCo does.

The groups agree on which fragments a round syncs by a first sum of their wishes (a group that stops training
between syncs, or takes a checkpoint, syncs every fragment that trained; one that healed syncs what its peers sync),
so that rounds of different kinds never pair different tensors. The same algorithm as one job's replicate axis
(:class:`~lightning_smp.replica_sync.OuterSync`): torchft's ``DiLoCo`` class is not used, because its fragment
schedule follows torchft's commit count (a sync at a checkpoint or at the end would shift it), and for the pitfalls
measured in ``docs/replica-sync.md`` (the step-0 mosaic, a bucketized all-reduce that drops tensors, no final sync).
"""

from __future__ import annotations

import torch

from lightning_smp.fault_tolerance.flat import pack, unpack
from lightning_smp.fault_tolerance.session import ReplicaGroups
from lightning_smp.fault_tolerance.start import Start
from lightning_smp.replica_sync.outer import OuterSync


class SyncRounds:
    """The syncs of ``replica_sync``'s outer loop, each a round of ``replicas`` (``semi_sync=True``)."""

    def __init__(self, replicas: ReplicaGroups) -> None:
        self.replicas = replicas
        self.started = False

    def start(self, outer: OuterSync) -> None:
        """Once, before the first forward with gradients (after any checkpoint was loaded): a round that syncs nothing
        of its own, where groups that start together at step 0 compare their states (the first group's whole, where
        they differ). A group that (re)joins a running job takes part in its peers' next sync without healing (it
        sends nothing of its own): it heals at its own next sync, at the same point of a step as the peer it heals
        from (the optimizer step's end, where a peer's loop counters and data position are what this group's would
        be)."""
        if self.started:
            return
        self.started = True
        self._round(outer, [], allow_heal=False)

    def sync(self, outer: OuterSync, indices: list[int]) -> None:
        """A round that syncs ``indices`` and whatever fragments the other groups ask for in it."""
        self._round(outer, indices, allow_heal=True)

    @torch.no_grad()
    def _round(self, outer: OuterSync, indices: list[int], *, allow_heal: bool) -> None:
        replicas = self.replicas
        usable = replicas.begin_round(allow_heal)
        if replicas.healed_in_round:
            indices = []  # (the outer loop's own state is the peer's now: its wishes are the peer's)
        elif usable and replicas.start is Start.MADE_SAME and outer.steps == 0:
            outer.restart_from_parameters(0, None)  # (the first group's weights: the anchor of every group)
        wished = torch.zeros(len(outer.fragments), dtype=torch.float32, device=replicas.device)
        wished[indices] = 1.0
        if usable and replicas.cross_sum(wished):
            indices = sorted(set(indices) | {i for i, count in enumerate(wished.tolist()) if count > 0})
            usable = self._average(outer, indices)
        committed = replicas.commit()  # (a failure anywhere in the round refuses it in every group)
        for index in indices:
            fragment = outer.fragments[index]
            if committed:
                outer.step_outer(fragment)
            else:
                fragment.outer.zero_grad(set_to_none=True)
                outer.roll_back(fragment)

    def _average(self, outer: OuterSync, indices: list[int]) -> bool:
        """The pseudo-gradients of ``indices`` averaged across the groups that sent theirs, into the synced copies'
        ``.grad`` (the buffers of the round's first group ride along, applied when it commits)."""
        replicas = self.replicas
        synced = [copy for index in indices for copy in outer.fragments[index].synced]
        if replicas.sends_own_part:
            for index in indices:
                fragment = outer.fragments[index]
                for copy, pseudo in zip(fragment.synced, outer.pseudo_gradients(fragment)):
                    copy.grad = pseudo.to(copy.device)
        first = replicas.manager.participating_rank() == 0
        for item in pack(synced, None, outer.buffers, sends_buffers=first, device=replicas.device):
            if not replicas.cross_sum(item.flat):
                return False
            # (each parameter's flag is summed over the groups that sent a pseudo-gradient: their count)
            senders = int(item.flat[sum(item.sizes)].item()) if item.parameters else 1
            replicas.apply_when_committed(unpack(item, max(senders, 1), None))
        return True


__all__ = ["SyncRounds"]
