"""One rank's part in fault-tolerant replica groups (torchft's ``Manager``), as both front ends drive it.

Per optimizer step: :meth:`ReplicaGroups.begin_step` once, at the step's first backward (the quorum of live groups
is computed while the backward runs); after the last backward, inside the group's own reduction (reduce-scatter
under FSDP2, nothing for a group of one rank), :meth:`~ReplicaGroups.reduce` averages every parameter's local
gradient across the participating groups in one all-reduce; then :meth:`~ReplicaGroups.commit` votes, and the
optimizer steps only if every group commits. A group that (re)joins while others train receives a live peer's state
(:class:`~lightning_smp.fault_tolerance.state.TrackedState`) at its first vote, before its first step.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import AllreduceOptions, BroadcastOptions

from lightning_smp.config.fault_tolerance import FaultTolerance
from lightning_smp.errors import FaultToleranceError
from lightning_smp.fault_tolerance.agreement import (
    InCrossing,
    Meeting,
    abandon_reason,
    compare_at_meeting,
    counters_of,
    fence_reason,
    lineage,
    quick_fingerprint,
)
from lightning_smp.fault_tolerance.crossing import LighthouseWatch, crossing_process_group, wait_for_crossing
from lightning_smp.fault_tolerance.flat import pack, unpack
from lightning_smp.fault_tolerance.start import Start, agree, agree_on_start
from lightning_smp.fault_tolerance.state import TrackedState
from lightning_smp.fault_tolerance.transport import address_towards, bound_http_transport, check_host, check_store
from lightning_smp.fault_tolerance.vote import GroupVote, UnusedNotes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepReport:
    """What the last vote decided, as the front ends log it (:meth:`ReplicaGroups.metrics`)."""

    #: committed steps so far (torchft's, the same in every group)
    step: int
    committed: bool
    #: the groups whose gradients were averaged (a group that healed in this step is not one of them)
    groups: int
    #: this step's heal, if this group healed in it: the source group, and how long the transfer took
    healed_from: int | None = None
    heal_seconds: float | None = None
    #: the groups met holding different states in this step (it was dropped; the groups that moved on last are kept,
    #: the others heal from them): this group's part, ``"keeps"`` or ``"heals"``
    diverged: str | None = None


#: where the state a group serves for healing records the kind of ``semi_sync`` round it was taken in
ROUND_KEY = "round"
#: how long a crossing runs before the lighthouse's status page is read, and then how often
WATCH_GRACE, WATCH_EVERY = 1.0, 0.25
#: the commit fence's reads of the lighthouse's page before it gives up on confirming a step (and drops it)
FENCE_READS = 3
#: a group gives up when it has committed no step for ``quorum_timeout`` seconds, over at least this many uncommitted
#: steps in a row (both: one failure, however slow, is not a streak; a step that failed because a group vanished is
#: followed by one without it)
GIVE_UP_AFTER = 2


class ReplicaGroups:
    """This rank's torchft ``Manager`` and what the front ends ask of it.

    Arguments:
        settings: the ``fault_tolerance`` option.
        device: the root device (its type picks the process group across groups).
        rank, world_size: this rank in its group, and the group's size (``hybrid_shard_degree``).
        store_port: the port of the group's ``TCPStore`` (torchrun's, ``MASTER_PORT``), advertised at the group's
            address (``settings.host``, or the interface that reaches the lighthouse), whatever ``MASTER_ADDR`` is.
        sync_buffers: whether buffers cross the groups with the gradients (DDP's ``broadcast_buffers``).
        semi_sync: the groups cross only at ``replica_sync``'s syncs (:mod:`~lightning_smp.fault_tolerance.rounds`),
            never inside a step: each sync a round of its own (a synchronous quorum, in which a group behind the
            others heals before anything is computed, the crossing and the vote), as torchft's DiLoCo needs.
    """

    def __init__(self, settings: FaultTolerance, device: torch.device, *, rank: int, world_size: int,
                 store_port: int, sync_buffers: bool = True, semi_sync: bool = False) -> None:
        from torchft import Manager

        self.settings = settings
        self.device = device
        self.rank = rank
        self.sync_buffers = sync_buffers
        self.semi_sync = semi_sync
        timeout = timedelta(seconds=settings.timeout)
        #: the address every other group reaches this rank at (its process group across groups, its healing server)
        self.host = settings.host or address_towards(settings.lighthouse_url)
        check_host(self.host, settings.group, settings.lighthouse_url)
        #: the group's store is group rank 0's (torchrun's agent beside it): advertised at rank 0's address, which the
        #: group's ranks on other nodes reach too
        self.store_host = _from_group_rank_0(self.host)
        check_store(self.store_host, store_port, settings.group)
        self.store_port = store_port
        self._tracked: TrackedState | None = None
        self.process_group = crossing_process_group(device, timeout, self.host)
        self._transport = bound_http_transport(timeout, self.host, grace=WATCH_GRACE, every=WATCH_EVERY)
        # (a heal is left as a crossing is, when its peers moved on: read in torchft's quorum thread, with a watch of
        # its own)
        self._heal_watch = LighthouseWatch(settings.lighthouse_url)
        self._transport.verdict = lambda: self._leave_when_peers_left(self._heal_watch, time.monotonic())
        self.manager = Manager(
            pg=self.process_group, load_state_dict=None, state_dict=None,
            min_replica_size=settings.min_groups, use_async_quorum=not semi_sync, timeout=timeout,
            quorum_timeout=timedelta(seconds=settings.quorum_timeout), connect_timeout=timeout, rank=rank,
            world_size=world_size, store_addr=self.store_host, store_port=store_port,
            # (zero-padded: torchft orders the groups by replica id as text, and the first is the start's source)
            lighthouse_addr=settings.lighthouse_url, replica_id=f"group{settings.group:04d}", hostname=self.host,
            checkpoint_transport=self._transport,
            # (step 0: the groups' states are compared and, where they differ, made whole from one group:
            # lightning_smp.fault_tolerance.start; torchft's own init_sync heals a mosaic and drops gradients)
            init_sync=False,
        )
        # the commit vote inside the group: one all-reduce over the group's own ranks instead of torchft's gRPC
        # barrier at group rank 0 (the same decision), so that it also carries the unused-parameter notes
        # (the vote waits for a rank that may still be in the step's quorum, its configuration, crossing and heal)
        #: how long a rank waits for the group's other ranks (one of them may still be in the quorum, its process
        #: group's setup, its crossing or its heal)
        self._group_wait = timedelta(seconds=settings.quorum_timeout + 3 * settings.timeout)
        self._vote = GroupVote(self.manager._client, device, group=settings.group, wait=self._group_wait)
        self.manager._client = self._vote
        self._vote.missing = self._heal_missing
        self.manager.register_state_dict_fn("lightning_smp", self._load_tracked, self._tracked_state)
        self._watch = LighthouseWatch(settings.lighthouse_url)
        #: a peer's state this rank received in the current quorum, taken only once every rank of the group has its
        #: own (:meth:`_settle_heal`), and the step and batch count before that quorum
        self._received: dict[str, Any] | None = None
        self._before_quorum: tuple[int, int] = (0, 0)
        #: whether the current quorum may heal this group and its heal is not settled yet
        self._heal_open = False
        self._in_step = False
        self._reduced = False
        self._notes: UnusedNotes | None = None
        self._first_quorum_checked = False
        self._agreed: set[int] = set()  # step-0 quorums whose states were compared (or that tried)
        self._failed_start: set[int] = set()  # those whose comparison failed
        self._crossed: list[tuple[Tensor, Tensor]] = []  # buffers and the values the crossing brought
        self._failure: str | None = None  # the operation that failed last, and how
        self._uncommitted = 0  # uncommitted steps in a row
        self._failing_since: float | None = None
        self._healed_from: int | None = None
        self._healed_in_round = False
        #: the quorum whose crossing completed in the current step (the commit fence asks the lighthouse about it)
        self._crossed_in: int | None = None
        #: the quorum this group last committed in (its lineage, when groups meet with different states)
        self._last_commit_quorum = -1
        #: quorums whose groups compared their states at their first crossing
        self._compared: set[int] = set()
        #: the current step's meeting found the states different: this group's part (``Meeting``)
        self._diverged: Meeting | None = None
        #: semi_sync: when the current round began (the commit fence asks whether this rank lost the lighthouse since)
        self._round_started = time.monotonic()
        #: semi_sync: the kind of the current round (what a peer's served state records)
        self._round_kind: str | None = None
        #: semi_sync: whether the current round compared the groups' states (every group at step 0)
        self.compared_in_round = False
        #: whether the last vote committed (``None`` before the first)
        self.last_committed: bool | None = None
        #: the committed step at which this group last received a peer's state (``None``: never)
        self.healed_at: int | None = None
        #: the last vote's outcome (``None`` before the first)
        self.report: StepReport | None = None
        #: how the step-0 quorum found the groups (``None`` until one was held)
        self.start: Start | None = None

    # ------------------------------------------------------------------ what healing copies

    def track(self, state: TrackedState) -> None:
        """What this rank sends to a healing peer and receives when it heals."""
        self._tracked = state

    def _tracked_state(self) -> dict[str, Any]:
        if self._tracked is None:
            raise FaultToleranceError("a peer asked for this group's state before the model was set up.")
        return {**self._tracked.state_dict(), ROUND_KEY: self._round_kind}

    def _load_tracked(self, state: dict[str, Any]) -> None:
        # (torchft applies a peer's state rank by rank; this rank's is kept until every rank of the group has its own)
        if self._tracked is None:
            raise FaultToleranceError("a peer's state arrived before the model was set up.")
        self._received = state

    def _ask_quorum(self, start: Callable[[], None], allow_heal: bool = True) -> None:
        """``start`` (torchft's ``start_quorum``), the step and batch count noted before it."""
        manager = self.manager
        self._received, self._heal_open, self._healed_in_round = None, allow_heal, False
        self._before_quorum = (int(manager._step), int(manager._batches_committed))
        start()

    def _heal_missing(self) -> bool:
        """Whether the current quorum heals this group and this rank holds no peer's state from it (the transfer
        failed, or was left). (torchft decides a heal per group: every rank of the group is told alike.)"""
        quorum = self._vote.quorum
        return self._heal_open and quorum is not None and bool(quorum.heal) and self._received is None

    def _settle_heal(self, missing_anywhere: bool, at: int) -> None:
        """A peer's state is taken only where every rank of the group received its own (``missing_anywhere``: some
        rank did not, the group agreed on it): a group of ranks half healed would train a mosaic of two states. Not
        taken, every rank is back at the step it held before the quorum (torchft moved the ranks that received it to
        the peer's), behind, and heals at a later quorum. ``at``: the step the peer's state is of."""
        received, self._received = self._received, None
        heal_open, self._heal_open = self._heal_open, False
        manager = self.manager
        if missing_anywhere:
            if heal_open:
                manager._step, manager._batches_committed = self._before_quorum
                log.warning("replica group %d: a peer's state did not reach every rank of the group; none takes it"
                            " (the group stays at step %d, and heals at a later quorum)", self.settings.group,
                            manager._step)
            return
        if received is None or self._tracked is None:
            return
        if received.get(ROUND_KEY) != self._round_kind:
            # (semi_sync: the peer took its state in another kind of round, at another point of a step, whose loop
            # counters and schedulers this group's step would then count twice or not at all: not taken; this group
            # stays behind, sends nothing of its own in this round, and heals at a later one)
            manager._step, manager._batches_committed = self._before_quorum  # (torchft moved it to the peer's)
            log.info("replica group %d: a peer's state from a %s round not taken in a %s round",
                     self.settings.group, received.get(ROUND_KEY), self._round_kind)
            return
        self._tracked.load_state_dict(received)
        self.healed_at = at
        self._healed_in_round = True
        quorum = self._vote.quorum
        source = quorum.recover_src_replica_rank if quorum is not None else None
        self._healed_from = (_group_of(quorum.replica_ids[source]) if quorum is not None and source is not None
                             else None)
        log.info("replica group %d healed from group %s at step %d", self.settings.group, self._healed_from,
                 self.healed_at)

    # ------------------------------------------------------------------ a step

    def begin_step(self) -> None:
        """The first backward of an optimizer step: ask for the quorum of live groups (answered while the backward
        runs). Later calls in the same step do nothing."""
        if not self._in_step:
            self._in_step = True
            self._reduced = False
            self._crossed = []
            self._healed_from = None
            self._crossed_in, self._diverged = None, None
            self._ask_quorum(self.manager.start_quorum)

    def reduce(self, parameters: Sequence[Tensor], notes: UnusedNotes | None = None) -> None:
        """Average every parameter's gradient (this rank's part of it) across the participating groups, in one
        all-reduce per dtype; a parameter that no group gave a gradient keeps ``.grad`` ``None``, one that some did
        gets their average (the others count as zeros, as DDP counts a rank that did not use it). With
        ``sync_buffers``, the first participating group's buffers ride along (applied when the step commits). Call it
        on every rank after the group's own reduction, before :meth:`commit`.

        ``notes``: the engine's unused-parameter notes of this step, unreduced
        (``settle_gradients(defer_unused=True)``): reduced across the groups inside the first all-reduce, then
        across the group inside the commit vote, and applied by :meth:`commit` (so that the step waits on no
        collective of their own)."""
        self.begin_step()  # (an optimizer step without a backward in it: the quorum is asked for here)
        if self._reduced:
            # (clipping asked first: the gradients are averaged already; notes of a backward after it are reduced
            # inside the group only)
            self._notes = notes or self._notes
            return
        self._reduced = True
        self._notes = notes
        self._wait_quorum()
        self._check_first_quorum()
        if not self._agree_on_start():
            return  # (the step is dropped: the comparison failed, and the next quorum compares again)
        if self._vote.quorum is not None and self._vote.quorum.quorum_id not in self._compared:
            # (the first crossing of a new quorum: groups that meet compare what they hold; a partition, a kill and
            # a (re)join each make a new quorum)
            tracked = self._tracked
            state = ([] if tracked is None
                     else [tensor for name, tensor in tracked.local_tensors() if name not in tracked.buffers])
            if not self.meet(state, counters_of(tracked.extra()) if tracked is not None else []):
                return  # (dropped: the states differ, or the comparison failed)
        manager = self.manager
        buffers = self._tracked.buffer_tensors() if self._tracked is not None and self.sync_buffers else []
        packed = pack(parameters, notes, buffers, sends_buffers=manager.participating_rank() == 0,
                      device=self.device)
        for item in packed:
            if not manager.is_participating():
                item.flat.zero_()  # (a group that heals in this step contributes nothing)
            if not self._cross(item.flat):
                return  # (the step is dropped at the vote: torchft holds the error)
        participants = manager.num_participants()
        self._crossed = [pair for item in packed for pair in unpack(item, participants, notes)]

    def _cross(self, flat: Tensor) -> bool:
        """One sum across the participating groups, in place; ``False`` (the error reported to torchft, which then
        refuses the step) if it failed or was abandoned because the lighthouse stopped hearing from a participant."""
        if self.manager.errored() or not self._in_place("the all-reduce across groups", self.process_group.allreduce,
                                                        flat, _options(AllreduceOptions, reduceOp=dist.ReduceOp.SUM)):
            return False
        quorum = self._vote.quorum
        if quorum is not None and quorum.replica_world_size > 1:
            self._crossed_in = quorum.quorum_id  # (the commit fence asks the lighthouse about it)
        return True

    # ------------------------------------------------------------------ a sync of semi-synchronous groups

    def begin_round(self, kind: str, allow_heal: bool = True) -> bool:
        """``semi_sync``: the quorum of a sync, waited for (with ``allow_heal``, a group behind the others receives a
        live peer's state here, before its part of the sync is computed: :attr:`healed_in_round`; only from a peer in
        a round of the same ``kind``, the same point of a step), the first quorum's check and, where every group is at
        step 0, the groups' comparison (:attr:`compared_in_round`). ``False``: the round is dropped (reported to
        torchft; its vote refuses it)."""
        self._crossed, self._notes, self._healed_from, self._healed_in_round = [], None, None, False
        self._crossed_in, self._diverged = None, None
        self._round_started = time.monotonic()
        self._in_step = True
        self._round_kind = kind
        compared = len(self._agreed)
        # (synchronous: a heal is received before it returns, and taken here once every rank of the group has its own)
        self._wait_quorum(lambda: self._ask_quorum(lambda: self.manager.start_quorum(allow_heal=allow_heal),
                                                   allow_heal))
        (missing,) = agree([int(self._heal_missing())], self.device, wait=self._group_wait)
        self._settle_heal(bool(missing), at=self.manager.current_step())
        self._check_first_quorum()
        usable = self._agree_on_start()
        self.compared_in_round = len(self._agreed) > compared
        return usable

    @property
    def healed_in_round(self) -> bool:
        """Whether this group received a live peer's state in the current round."""
        return self._healed_in_round

    @property
    def first_up_to_date(self) -> bool:
        """Whether this group is the first of the last quorum's groups at its highest step (the same answer in every
        group, whatever each asked of its quorum; before any quorum: group 0)."""
        quorum = self._vote.quorum
        return self.settings.group == 0 if quorum is None else quorum.max_replica_rank == 0

    @property
    def sends_own_part(self) -> bool:
        """Whether this group's own training counts in the current round: not when it has just received a peer's
        state (it holds the peer's), nor when it is behind the others without having healed yet (a round that allows
        no heal)."""
        quorum = self._vote.quorum
        behind = quorum is not None and quorum.max_step > self.manager.current_step()
        return not self._healed_in_round and not behind

    def cross_sum(self, flat: Tensor) -> bool:
        """``flat`` summed across the round's groups, in place. ``False``: it failed (reported; the vote refuses the
        round)."""
        return self._cross(flat)

    def apply_when_committed(self, buffers: Sequence[tuple[Tensor, Tensor]]) -> None:
        """Pairs of a buffer and the value a crossing brought, copied in once the round commits."""
        self._crossed.extend(buffers)

    def _in_place(self, operation: str, call: Any, tensor: Tensor, options: Any) -> bool:
        """``call`` (a collective of the process group across groups) on ``tensor``, in place (through the root
        device where it lives elsewhere), waited for as every crossing is (:meth:`_wait`). ``False``: it failed or
        was abandoned (reported)."""
        sent = tensor.to(self.device) if tensor.device != self.device else tensor
        work = self._collective(operation, call, [sent], options)
        if work is None or not self._wait(operation, work):
            return False
        if sent is not tensor:
            tensor.copy_(sent)
        return True

    def _collective(self, operation: str, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except Exception as err:  # noqa: BLE001  # (the process group's own errors: reported, the step dropped)
            self._fail(operation, err)
            return None

    def _wait(self, operation: str, work: Any) -> bool:
        verdict = self._leave_when_peers_left(self._watch, time.monotonic())
        crossing = wait_for_crossing(work, self.process_group, verdict=verdict, grace=WATCH_GRACE, every=WATCH_EVERY,
                                     timeout=self.settings.timeout + WATCH_GRACE)
        if crossing.completed:
            return True
        self._fail(operation, FaultToleranceError(crossing.abandoned) if crossing.abandoned
                   else crossing.error or RuntimeError("failed"))
        return False

    def _leave_when_peers_left(self, watch: LighthouseWatch, started: float) -> Callable[[], str | None]:
        """Why this rank leaves what it has waited in since ``started`` (a crossing, a heal) in the current quorum,
        read from ``watch`` at each call (:func:`.agreement.abandon_reason`); ``None``: it waits on. (A group that asks
        for the next quorum may be one that is not in this one, a group starting: the lighthouse's page does not say
        who asks. The rank then leaves a crossing or a heal it could have finished, and the group heals at the next
        quorum, with the new group; measured, a rank that heeds only its peers' requests after losing the lighthouse
        sat 12 s in a heal whose transfer its peer no longer served, while the peer's quorum waited for it.)"""
        asked = [0.0]  # (since when the reads have seen a group ask for the next quorum)

        def verdict() -> str | None:
            quorum = self._vote.quorum
            if quorum is None:
                return None
            view, now = watch.view(), time.monotonic()
            lost = watch.lost_since is not None and watch.lost_since >= started
            asking = view is not None and view.pending > 0
            asked[0] = (asked[0] or now) if asking else 0.0
            return abandon_reason(view, InCrossing(quorum.quorum_id, tuple(quorum.replica_ids), lost,
                                                   now - asked[0] if asking else 0.0))

        return verdict

    def meet(self, tensors: Sequence[Tensor], counters: Sequence[str] = ()) -> bool:
        """Groups that meet at the same step compare what they hold (:func:`.agreement.compare_at_meeting`): this
        rank's ``tensors`` and ``counters``, against the same rank of the groups at the quorum's highest step (a group
        behind heals, and does not compare). ``False``: the step is dropped (reported), because the states differ
        (logged; the groups whose last commit is not in the newest quorum step back, to heal from the one whose is)
        or the comparison failed. At step 0 the start's comparison runs instead (:meth:`_agree_on_start`)."""
        quorum, manager = self._vote.quorum, self.manager
        if quorum is None or quorum.replica_world_size < 2 or quorum.max_step == 0:
            return True
        operation = "comparing the groups' states"
        # (at the quorum's highest step, and not healing: torchft has moved a healing group's step already, and
        # applies the peer's state only at the vote)
        up_to_date = manager.is_participating() and manager.current_step() == quorum.max_step

        def cross(tensor: Tensor) -> bool:
            return manager.errored() is None and self._in_place(
                operation, self.process_group.allreduce, tensor, _options(AllreduceOptions, reduceOp=dist.ReduceOp.MAX))

        found = compare_at_meeting(
            quick_fingerprint(tensors, [f"step={manager.current_step()}", *counters]) if up_to_date else None,
            lineage(self._last_commit_quorum, self.settings.group), device=self.device, all_reduce_max=cross,
            agree=lambda flags: agree(flags, self.device))
        if found is Meeting.SAME:
            self._compared.add(quorum.quorum_id)
            return True
        if found is Meeting.FAILED:
            if manager.errored() is None:  # (another rank of the group failed: this one drops the step too)
                self._fail(operation, FaultToleranceError("it failed on another rank of this group"))
            return False
        self._diverged = found
        keeps = found is Meeting.KEEPS
        self._fail(operation, FaultToleranceError(
            f"the groups met at step {manager.current_step()} (quorum {quorum.quorum_id}) holding different states:"
            f" this group {'keeps its own, the others take it' if keeps else 'takes the state of the group that moved on last'}"
            " (the step is dropped, nothing of it averaged)"))
        return False

    def _fail(self, operation: str, error: BaseException) -> None:
        quorum = self._vote.quorum
        where = f" (the groups meet at {quorum.store_address})" if quorum is not None else ""
        self._failure = f"{operation}{where}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        log.warning("replica group %d: %s", self.settings.group, self._failure)
        self.manager.report_error(error if isinstance(error, Exception) else RuntimeError(str(error)))

    def before_forward(self) -> None:
        """Before a forward with gradients while this group is at step 0 and has not healed: the step's quorum now
        (later steps ask for it at their first backward, answered while the backward runs) and, at a quorum whose
        every participant is at step 0, the groups' states compared and made whole before anything is computed from
        them (:meth:`_agree_on_start`). Otherwise nothing."""
        if (not torch.is_grad_enabled() or self.manager.current_step() != 0 or self.healed_at is not None
                or (self._in_step and self._reduced)):
            return
        self.begin_step()
        self._wait_quorum()
        self._check_first_quorum()
        self._agree_on_start()

    def _agree_on_start(self) -> bool:
        """At a quorum whose every participant is at step 0 (the groups start, or start again from one
        checkpoint): the same parameters and optimizer states in every group before the first step (:mod:`.start`;
        the buffers cross with the gradients at every step). Once per quorum, before its first forward
        (:meth:`before_forward`) or, for a step that had none, before the crossing: the same point of every group's
        step. ``False`` if the comparison failed (reported: the step is dropped; the next quorum compares again)."""
        quorum, manager = self._vote.quorum, self.manager
        if quorum is None or quorum.max_step != 0 or quorum.quorum_id in self._agreed or self._tracked is None:
            return quorum is None or quorum.quorum_id not in self._failed_start
        self._agreed.add(quorum.quorum_id)  # (attempted: never twice in one quorum, whatever the outcome)
        if quorum.replica_world_size == 1:
            self.start = self.start or Start.SAME
            return True
        operation = "comparing the groups' state at step 0"

        buffers = self._tracked.buffers
        # (every rank takes part in the group's agreement whatever happened on it, so that no rank of the group goes
        # on to its forward while another waits for it; only a collective's failure drops the step)
        start = agree_on_start(
            self._tracked.local_tensors(), compared=lambda name: name not in buffers, device=self.device,
            all_reduce_max=lambda t: self._in_place(operation, self.process_group.allreduce, t,
                                                    _options(AllreduceOptions, reduceOp=dist.ReduceOp.MAX)),
            broadcast_from_first=lambda t: self._in_place(operation, self.process_group.broadcast, t,
                                                          _options(BroadcastOptions, rootRank=0, rootTensor=0)),
            group=self.settings.group, usable=manager.errored() is None)
        if start is None:
            self._failed_start.add(quorum.quorum_id)
            if manager.errored() is None:  # (another rank of the group failed: this one drops the step too)
                self._fail(operation, FaultToleranceError("it failed on another rank of this group"))
            return False
        self.start = start
        if self.start is Start.MADE_SAME and dist.get_rank() == 0:
            first = _group_of(sorted(quorum.replica_ids)[0])
            warnings.warn(
                f"replica group {self.settings.group}: the replica groups started from different weights (or"
                f" optimizer states); every group now holds group {first}'s, whole, before the first step. Seed the"
                " model alike in every group (L.seed_everything) to start from your own.", stacklevel=2)
        return True

    def _wait_quorum(self, wait: Callable[[], None] | None = None) -> None:
        """The quorum of this step (``wait``: what waits for it, torchft's ``wait_quorum`` by default); without one
        within ``quorum_timeout`` the lighthouse is gone (or out of reach), and no group can commit again: raised,
        naming it, on every rank."""
        try:
            (wait or self.manager.wait_quorum)()
        except Exception as err:  # (torchft's client raises TimeoutError, or its transport's errors)
            settings, heard = self.settings, self._watch.heard()
            if heard is not None:
                alive = sorted(replica.split(":", 1)[0] for replica, hearing in heard.items() if hearing)
                raise FaultToleranceError(
                    f"replica group {settings.group}: no quorum of replica groups within quorum_timeout="
                    f"{settings.quorum_timeout:g} s ({type(err).__name__}: {err}). The lighthouse at"
                    f" {settings.lighthouse} answers and hears from {', '.join(alive) or 'no group'}: fewer groups"
                    f" than min_groups={settings.min_groups} asked for a quorum (the others are gone, or failed and"
                    " gave up). Fix: start the missing groups again (they heal from a live one), or lower min_groups."
                ) from err
            raise FaultToleranceError(
                f"replica group {settings.group}: no quorum of replica groups within quorum_timeout="
                f"{settings.quorum_timeout:g} s ({type(err).__name__}: {err}). The lighthouse at"
                f" {settings.lighthouse} does not answer: it died, or this group lost its link to it. The job"
                " survives the death of a replica group, not of the lighthouse. Fix: start a lighthouse and every"
                " group again, resuming from the last checkpoint."
            ) from err

    def _check_first_quorum(self) -> None:
        """A group whose first quorum holds no other group, at step 0, in a lighthouse that formed quorums before:
        the groups that trained are gone, and going on would silently restart training from this group's own
        initialisation. Every rank of the group sees the same quorum, and raises alike."""
        if self._first_quorum_checked:
            return
        self._first_quorum_checked = True
        manager = self.manager
        quorum = int(manager._quorum_id)  # torchft 0.2.0 keeps the quorum's id only here
        # (the groups in the quorum, whatever their step: in a round that heals nobody, torchft counts as participants
        # only the groups at the highest step)
        groups = len(self._vote.quorum.replica_ids) if self._vote.quorum is not None else manager.num_participants()
        if quorum > 1 and manager.current_step() == 0 and groups <= 1 and self.healed_at is None:
            raise FaultToleranceError(
                f"replica group {self.settings.group} found no live peer to heal from, and the lighthouse"
                f" ({self.settings.lighthouse}) has formed quorums before (this is quorum {quorum}): the groups that"
                " trained are gone, and starting from this group's own initialisation would silently restart"
                " training. Fix: resume from the last checkpoint (Trainer.fit(ckpt_path=...), fabric.load), or"
                " start a new lighthouse for a new run."
            )

    def writes_checkpoints(self) -> bool:
        """Whether this group writes the job's persistent checkpoints: the first of the last quorum's groups at its
        highest step (before any quorum: group 0), so that exactly one live, up-to-date group writes."""
        return self.first_up_to_date

    def commit(self) -> bool:
        """Vote on the step; ``True`` only if every participating group commits (the optimizer must step then, and
        only then). A healing group applies its peer's state here first; the buffers the crossing brought are
        applied once the step commits. The unused-parameter notes given to :meth:`reduce` are reduced inside the
        vote and applied here (raising, on every rank alike, where the engine's own reduction would have). A group
        that has committed nothing for ``quorum_timeout`` seconds, over :data:`GIVE_UP_AFTER` steps or more in a row,
        raises :class:`FaultToleranceError` on every rank, naming the operation that failed."""
        self._fence()
        notes, self._notes = self._notes, None
        self._vote.notes = notes
        self._vote.give_up = (self._uncommitted + 1 >= GIVE_UP_AFTER and self._failing_since is not None
                              and time.monotonic() - self._failing_since >= self.settings.quorum_timeout)
        committed = bool(self.manager.should_commit())
        # (torchft handed a peer's state over inside it, before the vote, which also agreed on whether every rank of
        # the group received its own)
        self._settle_heal(self._vote.heal_missing, at=self.manager.current_step() - int(committed))
        self._in_step = False
        self.last_committed = committed
        if notes is not None:
            levels = self._vote.levels if self._vote.levels is not None else notes.levels
            if committed or self._vote.refused:
                notes.apply(levels)  # (a refused step raises here: the notes name what is wrong)
            else:
                notes.forget()  # (the step's gradients are dropped: a new window)
        if committed:
            with torch.no_grad():
                for buffer, value in self._crossed:
                    buffer.copy_(value)
            self._uncommitted, self._failing_since, self._failure = 0, None, None
            if self._vote.quorum is not None:
                self._last_commit_quorum = self._vote.quorum.quorum_id
        else:
            self._uncommitted += 1
            self._failing_since = self._failing_since or time.monotonic()
            if self._diverged is Meeting.HEALS:
                # (one step back: at the next quorum this group is behind the group whose state is kept, and
                # torchft heals it from that group, the only one at the highest step)
                self.manager._step -= 1
                log.warning("replica group %d: steps back to %d, to heal from the group that moved on last",
                            self.settings.group, self.manager.current_step())
        self._crossed = []
        healed = self._healed_in_round  # (this step's quorum brought a peer's state, and the group took it)
        self.report = StepReport(
            step=self.step, committed=committed, groups=self.manager.num_participants(),
            healed_from=self._healed_from if healed else None,
            heal_seconds=self._transport.received_seconds if healed else None,
            diverged=self._diverged.value if self._diverged is not None else None)
        self._diverged, self._crossed_in = None, None
        if not committed:
            if self._vote.gave_up:
                raise FaultToleranceError(self._give_up_message())
            log.warning("replica group %d: step %d not committed (%s); its gradients are dropped",
                        self.settings.group, self.manager.current_step(),
                        self._failure or self._torchft_failure() or "a group left, or too few groups")
        return committed

    def _fence(self) -> None:
        """Before the vote of a step whose crossing completed: the group's rank 0 asks the lighthouse whether the
        quorum it crossed in is still the last one formed, with every participant heard
        (:func:`.agreement.fence_reason`); if not, or if the lighthouse cannot be read, the step is dropped (reported
        to torchft: its vote then refuses it on every rank of the group)."""
        quorum = self._vote.quorum
        if self._crossed_in is None or quorum is None or self.rank != 0 or self.manager.errored() is not None:
            return
        for attempt in range(FENCE_READS):
            view = self._watch.view()
            if view is not None:
                break
            time.sleep(0.1 * (attempt + 1))
        # (replica_sync: a group asking for a quorum now refused this sync, when this group was cut off during it;
        # otherwise it may have committed it and asked for the next, right after, as a checkpoint's sync does)
        lost = self._watch.lost_since is not None and self._watch.lost_since >= self._round_started
        reason = fence_reason(view, self._crossed_in, list(quorum.replica_ids),
                              asking_is_leaving=self.semi_sync and lost)
        if reason is not None:
            self._fail("the commit", FaultToleranceError(reason))

    def _torchft_failure(self) -> str | None:
        error = self.manager.errored()
        return None if error is None else str(error.original_exception).splitlines()[0]

    def _give_up_message(self) -> str:
        quorum = self._vote.quorum
        meet = quorum.store_address if quorum is not None else "(no quorum yet)"
        failure = self._failure or self._torchft_failure() or "too few groups to commit (min_groups)"
        return (
            f"replica group {self.settings.group}: no step committed for more than quorum_timeout="
            f"{self.settings.quorum_timeout:g} s ({self._uncommitted} steps in a row). The last failure: {failure}."
            f" This rank is reached at {self.host} (its group's store at {self.store_host}:{self.store_port}); its groups"
            f" meet at {meet}. Fix: every group must reach that address and port and this one's (a firewall, the"
            " interface: fault_tolerance host=...; torchrun sets MASTER_ADDR=127.0.0.1, which this library does not"
            " advertise), then start the groups again, resuming from the last checkpoint."
        )

    def metrics(self) -> dict[str, float]:
        """The last vote's outcome as metrics for a logger: ``fault_tolerance/groups`` (the groups whose gradients
        were averaged), ``fault_tolerance/committed`` (1 or 0), ``fault_tolerance/step``; in a step where this group
        healed also ``fault_tolerance/healed_from`` (the source group) and ``fault_tolerance/heal_seconds`` (the
        transfer); in a step where the groups met holding different states, ``fault_tolerance/diverged`` (1). Empty
        before the first vote."""
        report = self.report
        if report is None:
            return {}
        values = {"fault_tolerance/groups": float(report.groups), "fault_tolerance/committed": float(report.committed),
                  "fault_tolerance/step": float(report.step)}
        if report.healed_from is not None:
            values["fault_tolerance/healed_from"] = float(report.healed_from)
        if report.heal_seconds is not None:
            values["fault_tolerance/heal_seconds"] = report.heal_seconds
        if report.diverged is not None:
            values["fault_tolerance/diverged"] = 1.0
        return values

    @property
    def step(self) -> int:
        """Committed steps (torchft's, the same in every group)."""
        return int(self.manager.current_step())

    def state_dict(self) -> dict[str, int]:
        """torchft's own state (the step, the batches committed), for persistent checkpoints."""
        return dict(self.manager.state_dict())

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.manager.load_state_dict(state)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _options(kind: type, **values: Any) -> Any:
    options = kind()
    for name, value in values.items():
        setattr(options, name, value)
    return options


def _from_group_rank_0(value: str) -> str:
    """``value`` as the group's rank 0 has it (a broadcast over the group's own ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return str(holder[0])


def _group_of(replica_id: str) -> int | None:
    """The group id in a replica id (``group<g>:<uuid>``, as this library names them)."""
    name = replica_id.split(":", 1)[0]
    return int(name[len("group"):]) if name.startswith("group") and name[len("group"):].isdigit() else None


__all__ = ["ReplicaGroups", "StepReport", "UnusedNotes"]
