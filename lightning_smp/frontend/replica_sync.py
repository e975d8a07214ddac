"""Both front ends' part in semi-synchronous replica groups (``replica_sync``, DiLoCo): the outer loop started over
the sharded model, its turn after every optimizer step, a sync wherever training stops between syncs, and its state
in checkpoints. The step hooks that call these are each front end's own; what runs is
:mod:`lightning_smp.replica_sync`."""

from __future__ import annotations

import os
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.checkpoint import CheckpointRun, load_entries, read_record
from lightning_smp.checkpoint.atomic import remove_atomically
from lightning_smp.checkpoint.format import MODEL_KEY, OPTIMIZERS_KEY, REPLICA_SYNC_KEY
from lightning_smp.checkpoint.local import LocalStateCheck, optimizer_state_to_save
from lightning_smp.checkpoint.state_dict import ShardedModel, full_optimizer_states_of_groups
from lightning_smp.core import HybridShardCore
from lightning_smp.errors import UnsupportedOptionError
from lightning_smp.fault_tolerance.rounds import SyncRounds
from lightning_smp.fault_tolerance.session import ReplicaGroups
from lightning_smp.mesh import axis_group
from lightning_smp.names import BACKUP_CPU, REPLICATE_AXIS, SHARD_AXIS, SHARDED, StateDictType
from lightning_smp.replica_sync import OuterSync, SyncReport
from lightning_smp.replica_sync.state import outer_optimizer, restore_outer

#: the checkpoint entry of the outer optimizer's state
OUTER_ENTRY = f"{REPLICA_SYNC_KEY}_outer"


def inner_entry(group: int, index: int) -> str:
    """The checkpoint entry of replica group ``group``'s ``index``-th optimizer (the groups after the first: the
    first group's are the checkpoint's own optimizer states)."""
    return f"{REPLICA_SYNC_KEY}_group{group}_{index}"


def own_inner_path(path: str | os.PathLike, group: int) -> Path:
    """Where fault-tolerant replica group ``group`` keeps its own inner optimizer state beside the checkpoint at
    ``path`` that another group wrote (a name no checkpoint callback takes for a checkpoint of its own)."""
    path = Path(path)
    return path.with_name(f"{path.name}.replica_group{group}")


