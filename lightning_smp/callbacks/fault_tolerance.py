"""What fault-tolerant replica groups did at each optimizer step, in the Trainer's loggers and progress bar."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

#: the metrics the progress bar shows (the others go to the loggers only)
IN_PROGRESS_BAR = ("fault_tolerance/groups", "fault_tolerance/committed")


class ReplicaGroupMetrics(Callback):
    """After every optimizer step of a fault-tolerant run (``fault_tolerance``): the groups whose gradients were
    averaged, whether the step committed, and a heal (its source group and transfer time) in every logger of the
    Trainer, at that step (not every ``log_every_n_steps``: a step that shrank the effective batch must be visible),
    and the first two in the progress bar. The Trainer strategy adds it; a Fabric loop logs
    ``fabric.strategy.replica_metrics`` itself."""

    def __init__(self) -> None:
        self._logged: Any = None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        groups = getattr(trainer.strategy, "replica_groups", None)
        if groups is None or groups.report is None or groups.report is self._logged:
            return  # (no vote since the last batch: an accumulating micro-batch)
        self._logged = groups.report
        metrics = groups.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        for key in IN_PROGRESS_BAR:
            pl_module.log(key, metrics[key], prog_bar=True, logger=False, on_step=True, on_epoch=False)


__all__ = ["IN_PROGRESS_BAR", "ReplicaGroupMetrics"]
