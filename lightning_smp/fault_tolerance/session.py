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
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_smp.config.fault_tolerance import FaultTolerance
from lightning_smp.errors import FaultToleranceError
from lightning_smp.fault_tolerance.state import TrackedState, local
from lightning_smp.fault_tolerance.transport import address_towards, bound_http_transport

log = logging.getLogger(__name__)


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


def _process_group(device: torch.device, timeout: timedelta) -> Any:
    """torchft's reconfigurable process group for torch's default backend of ``device``'s type (NCCL on CUDA, XCCL
    on XPU, gloo on the CPU and elsewhere)."""
    from torchft import process_group

    backend = dist.Backend.default_device_backend_map.get(device.type, "gloo")
    kind = {"nccl": process_group.ProcessGroupNCCL, "xccl": process_group.ProcessGroupXCCL}.get(
        backend, process_group.ProcessGroupGloo)
    return kind(timeout=timeout)


class ReplicaGroups:
    """This rank's torchft ``Manager`` and what the front ends ask of it.

    Arguments:
        settings: the ``fault_tolerance`` option.
        device: the root device (its type picks the process group across groups).
        rank, world_size: this rank in its group, and the group's size (``hybrid_shard_degree``).
        store: ``(host, port)`` of the group's ``TCPStore`` (``MASTER_ADDR``/``MASTER_PORT``).
    """

    def __init__(self, settings: FaultTolerance, device: torch.device, *, rank: int, world_size: int,
                 store: tuple[str, int]) -> None:
        from torchft import Manager

        self.settings = settings
        self.device = device
        timeout = timedelta(seconds=settings.timeout)
        host = settings.host or address_towards(settings.lighthouse_url)
        self._tracked: TrackedState | None = None
        self.manager = Manager(
            pg=_process_group(device, timeout), load_state_dict=None, state_dict=None,
            min_replica_size=settings.min_groups, use_async_quorum=True, timeout=timeout,
            quorum_timeout=timedelta(seconds=settings.quorum_timeout), connect_timeout=timeout, rank=rank,
            world_size=world_size, store_addr=store[0], store_port=store[1], lighthouse_addr=settings.lighthouse_url,
            replica_id=f"group{settings.group}", hostname=host, checkpoint_transport=bound_http_transport(timeout, host),
            init_sync=True,
        )
        # the commit vote inside the group: one all-reduce over the group's own ranks instead of torchft's gRPC
        # barrier at group rank 0 (the same decision), so that it also carries the unused-parameter notes
        self._vote = _GroupVote(self.manager._client, device)
        self.manager._client = self._vote
        self.manager.register_state_dict_fn("lightning_smp", self._load_tracked, self._tracked_state)
        self._in_step = False
        self._reduced = False
        self._notes: UnusedNotes | None = None
        self._first_quorum_checked = False
        #: whether the last vote committed (``None`` before the first)
        self.last_committed: bool | None = None
        #: the committed step at which this group last received a peer's state (``None``: never)
        self.healed_at: int | None = None

    # ------------------------------------------------------------------ what healing copies

    def track(self, state: TrackedState) -> None:
        """What this rank sends to a healing peer and receives when it heals."""
        self._tracked = state

    def _tracked_state(self) -> dict[str, Any]:
        if self._tracked is None:
            raise FaultToleranceError("a peer asked for this group's state before the model was set up.")
        return self._tracked.state_dict()

    def _load_tracked(self, state: dict[str, Any]) -> None:
        if self._tracked is None:
            raise FaultToleranceError("a peer's state arrived before the model was set up.")
        self._tracked.load_state_dict(state)
        self.healed_at = self.manager.current_step()
        log.info("replica group %d healed from a live peer at step %d", self.settings.group, self.healed_at)

    # ------------------------------------------------------------------ a step

    def begin_step(self) -> None:
        """The first backward of an optimizer step: ask for the quorum of live groups (answered while the backward
        runs). Later calls in the same step do nothing."""
        if not self._in_step:
            self._in_step = True
            self._reduced = False
            self.manager.start_quorum()

    def reduce(self, parameters: Sequence[Tensor], notes: UnusedNotes | None = None) -> None:
        """Average every parameter's gradient (this rank's part of it) across the participating groups, in one
        all-reduce per dtype; a parameter that no group gave a gradient keeps ``.grad`` ``None``, one that some did
        gets their average (the others count as zeros, as DDP counts a rank that did not use it). Call it on every
        rank after the group's own reduction, before :meth:`commit`.

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
        trainable = [p for p in parameters if p.requires_grad]
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for parameter in trainable:
            by_dtype.setdefault(parameter.dtype, []).append(parameter)
        if notes is not None and not by_dtype:
            by_dtype[torch.float32] = []
        for position, (dtype, group) in enumerate(by_dtype.items()):
            sizes = [local(p).numel() for p in group]
            # the notes ride in the first buffer: one indicator per parameter and level (level >= 1, 2, 3), so that
            # the average is positive where some group's level reached it and their count is the maximum level
            levels = notes.levels if notes is not None and position == 0 else None
            marks = 0 if levels is None or notes is None else notes.LEVELS * levels.numel()
            flat = torch.zeros(sum(sizes) + len(group) + marks,
                               dtype=dtype if dtype.is_floating_point else torch.float32,
                               device=local(group[0]).device if group else self.device)
            offset = 0
            for parameter, size in zip(group, sizes):
                if parameter.grad is not None:
                    flat[offset:offset + size].copy_(local(parameter.grad).reshape(-1))
                offset += size
            # one flag per parameter: whether this group gave it a gradient (averaged: zero iff no group did)
            flat[offset:offset + len(group)] = torch.tensor([p.grad is not None for p in group], dtype=flat.dtype)
            if levels is not None and notes is not None:
                thresholds = torch.arange(1, notes.LEVELS + 1, device=levels.device)
                flat[offset + len(group):] = (levels.view(-1, 1) >= thresholds).reshape(-1).to(flat.device, flat.dtype)
            self.manager.allreduce(flat).wait()
            if levels is not None and notes is not None:
                marked = flat[offset + len(group):].view(-1, notes.LEVELS) > 0
                notes.levels = marked.sum(dim=1).to(levels.device, torch.uint8)
            given = flat[offset:offset + len(group)].tolist()  # (one read, not one per parameter)
            offset = 0
            for parameter, size, anywhere in zip(group, sizes, given):
                averaged = flat[offset:offset + size]
                offset += size
                if anywhere == 0:
                    parameter.grad = None
                elif parameter.grad is not None:
                    local(parameter.grad).copy_(averaged.view_as(local(parameter.grad)))
                else:
                    parameter.grad = _grad_like(parameter, averaged)

    def _wait_quorum(self) -> None:
        """The quorum of this step; without one within ``quorum_timeout`` the lighthouse is gone (or out of reach),
        and no group can commit again: raised, naming it, on every rank."""
        try:
            self.manager.wait_quorum()
        except Exception as err:  # (torchft's client raises TimeoutError, or its transport's errors)
            raise FaultToleranceError(
                f"replica group {self.settings.group}: no quorum of replica groups within quorum_timeout="
                f"{self.settings.quorum_timeout:g} s ({type(err).__name__}: {err}). The lighthouse at"
                f" {self.settings.lighthouse} does not answer: it died, or this group lost its link to it. The job"
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
        if quorum > 1 and manager.current_step() == 0 and manager.num_participants() <= 1 and self.healed_at is None:
            raise FaultToleranceError(
                f"replica group {self.settings.group} found no live peer to heal from, and the lighthouse"
                f" ({self.settings.lighthouse}) has formed quorums before (this is quorum {quorum}): the groups that"
                " trained are gone, and starting from this group's own initialisation would silently restart"
                " training. Fix: resume from the last checkpoint (Trainer.fit(ckpt_path=...), fabric.load), or"
                " start a new lighthouse for a new run."
            )

    def writes_checkpoints(self) -> bool:
        """Whether this group writes the job's persistent checkpoints: the first participant of the last quorum
        (before any quorum: group 0), so that exactly one live group writes."""
        if self.manager._quorum_future is None:  # (no quorum yet; participating_rank would be None)
            return self.settings.group == 0
        return self.manager.participating_rank() == 0

    def commit(self) -> bool:
        """Vote on the step; ``True`` only if every participating group commits (the optimizer must step then, and
        only then). A healing group applies its peer's state here first. The unused-parameter notes given to
        :meth:`reduce` are reduced inside the vote and applied here (raising, on every rank alike, where the engine's
        own reduction would have)."""
        notes, self._notes = self._notes, None
        self._vote.notes = notes
        committed = bool(self.manager.should_commit())
        self._in_step = False
        self.last_committed = committed
        if notes is not None:
            levels = self._vote.levels if self._vote.levels is not None else notes.levels
            if committed or self._vote.refused:
                notes.apply(levels)  # (a refused step raises here: the notes name what is wrong)
            else:
                notes.forget()  # (the step's gradients are dropped: a new window)
        if not committed:
            log.warning("replica group %d: step %d not committed (a group left, or a collective across groups"
                        " failed); its gradients are dropped", self.settings.group, self.manager.current_step())
        return committed

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


class _GroupVote:
    """torchft's ``ManagerClient`` (``Manager._client``; torchft 0.2.0 calls its ``_quorum`` and ``should_commit``),
    with the commit vote taken as one all-reduce (MAX) over the group's own ranks, where torchft's own is a gRPC
    barrier at group rank 0's ManagerServer. The decision is the same (commit only if every rank of the group votes
    to), and the all-reduce also carries the step's unused-parameter notes (:attr:`notes`): it is the only
    collective inside the group between the all-reduce across groups and the optimizer step, as, in a run without
    fault tolerance, the engine's own reduction of the notes is."""

    def __init__(self, client: Any, device: torch.device) -> None:
        self._client = client
        self._device = device
        #: the step's notes, if any (their ``levels``: this rank's, or this rank's pair's across the groups)
        self.notes: UnusedNotes | None = None
        #: every rank's levels (MAX), after :meth:`should_commit`
        self.levels: Tensor | None = None
        #: whether the last vote refused a step that the notes show wrong (a gradient missing on some rank)
        self.refused = False

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        return self._client._quorum(*args, **kwargs)

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        notes = self.notes
        votes = torch.tensor([0 if should_commit else 1], dtype=torch.uint8, device=self._device)
        if notes is not None:
            votes = torch.cat([notes.levels.to(votes.device, torch.uint8), votes])
        if dist.get_world_size() > 1:
            dist.all_reduce(votes, op=dist.ReduceOp.MAX, async_op=True).wait(timeout)
        self.levels = votes[:-1] if notes is not None else None
        self.refused = notes is not None and notes.refuses(votes[:-1])
        return int(votes[-1]) == 0 and not self.refused


def _grad_like(parameter: Tensor, values: Tensor) -> Tensor:
    """A gradient for ``parameter`` (none on this group) holding ``values``, laid out as the parameter."""
    if isinstance(parameter, DTensor):
        shard = values.view(parameter.to_local().shape).clone()
        return DTensor.from_local(shard, parameter.device_mesh, parameter.placements, run_check=False,
                                  shape=parameter.shape, stride=parameter.stride())
    return values.view(parameter.shape).clone()


def group_store() -> tuple[str, int]:
    """The group's ``TCPStore`` as torchrun and Lightning's launchers export it."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])


__all__ = ["ReplicaGroups", "group_store"]