class ReplicaSyncSteps:
    """Mixin of :class:`~lightning_smp.frontend.HybridShardFrontEnd`: the semi-synchronous replica groups' glue."""

    core: HybridShardCore
    #: the outer loop over the model being trained (``replica_sync``), started when it is set up, and that model
    _outer: OuterSync | None = None
    _outer_module: Module | None = None
    _replicas: ReplicaGroups | None = None
    #: the run that owns what this group keeps beside a checkpoint another group wrote (its own: the groups' main
    #: checkpoints share one run once resumed, and a run removes its own leftovers in the folder)
    _own_inner_run: CheckpointRun | None = None

    @property
    def outer_sync(self) -> OuterSync | None:
        """The outer loop of ``replica_sync`` (DiLoCo) over the model being trained, once it is set up; ``None``
        without the option."""
        return self._outer

    @property
    def replica_sync_bytes(self) -> int:
        """Bytes this rank keeps for ``replica_sync``'s outer loop (its parts of the parameters as last synced and the
        outer momentum; 0 without the option), where :attr:`replica_sync_backup` says."""
        return self._outer.state_bytes if self._outer is not None else 0

    @property
    def replica_sync_backup(self) -> str | None:
        """Where the outer loop keeps its copies: ``"device"`` or ``"cpu"`` (``replica_sync``'s ``backup``);
        ``None`` without the option."""
        settings = self.core.replica_sync
        return settings.backup if settings is not None and self._outer is not None else None

    @contextmanager
    def synced_weights(self) -> Generator[None, None, None]:
        """``replica_sync``: inside the block the model holds the weights as last synced, the same in every group
        (what the Trainer validates with); leaving it gives each group its own back. Nothing is sent and training
        continues as if the block had not been; the weights may be up to ``every`` steps old. Without the option, or
        when the groups are equal already, the model as it is."""
        if self._outer is None:
            yield
            return
        self._release_gathered()
        self._outer.show_synced()
        try:
            yield
        finally:
            self._release_gathered()  # (what the block's forwards gathered holds the synced weights)
            self._outer.hide_synced()  # (nothing if a sync inside the block, a checkpoint's, put them back already)

    @property
    def _last_sync(self) -> SyncReport | None:
        """The report of the sync that the last optimizer step made, or one made since (a checkpoint's, the end
        of fit's): ``None`` if no sync happened since that step, or without ``replica_sync``."""
        outer = self._outer
        report = outer.report if outer is not None else None
        return report if report is not None and outer is not None and report.step == outer.steps else None

    def _release_gathered(self) -> None:
        """Before the outer loop writes the shards outside a training step: nothing gathered may hide them from the
        next forward (FSDP2's root after a validation forward)."""
        if self._outer_module is not None:
            self.core.engine.release_gathered(self._outer_module)

    def sync_replicas(self) -> list[int]:
        """``replica_sync``: sync now every fragment that trained since its last sync, so that every replica group
        holds the same weights (the Trainer does it when a checkpoint is taken and at the end of ``fit``, ``fabric.save``
        too; a Fabric loop calls it before it returns the model). Collective: every rank calls it. Returns the
        fragments synced; nothing (and nothing sent) without the option or when the groups are equal already."""
        if self._outer is None or not self._outer.pending:
            return []
        self._release_gathered()
        return self._outer.sync()

    def _start_replica_sync(self, module: Module) -> None:
        """The outer loop over ``module`` (the sharded root), its synced copies taken now (every group starts from
        the same weights)."""
        settings, mesh, replicas = self.core.replica_sync, self.core.device_mesh, self._replicas
        if settings is None:
            return
        if self._outer is not None and self._outer_module is module:
            rounds = self._outer.rounds
            if replicas is not None and not (isinstance(rounds, SyncRounds) and rounds.replicas is replicas):
                self._outer.rounds = SyncRounds(replicas)  # (another fit: the replica groups were joined again)
            return
        if replicas is None and mesh is None:
            return
        buffers = list(module.buffers()) if self.core.options.broadcast_buffers else []
        # (fault_tolerance: each group is its own job, and a sync is a round of torchft's Manager across them; else
        # the groups are the rows of this job's mesh)
        group = axis_group(mesh, REPLICATE_AXIS) if replicas is None and mesh is not None else None
        # (the ranks of this rank's own replica group: a sync's report holds the whole model's norms over them)
        own = axis_group(mesh, SHARD_AXIS) if replicas is None and mesh is not None else None
        outer_lr, outer_momentum, nesterov = settings.outer_settings()
        self._outer = OuterSync(module.parameters(), group, every=settings.every, outer_lr=outer_lr,
                                outer_momentum=outer_momentum, nesterov=nesterov,
                                fragments=settings.fragments, buffers=buffers, delay=settings.delay,
                                compress=settings.compress,
                                backup_device=torch.device("cpu") if settings.backup == BACKUP_CPU else None,
                                rounds=SyncRounds(replicas) if replicas is not None else None, group_ranks=own)
        self._outer_module = module

    def _before_replica_forward(self) -> None:
        """``fault_tolerance`` with ``replica_sync``, before the first forward with gradients: the groups' start round
        (:meth:`~lightning_smp.fault_tolerance.rounds.SyncRounds.start`)."""
        outer = self._outer
        if outer is not None and outer.rounds is not None and torch.is_grad_enabled():
            outer.rounds.start(outer)

    def _outer_state(self) -> dict[str, Any]:
        """What a healing group copies of the outer loop (``fault_tolerance``): its steps, synced copies and outer
        optimizers, this rank's parts."""
        return {REPLICA_SYNC_KEY: self._outer.state_dict()} if self._outer is not None else {}

    def _load_outer_state(self, state: dict[str, Any]) -> None:
        """A live peer's outer loop (:meth:`_outer_state`), taken out of ``state``."""
        outer = state.pop(REPLICA_SYNC_KEY, None)
        if outer is not None and self._outer is not None:
            self._outer.load_state_dict(outer)

    def _group_index(self) -> int:
        """This rank's replica group (its place on the replicate axis)."""
        group = self._outer.group if self._outer is not None else None
        return dist.get_group_rank(group, dist.get_rank()) if group is not None else 0

    def _check_one_optimizer(self, optimizers: int) -> None:
        """``replica_sync`` counts the steps of one inner optimizer (a second one would make the windows ambiguous)."""
        if self.core.replica_sync is not None and optimizers > 1:
            raise UnsupportedOptionError(
                f"replica_sync with {optimizers} optimizers: the outer loop counts the steps of one inner optimizer."
                " Fix: one optimizer (parameter groups for different settings), or drop replica_sync."
            )

    def _after_inner_step(self) -> None:
        """After every optimizer step: the fragments whose turn it is sync."""
        if self._outer is not None:
            self._outer.after_step()

    def _replica_sync_checkpoint(self, checkpoint: dict[str, Any], model: ShardedModel, optimizers: list[Optimizer],
                                 kind: StateDictType, check: LocalStateCheck | None) -> dict[str, Any]:
        """``checkpoint`` (whose optimizer states, sharded or full, are this rank's group's) with the outer loop's
        record, its optimizer's state and the inner optimizers' states of the groups after the first (the groups'
        inner optimizers differ between syncs), as ``kind`` writes optimizers. Collective."""
        if self._outer is None:
            return checkpoint
        outer = self._outer
        shadow = outer_optimizer(outer)
        record: dict[str, Any] = {"steps": outer.steps}
        schedule = outer.schedule()
        if schedule is not None and outer.schedule_chosen:  # (what "auto" chose: a resume does not choose again)
            record["schedule"] = schedule
        if self.core.fault_tolerance is not None:  # (the group that wrote it: the others keep their own beside it)
            record["group"] = self.core.fault_tolerance.group
        extra: dict[str, Any] = {REPLICA_SYNC_KEY: record,
                                 OUTER_ENTRY: optimizer_state_to_save(model, shadow, len(optimizers), kind, check)}
        group = self._group_index()
        if kind == SHARDED:
            if group > 0:  # (each group writes its own; the first group's are the checkpoint's optimizer states)
                extra.update({inner_entry(group, index): state
                              for index, state in enumerate(checkpoint.get(OPTIMIZERS_KEY, []))})
        elif outer.group is not None:
            for index, optimizer in enumerate(optimizers):  # (gathered to global rank 0, which writes the file)
                states = full_optimizer_states_of_groups(model, optimizer, outer.group)
                extra.update({inner_entry(g, index): state for g, state in enumerate(states) if g > 0})
        return {**checkpoint, **extra}

    def _own_inner_checkpoint(self, states: list[Any],
                              path: str | os.PathLike) -> tuple[dict[str, Any], Path, CheckpointRun] | None:
        """``fault_tolerance``: what a group that does not write the job's checkpoint at ``path`` keeps beside it, and
        where (:func:`own_inner_path`): its own inner optimizer states (``states``, sharded or full, as the front end
        took them for the checkpoint), which differ from the writing group's between syncs, with the outer loop's
        step count they go with, and the run that owns it; ``None`` without ``replica_sync`` (nothing to keep)."""
        settings = self.core.fault_tolerance
        if self._outer is None or settings is None:
            return None
        # (the record names the entries it holds: a resume takes them only when they are its optimizers')
        own = {MODEL_KEY: {}, REPLICA_SYNC_KEY: {"steps": self._outer.steps, "group": settings.group,
                                                 "entries": sorted(inner_entry(settings.group, index)
                                                                   for index in range(len(states)))},
               **{inner_entry(settings.group, index): state for index, state in enumerate(states)}}
        if self._own_inner_run is None:
            self._own_inner_run = CheckpointRun()
        return own, own_inner_path(path, settings.group), self._own_inner_run

    def _remove_own_inner(self, path: str | os.PathLike) -> None:
        """With the checkpoint at ``path``: what this group kept beside it (:meth:`_own_inner_checkpoint`), if any.
        One rank calls it."""
        settings = self.core.fault_tolerance
        own = own_inner_path(path, settings.group) if settings is not None else None
        if own is not None and own.exists():
            remove_atomically(own)

    def _load_own_inner_state(self, path: str | os.PathLike, model: ShardedModel, optimizers: list[Optimizer],
                              record: dict[str, Any] | None) -> None:
        """``fault_tolerance``, after a checkpoint that another group wrote (``record``: its ``replica_sync``
        record) was loaded: this group's own inner optimizer states from beside it, where this group kept them at the
        same step (a group without them resumes with the writing group's, and says so)."""
        settings = self.core.fault_tolerance
        if self._outer is None or settings is None or not isinstance(record, dict) or not optimizers:
            return
        writer = record.get("group")
        if writer is None or writer == settings.group:
            return
        own = own_inner_path(path, settings.group)
        # (rank 0 reads, every rank decides alike: the load is collective)
        reads = model.collectives.rank == 0 and own.exists()
        kept = model.collectives.broadcast(read_record(own, REPLICA_SYNC_KEY) if reads else None)
        steps = kept.get("steps") if isinstance(kept, dict) else None
        entries = {inner_entry(settings.group, index): optimizer for index, optimizer in enumerate(optimizers)}
        held = isinstance(kept, dict) and kept.get("entries") == sorted(entries)
        if steps is not None and steps == record.get("steps") and held:
            rest = load_entries(model, own, entries)
            self._own_inner_run = self._own_inner_run or CheckpointRun()
            self._own_inner_run.continue_from(rest)  # (its next save there is its own again)
        elif model.collectives.rank == 0:
            why = (f"it kept none beside the checkpoint ({own})" if kept is None
                   else f"{own} was kept at step {steps}, the checkpoint at {record.get('steps')}"
                   if steps != record.get("steps") else f"{own} holds no state of its {len(entries)} optimizer(s)")
            warnings.warn(
                f"replica group {settings.group} resumes {path} with group {writer}'s inner optimizer state: {why}."
                " Its own state differs from the writer's between syncs, so the resume is not exact for this group"
                " (it is with a stateless inner optimizer). Fix: resume from a checkpoint every group saved at, on a"
                " file system every group reaches.", stacklevel=2)

    def _outer_optimizer(self) -> torch.optim.SGD | None:
        """The outer loop's state as an optimizer over the model's parameters (:func:`outer_optimizer`)."""
        return outer_optimizer(self._outer) if self._outer is not None else None

    def _replica_sync_load_entries(self, optimizers: list[Optimizer], shadow: Optimizer | None) -> dict[str, Optimizer]:
        """What a checkpoint load fills beside the model and ``optimizers``: the outer state into ``shadow``, and this
        group's own optimizer states where the checkpoint has them."""
        if self._outer is None or shadow is None:
            return {}
        # (fault_tolerance: each group its own job; a checkpoint of one job holds every group's by its place)
        settings = self.core.fault_tolerance
        group = settings.group if settings is not None else self._group_index()
        # (without outer momentum the outer state is its step count alone, in the record: a checkpoint's momentum,
        # saved with outer_momentum > 0, is not loaded)
        entries: dict[str, Optimizer] = {OUTER_ENTRY: shadow} if self._outer.momentum() else {}
        if group > 0:
            entries.update({inner_entry(group, index): optimizer for index, optimizer in enumerate(optimizers)})
        return entries

    def _resume_replica_sync(self, checkpoint: dict[str, Any], shadow: torch.optim.SGD | None) -> None:
        """After a checkpoint was loaded: the outer loop restarts from the parameters (a checkpoint is a sync point),
        its step count and momentum from the checkpoint (none: from 0, with zero momentum)."""
        record = checkpoint.pop(REPLICA_SYNC_KEY, None)
        if self._outer is not None and shadow is not None:
            restore_outer(self._outer, shadow, int(record["steps"]) if isinstance(record, dict) else 0)
            schedule = record.get("schedule") if isinstance(record, dict) else None
            if isinstance(schedule, dict) and self.core.replica_sync is not None and self.core.replica_sync.auto:
                if not self._outer.set_schedule(schedule) and (not dist.is_initialized() or dist.get_rank() == 0):
                    warnings.warn(
                        f"replica_sync: the checkpoint's schedule ({schedule}) does not fit this run's settings"
                        f" ({self.core.replica_sync.describe()}): 'auto' chooses again, from a new calibration sync.",
                        stacklevel=2)


__all__ = ["OUTER_ENTRY", "ReplicaSyncSteps", "inner_entry"]
