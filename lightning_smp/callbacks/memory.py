"""``MemorySavingsCallback``: what each rank holds, what it would hold unsharded, and what each step sends.

Measured from the real tensors of every rank (FSDP padding included) and gathered to rank 0, where it is shown as a
table, logged as metrics, written as JSON and kept as ``callback.report``.

Record fields (one plain ``dict`` per rank; all sizes in bytes):

=============================  =====================================================================================
``rank``, ``world_size``       global rank and number of ranks
``stage``, ``step``            ``"first_step"`` (after the first optimizer step) or ``"fit_end"``; ``global_step``
``strategy``,                  the Lightning strategy class; FSDP's sharding strategy (``NO_SHARD`` for a DDP
``sharding_strategy``          model), or ``None`` on one device without either
``shard_degree``, ``replicas``  ranks one copy of the model is split over, and copies of it
``params_bytes``               local parameters: FSDP's local flat-parameter shards (padding included) and any
                               parameter FSDP does not manage
``grads_bytes``                the most gradient memory the rank held during the last optimizer step, measured after
                               every backward and before the step: the sharded gradients (padding included) and,
                               under gradient accumulation, FSDP1 ``no_sync``'s unsharded gradients or FSDP2's
                               partial-reduce buffer (what accumulation really costs, not only what is left)
``optimizer_bytes``            every optimizer state tensor, each counted once (Adam's ``step`` included)
``total_bytes``                the sum of the three
``unsharded_*_bytes``          the same for a DDP replica of the same model and optimizer: full parameters and
                               gradients without padding; optimizer state from the full parameter sizes and the
                               per-parameter state layout the real optimizer uses on this rank (state shaped like
                               the parameter scales with it, anything else such as ``step`` is taken as is)
``saved_bytes``, ``saved_ratio``  ``unsharded_total - total`` and that as a fraction of ``unsharded_total``
``padding_bytes``              FSDP padding per rank in parameters and gradients (averaged over the shard group)
``floor_bytes``                ``unsharded_total / shard_degree + padding_bytes``: the least sharding can reach
``measured_over_floor``        ``total_bytes / floor_bytes`` (1.0 means nothing is wasted)
``peak_allocated_bytes``,      ``torch.accelerator.max_memory_allocated`` / ``max_memory_reserved`` of the root
``peak_reserved_bytes``        device (CUDA, XPU, ...), ``None`` on the CPU
``peak_rss_bytes``             peak resident memory of the process (``getrusage``), on every device type
``checkpoint_staging_bytes``   with ``async_save``: host memory the largest background checkpoint save so far staged
                               on this rank (its shards, copied off the training tensors; 0 on ranks whose shards
                               another replica writes, and before the first save); ``None`` without it
``replica_sync_bytes``         with ``replica_sync``: memory this rank keeps for the outer loop (its part of the
                               parameters as last synced and the outer momentum); ``None`` without it
``replica_sync_backup``        where that memory is: ``"device"`` (beside the parameters) or ``"cpu"`` (host memory,
                               ``replica_sync``'s ``backup``); ``None`` without it
``engine``                     the engine that runs the model (``"fsdp1"``, ``"fsdp2"``, ``"ddp"``), or ``None``
``replica_sync``               with ``replica_sync``: its line, the replica groups, one sync's bytes across them and
                               what its ring sends, whether the counted step synced (the table's ``replicate`` row,
                               amortised per step); ``None`` without it
``comm``                       collectives of optimizer step ``comm_step`` (all its micro-batches), as counted by
                               :class:`~lightning_smp.accounting.CommCounter`: ``{axis: {op: {"count", "bytes"}}}``;
                               ``None`` when counting is off
``comm_textbook``              the textbook figure for the same step: ``{axis: {op: {"count", "bytes",
                               "ring_bytes"}}}`` (:func:`~lightning_smp.accounting.fsdp_step_textbook`)
``backward_passes``            micro-batches in the counted step
``gradient_accumulation``      what its micro-batches before the last communicated (``"no_sync"``, ...)
``comm_mismatch``              ``[[axis, op], ...]`` whose measured count differs from the textbook's (marked ``≠``
                               in the table); empty when they agree
=============================  =====================================================================================

Axes are ``"shard"`` (inside a shard group), ``"replicate"`` (across replicas) and ``"other"`` (any other group,
e.g. Lightning's own world-group reductions); ops are ``all_gather``, ``reduce_scatter``, ``all_reduce``,
``broadcast`` and ``other``. Under DDP the world group is the replicate axis; under FSDP without a mesh, FSDP's
process group is the shard axis (the replicate axis for ``NO_SHARD``).

Logger metric keys (logged by rank 0 to every logger of the Trainer, at the step of the report):

- ``memory/rank{r}/{field}`` for every numeric field above from ``params_bytes`` to ``peak_rss_bytes``;
- ``comm/rank{r}/{axis}/{op}_count`` and ``comm/rank{r}/{axis}/{op}_bytes`` (measured), and
  ``comm/rank{r}/{axis}/{op}_textbook_count`` / ``_textbook_bytes`` / ``_textbook_ring_bytes``.

The JSON file ``memory_report.json`` in ``trainer.log_dir`` (``default_root_dir`` without a logger) holds
``{"version": 1, "reports": {stage: [record per rank]}}``. Everything but the ``peak_*`` fields is the same from one
run to the next.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smp.accounting.counter import CommCounter
from lightning_smp.accounting.memory import MEMORY_FIELDS, PEAK_FIELDS, comm_groups, gradient_bytes
from lightning_smp.accounting.render import print_report
from lightning_smp.accounting.report import memory_report, replica_sync_figures
from lightning_smp.errors import HybridShardConfigError, LightningSMPError
from lightning_smp.names import NO_SYNC

#: Name of the JSON file written into the run's log directory.
REPORT_FILENAME = "memory_report.json"
#: The reports a fit makes: after the first optimizer step, and at the end of fit.
STAGES = ("first_step", "fit_end")


def metrics(records: Sequence[dict]) -> dict[str, float]:
    """The logger metrics of a report (keys documented in the module docstring); ``None`` values are left out."""
    out: dict[str, float] = {}
    for r in records:
        prefix = f"rank{r['rank']}"
        for field in MEMORY_FIELDS:
            if r.get(field) is not None:
                out[f"memory/{prefix}/{field}"] = float(r[field])
        for source, suffix in (("comm", ""), ("comm_textbook", "_textbook")):
            for axis, ops in (r.get(source) or {}).items():
                for op, entry in ops.items():
                    for key, value in entry.items():
                        out[f"comm/{prefix}/{axis}/{op}{suffix}_{key}"] = float(value)
    return out


# ---------------------------------------------------------------------------------------------- the callback


class MemorySavingsCallback(Callback):
    """Reports, for every rank, the memory sharding saves and the communication it costs.

    After the first optimizer step and at the end of fit, every rank measures what it holds (see the module
    docstring for each field) and rank 0 gathers the records, prints a table, logs them to the Trainer's loggers and
    writes ``memory_report.json`` into the run's log directory. The latest report is ``callback.report`` (a list of
    plain dicts, one per rank, picklable), every report by stage is ``callback.reports``. Works with
    :class:`~lightning_smp.HybridShardFSDPStrategy`, Lightning's ``FSDPStrategy`` and ``DDPStrategy``, and one
    device.

    Args:
        count_communication: count the collectives of one optimizer step (all its micro-batches) per mesh
            axis with :class:`~lightning_smp.accounting.CommCounter`. Only that step pays for counting; the others run
            with nothing installed. Counting never changes results.
        comm_step: which optimizer step to count (1 = the first). FSDP keeps the root unit's parameters gathered
            after a forward without backward (the validation sanity check, a validation run), so the step right
            after one skips the root's all-gather; its textbook figure says so too. ``comm_step=2`` counts a steady
            step of a run with validation. A report made before the counted step shows ``comm: None``.
        print_table: print the tables on rank 0.
        print_stages: the reports whose tables are printed (of ``"first_step"`` and ``"fit_end"``); every report
            is still logged, written and kept. ``("fit_end",)`` prints one memory and one communication table
            per fit, with the counted step filled in.
        log_metrics: log the figures to the Trainer's loggers.
        filename: name of the JSON file in the log directory; ``None`` writes no file.
    """

    def __init__(self, count_communication: bool = True, comm_step: int = 1, print_table: bool = True,
                 log_metrics: bool = True, filename: str | None = REPORT_FILENAME,
                 print_stages: Sequence[str] = STAGES) -> None:
        if isinstance(comm_step, bool) or not isinstance(comm_step, int) or comm_step < 1:
            raise HybridShardConfigError(
                f"comm_step={comm_step!r} must be a positive integer: the optimizer step (1 = the first) whose"
                " collectives are counted."
            )
        unknown = [stage for stage in print_stages if stage not in STAGES]
        if isinstance(print_stages, str) or unknown:
            raise HybridShardConfigError(
                f"print_stages={print_stages!r} must be a sequence of report stages out of {STAGES}."
                " Fix: e.g. print_stages=('fit_end',)."
            )
        self.count_communication = count_communication
        self.comm_step = comm_step
        self.print_table = print_table
        self.print_stages = tuple(print_stages)
        self.log_metrics = log_metrics
        self.filename = filename
        self.report: list[dict] = []
        self.reports: dict[str, list[dict]] = {}
        self.json_path: Path | None = None
        self._counter: CommCounter | None = None
        self._comm: dict | None = None
        self._backward_passes = 0
        self._grads_bytes: int | None = None
        self._step_grads = 0
        self._last_step = 0
        self._evaluated = False
        self._root_gathered = False
        self._sync_crossed: dict[str, int] = {}
        self._sync_landed = False

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_counter"] = None  # holds process groups: not picklable, and only meaningful inside a fit
        return state

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.report, self.reports, self._comm, self._grads_bytes = [], {}, None, None
        self._backward_passes, self._last_step, self._step_grads = 0, trainer.global_step, 0
        self._evaluated = self._root_gathered = False
        self._sync_crossed = {}
        self._sync_landed = False

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a forward without backward (the sanity check too): FSDP's root keeps its parameters gathered into the step
        self._evaluated = True

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.count_communication or self._comm is not None or trainer.global_step != self.comm_step - 1:
            return
        if self._counter is None:
            model = trainer.strategy.model or pl_module
            self._counter = CommCounter(groups=comm_groups(model, strategy_mesh(trainer.strategy)))
            self._counter.__enter__()
            # (replica_sync: the strategy releases what a validation forward left gathered before it shows the
            # synced weights, and again after: the next forward gathers the root again, as any)
            self._root_gathered = self._evaluated and getattr(trainer.strategy, "outer_sync", None) is None
        self._backward_passes += 1

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # between micro-batches: what accumulation holds (no_sync's unsharded gradients, FSDP2's partial buffers)
        self._step_grads = max(self._step_grads, gradient_bytes(trainer.strategy.model or pl_module) or 0)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        # gradients are complete here and may be set to None before the next report
        held = gradient_bytes(trainer.strategy.model or pl_module) or 0  # None: an engine without accounting
        self._grads_bytes, self._step_grads = max(self._step_grads, held), 0

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:
            return  # a micro-batch of gradient accumulation: no optimizer step yet
        self._last_step = trainer.global_step
        self._evaluated = False
        if self._counter is not None:
            self._stop_counting(trainer)
        if "first_step" not in self.reports:
            self._make_report(trainer, pl_module, "first_step")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_counting(trainer)
        self._make_report(trainer, pl_module, "fit_end")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None

    def _stop_counting(self, trainer: pl.Trainer) -> None:
        if self._counter is None:
            return
        self._counter.__exit__(None, None, None)
        self._comm = self._counter.counts()
        self._counter = None
        outer = getattr(trainer.strategy, "outer_sync", None)
        # (replica_sync: the all-reduces across the groups of the counted step's sync, if it synced: one per bucket
        # of each fragment it carried; with its report's one small all-reduce inside the group)
        self._sync_crossed, self._sync_landed = {}, False
        report = outer.report if outer is not None else None
        if outer is not None and outer.group is not None:
            # (what crossed in the counted step, by kind: one or two collectives per bucket of the fragments it sent,
            # or a compressed exchange's second stage; with a delay the sync lands steps later)
            self._sync_crossed = dict(Counter(outer.crossed))
            self._sync_landed = report is not None and report.step == outer.steps

    def _replica_sync(self, strategy: Any) -> dict[str, Any] | None:
        """``replica_sync``'s figures for the report (its groups are the layout's replicas), or ``None``."""
        outer = getattr(strategy, "outer_sync", None)
        if outer is None:
            return None
        return replica_sync_figures(strategy.core.replica_sync.describe(), strategy.layout.replicate, outer.every,
                                    outer.sync_bytes, crossed_in_step=self._sync_crossed,
                                    landed_in_step=self._sync_landed, compress=outer.compress)

    def _make_report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        records = memory_report(
            strategy.model or pl_module, trainer.optimizers, comm=self._comm,
            backward_passes=self._backward_passes or trainer.accumulate_grad_batches,
            # Lightning's own strategies accumulate under no_sync
            accumulation=getattr(strategy, "gradient_accumulation", NO_SYNC), grads_bytes=self._grads_bytes,
            root_gathered=self._root_gathered, stage=stage, step=trainer.global_step,
            strategy=type(strategy).__name__, print_table=False,
            checkpoint_staging_bytes=getattr(strategy, "checkpoint_staging_bytes", None)
            if getattr(strategy, "async_save", False) else None,
            replica_sync_bytes=getattr(strategy, "replica_sync_bytes", None)
            if getattr(strategy, "outer_sync", None) is not None else None,
            replica_sync_backup=getattr(strategy, "replica_sync_backup", None),
            engine=getattr(getattr(strategy, "engine", None), "name", None),
            replica_sync=self._replica_sync(strategy),
        )
        # a collective (broadcast of the directory) on every rank
        log_dir = trainer.log_dir if trainer.loggers else trainer.default_root_dir
        self.reports[stage] = records
        self.report = records
        if not trainer.is_global_zero:
            return
        if self.print_table and stage in self.print_stages:
            print_report(records)
        if self.log_metrics:
            values = metrics(records)
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)
        if self.filename:
            path = Path(log_dir or trainer.default_root_dir) / self.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"version": 1, "reports": self.reports}, indent=1))
            self.json_path = path


def strategy_mesh(strategy: Any) -> Any:
    """The strategy's ``(replicate, shard)`` mesh, if it has one (``HybridShardFSDPStrategy`` after setup, or a
    Lightning ``FSDPStrategy`` given a ``DeviceMesh``); only read."""
    from torch.distributed.device_mesh import DeviceMesh

    try:
        mesh = getattr(strategy, "device_mesh", None)
    except LightningSMPError:  # no mesh: a process_group was given
        return None
    return mesh if isinstance(mesh, DeviceMesh) else None


__all__ = [
    "MEMORY_FIELDS",
    "PEAK_FIELDS",
    "REPORT_FILENAME",
    "STAGES",
    "MemorySavingsCallback",
    "metrics",
    "strategy_mesh",
]
