"""Both front ends' part in fault-tolerant replica groups (``fault_tolerance``): joining them at setup, each step's
quorum, crossing and vote, what healing copies, what checkpoints record, and the data split over every group. The
step hooks that call these are each front end's own; what runs is :mod:`lightning_smp.fault_tolerance`."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.checkpoint.format import REPLICA_GROUPS_KEY
from lightning_smp.core import HybridShardCore
from lightning_smp.fault_tolerance.session import ReplicaGroups
from lightning_smp.fault_tolerance.state import TrackedState
from lightning_smp.optimizers import step_when_committed
from lightning_smp.replica_sync import SyncReport

if TYPE_CHECKING:
    from lightning_smp.engines.unused import Unreduced


class ReplicaGroupSteps:
    """Mixin of :class:`~lightning_smp.frontend.HybridShardFrontEnd`: the replica groups' glue."""

    core: HybridShardCore
    #: this rank's part in fault-tolerant replica groups (``fault_tolerance``), joined at setup
    _replicas: ReplicaGroups | None = None
    #: the forward pre-hook of the tracked module (the step-0 quorum before the first forward)
    _before_forward: Any = None
    # (the replica_sync mixin's, beside this one in HybridShardFrontEnd: annotations only, never shadowing it)
    _before_replica_forward: Callable[[], None]
    _outer_state: Callable[[], dict[str, Any]]
    _load_outer_state: Callable[[dict[str, Any]], None]
    _last_sync: SyncReport | None

    @property
    def replica_groups(self) -> ReplicaGroups | None:
        """This rank's part in fault-tolerant replica groups (``fault_tolerance``), once setup has joined them;
        ``None`` without the option."""
        return self._replicas

    @property
    def replica_metrics(self) -> dict[str, float]:
        """What the replica groups did at the last optimizer step, for a logger. ``fault_tolerance``: the groups
        whose gradients were averaged, whether it committed, torchft's step, and a heal's source group and transfer
        time (:meth:`~lightning_smp.fault_tolerance.ReplicaGroups.metrics`); ``replica_sync``, when that step (or
        what followed it: a checkpoint, the end of fit) synced the groups: the sync's report
        (:meth:`~lightning_smp.replica_sync.SyncReport.metrics`: the syncs so far, the fragment, the bytes this
        rank sent, the crossing's time, the averaged pseudo-gradient's norm and the groups' drift). Empty without
        either. The Trainer logs them itself (:class:`~lightning_smp.callbacks.ReplicaGroupMetrics`); a Fabric loop
        calls ``fabric.log_dict(fabric.strategy.replica_metrics)`` after each step."""
        values = self._replicas.metrics() if self._replicas is not None else {}
        report = self._last_sync
        return {**values, **report.metrics()} if report is not None else values

    @property
    def _crosses_each_step(self) -> bool:
        """Whether every optimizer step's gradients cross the groups (``fault_tolerance`` without ``replica_sync``)."""
        return self._replicas is not None and not self._replicas.semi_sync

    @property
    def step_committed(self) -> bool:
        """Whether the last optimizer step was committed by every replica group (always ``True`` without
        ``fault_tolerance``). A hand-written loop steps its schedulers and counters only when it is."""
        # (replica_sync: every inner step is taken; only the syncs are voted on)
        return self._replicas is None or self._replicas.semi_sync or self._replicas.last_committed is not False

    def _join_replica_groups(self, device_type: str) -> None:
        """Join the replica groups once this group's process group exists (``fault_tolerance``)."""
        settings = self.core.fault_tolerance
        if settings is not None and self._replicas is None:
            device = self.root_device  # type: ignore[attr-defined]  # Lightning's ParallelStrategy
            # (the group's store is torchrun's or the launcher's, MASTER_PORT; the others reach it at the group's
            # address, not MASTER_ADDR, which torchrun sets to 127.0.0.1)
            self._replicas = ReplicaGroups(settings, device, rank=dist.get_rank(), world_size=dist.get_world_size(),
                                           store_port=int(os.environ["MASTER_PORT"]),
                                           sync_buffers=self.core.options.broadcast_buffers,
                                           semi_sync=self.core.replica_sync is not None)

    def _begin_replica_step(self) -> None:
        """Before a backward: the first of an optimizer step asks for the quorum of live groups."""
        if self._replicas is not None and not self._replicas.semi_sync:
            self._replicas.begin_step()

    def _reduce_across_groups(self, optimizer: Any, notes: Unreduced | None = None) -> None:
        """After the group's own reduction (the engine's ``settle_gradients``), before clipping and the step: the
        gradients of ``optimizer``'s parameters averaged across the live groups (``notes``: the engine's
        unused-parameter notes, reduced along)."""
        if self._replicas is not None and not self._replicas.semi_sync:
            self._replicas.reduce([p for group in optimizer.param_groups for p in group["params"]], notes)

    def _commit_step(self, optimizer: Any) -> bool:
        """The vote of :func:`~lightning_smp.optimizers.step_when_committed`: step only if every group commits."""
        return self._replicas is None or self._replicas.commit()

    def _gate_steps(self, optimizer: Any) -> Any:
        """``optimizer`` stepping only when every replica group commits (``fault_tolerance``), else as it is."""
        if self.core.fault_tolerance is None or self.core.replica_sync is not None:
            return optimizer  # (replica_sync: the inner steps are each group's own; its syncs are voted on)
        return step_when_committed(optimizer, self._commit_step)

    def _track_for_healing(self, module: Module, optimizers: Callable[[], Sequence[Optimizer]],
                           extra: Callable[[], dict[str, Any]] = dict,
                           load_extra: Callable[[dict[str, Any]], None] = lambda state: None) -> None:
        """What this rank sends a healing group, and receives when this group heals; at step 0, the quorum and the
        groups' comparison before the first forward (:meth:`ReplicaGroups.before_forward`)."""
        if self._replicas is not None:
            replicas = self._replicas
            if replicas.semi_sync:  # (replica_sync: the outer loop's state too, as torchft's DiLoCo registers it)
                extra, load_extra = self._with_outer(extra, load_extra)
            replicas.track(TrackedState.of(module, optimizers, extra, load_extra))
            if self._before_forward is not None:
                self._before_forward.remove()  # (a model set up again: one hook)
            before = self._before_replica_forward if replicas.semi_sync else replicas.before_forward
            # (first: FSDP2 gathers the root's parameters in its own pre-hook, and a copy from another group made
            # after it would not be what the first forward computes with)
            self._before_forward = module.register_forward_pre_hook(lambda *_: before(), prepend=True)

    def _with_outer(self, extra: Callable[[], dict[str, Any]], load_extra: Callable[[dict[str, Any]], None]) -> tuple[
            Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]:
        """``extra`` and ``load_extra`` with the outer loop's state beside the front end's."""
        def with_outer() -> dict[str, Any]:
            return {**extra(), **self._outer_state()}

        def load_with_outer(state: dict[str, Any]) -> None:
            state = dict(state)
            self._load_outer_state(state)
            load_extra(state)

        return with_outer, load_with_outer

    def _replica_checkpoint_state(self) -> dict[str, Any]:
        """What a persistent checkpoint records of the replica groups (torchft's step), to resume from."""
        return {REPLICA_GROUPS_KEY: self._replicas.state_dict()} if self._replicas is not None else {}

    def _resume_replica_groups(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint's record of the replica groups' step, back into torchft (a checkpoint of a run without
        ``fault_tolerance`` has none: the step stays)."""
        state = checkpoint.pop(REPLICA_GROUPS_KEY, None)
        if self._replicas is not None and state is not None:
            self._replicas.load_state_dict(state)

    def _writes_checkpoints(self) -> bool:
        """Whether this group writes the job's persistent checkpoints (all groups hold the same state: one writes)."""
        return self._replicas is None or self._replicas.writes_checkpoints()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Lightning's split of the data over the ranks, and with ``fault_tolerance`` over every rank of every group:
        group ``g``'s rank ``r`` reads part ``g x hybrid_shard_degree + r`` of ``groups x hybrid_shard_degree``."""
        kwargs = dict(super().distributed_sampler_kwargs or {})  # type: ignore[misc]  # the Lightning base class's
        settings = self.core.fault_tolerance
        if settings is None or not kwargs:
            return kwargs
        world = int(kwargs["num_replicas"])
        return {**kwargs, "num_replicas": settings.groups * world, "rank": settings.group * world + int(kwargs["rank"])}


__all__ = ["ReplicaGroupSteps"]
