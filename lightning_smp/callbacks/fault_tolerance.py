"""What the replica groups did, in the Trainer's loggers and progress bar: each optimizer step of fault-tolerant
replica groups, and each sync of semi-synchronous ones."""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

#: the metrics the progress bar shows (the others go to the loggers only): a fault-tolerant step's groups and commit,
#: and the syncs so far and the last crossing's seconds
IN_PROGRESS_BAR = ("fault_tolerance/groups", "fault_tolerance/committed", "replica_sync/syncs", "replica_sync/seconds")


class ReplicaGroupMetrics(Callback):
    """In every logger of the Trainer, at the step it happened (not every ``log_every_n_steps``: a step that shrank
    the effective batch, or a sync, must be visible): after every optimizer step of a fault-tolerant run
    (``fault_tolerance``), the groups whose gradients were averaged, whether the step committed, and a heal (its
    source group and transfer time); after every sync of ``replica_sync`` (a checkpoint's and the end of fit's
    included), its report (:meth:`~lightning_smp.replica_sync.SyncReport.metrics`: the syncs so far, the fragment,
    the bytes this rank sent, the crossing's seconds, the averaged pseudo-gradient's norm, the groups' drift). The
    progress bar shows :data:`IN_PROGRESS_BAR`. The Trainer strategy adds it; a Fabric loop logs
    ``fabric.strategy.replica_metrics`` itself. Nothing here sends anything: it reads what the step or the sync
    recorded."""

    def __init__(self) -> None:
        self._logged: Any = None
        self._synced: Any = None
        self._warned: set[str] = set()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        every = _every(trainer)
        interval = _validation_interval(trainer)
        if every is not None and interval is not None and interval < every and "validation" not in self._warned:
            self._warned.add("validation")
            warnings.warn(
                f"replica_sync every={every}: validation runs every {interval:g} optimizer step(s), on the weights"
                f" as last synced (every group's alike, nothing sent), which change only every {every} steps: most"
                " validations see the same weights as the one before, the first ones the weights training started"
                f" from. Fix: validate every {every} steps or a multiple (val_check_interval), or a smaller every.",
                stacklevel=2)

    def _new(self, trainer: pl.Trainer) -> dict[str, float]:
        """What happened since the last call: a vote's outcome, a sync's report."""
        metrics: dict[str, float] = {}
        groups = getattr(trainer.strategy, "replica_groups", None)
        # (no vote since the last batch: an accumulating micro-batch, or replica_sync's inner steps)
        if groups is not None and groups.report is not None and groups.report is not self._logged:
            self._logged = groups.report
            metrics.update(groups.metrics())
        outer = getattr(trainer.strategy, "outer_sync", None)
        report = outer.report if outer is not None else None
        if report is not None and report is not self._synced:
            self._synced = report
            metrics.update(report.metrics())
        return metrics

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if _every(trainer) is not None:
            self._warn_synced_training_metrics(trainer)
        metrics = self._new(trainer)
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        shown = {**(self._logged_values(trainer)), **metrics}
        for key in IN_PROGRESS_BAR:
            if key in shown:
                pl_module.log(key, shown[key], prog_bar=True, logger=False, on_step=True, on_epoch=False)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # (the end of fit's sync comes after every on_train_end: logged here, before the loggers close)
        metrics = self._new(trainer)
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _warn_synced_training_metrics(self, trainer: pl.Trainer) -> None:
        """``replica_sync``: a training-step metric logged with ``sync_dist=True`` averages over groups that differ
        between syncs and crosses the link at every step; said once per metric."""
        results = getattr(trainer, "_results", None)  # (Lightning's results of the hook that runs: training's here)
        names = sorted({meta.name for meta in (getattr(m, "meta", None) for m in (results or {}).values())
                        if meta is not None and meta.sync.should and meta.name not in self._warned})
        if names:
            self._warned.update(names)
            warnings.warn(
                f"replica_sync: {', '.join(repr(n) for n in names)} logged with sync_dist=True in a training step: it"
                " is averaged over replica groups that train apart between syncs (the mean of their losses, not one"
                " model's) and crosses the link between them at every step (a small all-reduce that also makes the"
                " groups wait for each other). Fix: self.log(..., sync_dist=False) in training_step (each group"
                " logs its own); keep sync_dist=True for validation metrics.", stacklevel=2)

    def _logged_values(self, trainer: pl.Trainer) -> dict[str, float]:
        """The last sync's syncs and seconds, kept in the progress bar between syncs."""
        report = self._synced
        return {} if report is None else {"replica_sync/syncs": float(report.syncs),
                                          "replica_sync/seconds": report.seconds}


def _every(trainer: pl.Trainer) -> int | None:
    """``replica_sync``'s ``every`` of the run (``None``: not on)."""
    outer = getattr(trainer.strategy, "outer_sync", None)
    return outer.every if outer is not None else None


def _validation_interval(trainer: pl.Trainer) -> float | None:
    """Optimizer steps between two validations of a fit (``None``: no validation in it)."""
    if not trainer.limit_val_batches or trainer.val_dataloaders is None:
        return None
    batches = trainer.val_check_batch  # (batches within an epoch; inf: at the end of every n-th epoch)
    if batches is None:
        return None
    if not math.isfinite(batches):
        epochs = trainer.check_val_every_n_epoch
        if epochs is None or not math.isfinite(trainer.num_training_batches):
            return None
        batches = epochs * trainer.num_training_batches
    return batches / max(trainer.accumulate_grad_batches, 1)


__all__ = ["IN_PROGRESS_BAR", "ReplicaGroupMetrics"]
