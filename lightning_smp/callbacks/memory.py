"""``MemorySavingsCallback``: what each rank holds, what it would hold unsharded, and what each step sends.

Measured from the real tensors of every rank (FSDP padding included) and gathered to rank 0, where it is shown as a
table, logged as metrics, written as JSON and kept as ``callback.report``.

Record fields (one plain ``dict`` per rank; all sizes in bytes):

=============================  =====================================================================================
``rank``, ``world_size``       global rank and number of ranks
``stage``, ``step``            ``"first_step"`` (after the first optimizer step) or ``"fit_end"``; ``global_step``
``strategy``                   the Lightning strategy class; ``sharding_strategy``: FSDP's, or ``None``
``shard_degree``, ``replicas``  ranks one copy of the model is split over, and copies of it
``params_bytes``               local parameters: FSDP's local flat-parameter shards (padding included) and any
                               parameter FSDP does not manage
``grads_bytes``                local gradients at the last optimizer step (``on_before_optimizer_step``)
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
``comm``                       collectives of optimizer step ``comm_step`` (all its micro-batches), as counted by
                               :class:`~lightning_smp.comm.CommCounter`: ``{axis: {op: {"count", "bytes"}}}``;
                               ``None`` when counting is off
``comm_textbook``              the textbook figure for the same step: ``{axis: {op: {"count", "bytes",
                               "ring_bytes"}}}`` (:func:`~lightning_smp.comm.fsdp_step_textbook`)
``backward_passes``            micro-batches in the counted step
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
import resource
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smp.comm import OPS, CommCounter, ddp_bucket_count, ddp_step_textbook, fsdp_step_textbook, fsdp_units

#: Memory fields of a record, in display order (all numeric; logged as ``memory/rank{r}/{field}``).
MEMORY_FIELDS = (
    "params_bytes", "grads_bytes", "optimizer_bytes", "total_bytes",
    "unsharded_params_bytes", "unsharded_grads_bytes", "unsharded_optimizer_bytes", "unsharded_total_bytes",
    "saved_bytes", "saved_ratio", "padding_bytes", "floor_bytes", "measured_over_floor",
    "peak_allocated_bytes", "peak_reserved_bytes", "peak_rss_bytes",
)
#: Fields that depend on the machine and the allocator, not on the model: they differ between runs.
PEAK_FIELDS = ("peak_allocated_bytes", "peak_reserved_bytes", "peak_rss_bytes")
#: Name of the JSON file written into the run's log directory.
REPORT_FILENAME = "memory_report.json"

def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _fsdp_handles(model: Module) -> list[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [unit._handle for unit in FSDP.fsdp_modules(model) if unit._handle is not None]


def _storage_units(model: Module) -> tuple[list[tuple[torch.Tensor, int, int]], dict[int, int]]:
    """``[(local tensor, full numel, padded full numel)]`` and ``{id(param): full numel}`` for every parameter."""
    units: list[tuple[torch.Tensor, int, int]] = []
    full_numel: dict[int, int] = {}
    managed: set[int] = set()
    for handle in _fsdp_handles(model):
        flat = handle.flat_param
        local = getattr(flat, "_local_shard", flat)
        numel = sum(flat._numels)
        units.append((flat, numel, local.numel() * (handle.world_size if handle.uses_sharded_strategy else 1)))
        full_numel[id(flat)] = numel
        managed.add(id(flat))
        for param, n in zip(flat._params or (), flat._numels):
            full_numel[id(param)] = n
            managed.add(id(param))
    for param in model.parameters():
        if id(param) not in managed:
            units.append((param, param.numel(), param.numel()))
            full_numel[id(param)] = param.numel()
    return units, full_numel


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_shard", tensor)


def shard_layout(model: Module) -> tuple[str | None, int, int]:
    """``(FSDP sharding strategy name or None, shard degree, replicas)`` read from the model's FSDP units."""
    handles = _fsdp_handles(model)
    if not handles:
        return None, 1, 1
    handle = handles[0]
    name = handle._sharding_strategy.name
    if not handle.uses_sharded_strategy:
        return name, 1, handle.world_size
    inter = getattr(_owner_state(model, handle), "_inter_node_pg", None)
    return name, handle.world_size, inter.size() if inter is not None and "HYBRID" in name else 1


def _owner_state(model: Module, handle: Any) -> Any:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return next((u for u in FSDP.fsdp_modules(model) if u._handle is handle), None)


def gradient_bytes(model: Module) -> int:
    """Bytes of the gradients this rank holds now (FSDP's sharded flat gradients, padding included)."""
    units, _ = _storage_units(model)
    return sum(_nbytes(tensor.grad) for tensor, _, _ in units)


def optimizer_state_bytes(optimizers: Iterable[Optimizer], full_numel: dict[int, int] | None = None) -> tuple[int, int]:
    """``(bytes held, bytes a DDP replica would hold)`` of the optimizers' state tensors, each tensor counted once.

    The unsharded figure uses the full parameter sizes (``full_numel``, by ``id`` of the parameter; default: the
    local size) and, per parameter group, the state layout of the first parameter that has state on this rank:
    state shaped like its parameter is scaled to the full size, other state (``step``) is taken as is, and every
    parameter of the group is assumed to carry that layout, as it would under DDP.
    """
    seen: set[int] = set()
    held = unsharded = 0
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    held += _nbytes(value)
        for group in optimizer.param_groups:
            params = group["params"]
            sample = next((p for p in params if optimizer.state.get(p)), None)
            if sample is None:
                continue
            per_element = fixed = 0
            for value in optimizer.state[sample].values():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.dim() > 0 and value.shape == sample.shape:
                    per_element += value.element_size()
                else:
                    fixed += _nbytes(value)
            for param in params:
                numel = (full_numel or {}).get(id(param), param.numel())
                unsharded += numel * per_element + fixed
    return held, unsharded


def measure_memory(model: Module, optimizers: Sequence[Optimizer], grads_bytes: int | None = None) -> dict[str, Any]:
    """Memory fields of one rank, from the real tensors: works on FSDP1, DDP and plain modules, without Lightning.

    ``grads_bytes`` overrides the gradients measured now (they may be gone after ``zero_grad``); the unsharded
    gradient figure is the unsharded parameter figure when gradients exist, else 0.
    """
    units, full_numel = _storage_units(model)
    name, shard, replicas = shard_layout(model)
    params = sum(_nbytes(_local(t)) for t, _, _ in units)
    grads = gradient_bytes(model) if grads_bytes is None else grads_bytes
    unsharded_params = sum(n * t.element_size() for t, n, _ in units)
    unsharded_grads = unsharded_params if grads else 0
    # average padding per rank of one tensor kind (parameters, and gradients when held)
    padding = sum((padded - n) * t.element_size() for t, n, padded in units) / shard
    padding *= 2 if grads else 1
    optimizer, unsharded_optimizer = optimizer_state_bytes(optimizers, full_numel)
    total = params + grads + optimizer
    unsharded_total = unsharded_params + unsharded_grads + unsharded_optimizer
    floor = unsharded_total / shard + padding
    return {
        "sharding_strategy": name,
        "shard_degree": shard,
        "replicas": replicas,
        "params_bytes": params,
        "grads_bytes": grads,
        "optimizer_bytes": optimizer,
        "total_bytes": total,
        "unsharded_params_bytes": unsharded_params,
        "unsharded_grads_bytes": unsharded_grads,
        "unsharded_optimizer_bytes": unsharded_optimizer,
        "unsharded_total_bytes": unsharded_total,
        "saved_bytes": unsharded_total - total,
        "saved_ratio": (unsharded_total - total) / unsharded_total if unsharded_total else 0.0,
        "padding_bytes": padding,
        "floor_bytes": floor,
        "measured_over_floor": total / floor if floor else 1.0,
    }


def peak_memory(device: torch.device) -> dict[str, int | None]:
    """Peak allocated/reserved bytes of ``device`` when it is the accelerator's (CUDA, XPU, ...; ``None`` on the CPU)
    and the process's peak RSS."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024  # kilobytes on Linux, bytes on macOS
    allocated = reserved = None
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is not None and device.type == accelerator.type:
        allocated = torch.accelerator.max_memory_allocated(device)
        reserved = torch.accelerator.max_memory_reserved(device)
    return {"peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved, "peak_rss_bytes": rss}


def comm_groups(strategy: Any, model: Module) -> dict[str, Any]:
    """``{axis: ProcessGroup}`` to attribute collectives by: the strategy's mesh, else FSDP's or DDP's groups."""
    from torch.nn.parallel import DistributedDataParallel

    mesh = getattr(strategy, "_device_mesh", None)
    if mesh is not None and mesh.mesh_dim_names:
        return {name: mesh.get_group(name) for name in mesh.mesh_dim_names}
    handles = _fsdp_handles(model)
    if handles:
        state = _owner_state(model, handles[0])
        if not handles[0].uses_sharded_strategy:
            return {"replicate": state.process_group}
        groups = {"shard": state.process_group}
        if getattr(state, "_inter_node_pg", None) is not None:
            groups["replicate"] = state._inter_node_pg
        return groups
    if isinstance(model, DistributedDataParallel):
        return {"replicate": model.process_group}
    return {}


def textbook(model: Module, backward_passes: int) -> dict | None:
    """The textbook communication of one optimizer step of ``model`` (FSDP1 or DDP) under Lightning's loop, with
    ``backward_passes`` micro-batches; ``None`` on one device."""
    from torch.nn.parallel import DistributedDataParallel

    name, shard, replicas = shard_layout(model)
    if name is not None:
        if name == "NO_SHARD":
            replicas = _fsdp_handles(model)[0].world_size
        # Lightning runs all micro-batches but the last under ``no_sync`` (FSDP too: it has ``no_sync``)
        return fsdp_step_textbook(fsdp_units(model), name, shard, replicas, backward_passes, synced_passes=1)
    if isinstance(model, DistributedDataParallel):
        grad_bytes = sum(_nbytes(p) for p in model.parameters() if p.requires_grad)
        return ddp_step_textbook(grad_bytes, model.process_group.size(), ddp_bucket_count(model) or 1)
    return None


# ---------------------------------------------------------------------------------------------- presentation


def _fmt_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    return str(value)


def _memory_rows(records: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["rank", "params", "grads", "optimizer", "total", "unsharded", "saved", "floor", "measured/floor", "peak"]
    rows = []
    for r in records:
        peak = r["peak_allocated_bytes"] if r["peak_allocated_bytes"] is not None else r["peak_rss_bytes"]
        rows.append([
            str(r["rank"]), _fmt_bytes(r["params_bytes"]), _fmt_bytes(r["grads_bytes"]), _fmt_bytes(r["optimizer_bytes"]),
            _fmt_bytes(r["total_bytes"]), _fmt_bytes(r["unsharded_total_bytes"]),
            f"{_fmt_bytes(r['saved_bytes'])} ({r['saved_ratio']:.1%})", _fmt_bytes(r["floor_bytes"]),
            f"{r['measured_over_floor']:.3f}", _fmt_bytes(peak),
        ])
    return header, rows


def _comm_rows(records: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["rank", "axis", "op", "count", "bytes", "textbook count", "textbook bytes", "ring bytes/rank"]
    rows = []
    for r in records:
        measured, book = r.get("comm") or {}, r.get("comm_textbook") or {}
        for axis in dict.fromkeys([*measured, *book]):
            for op in OPS:
                m = measured.get(axis, {}).get(op, {"count": 0, "bytes": 0})
                t = book.get(axis, {}).get(op)
                if not m["count"] and not (t and t["count"]):
                    continue
                rows.append([
                    str(r["rank"]), axis, op, str(m["count"]) if measured else "-",
                    _fmt_bytes(m["bytes"]) if measured else "-", str(t["count"]) if t else "-",
                    _fmt_bytes(t["bytes"]) if t else "-", _fmt_bytes(t["ring_bytes"]) if t else "-",
                ])
    return header, rows


def _plain_table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _titles(records: Sequence[dict]) -> tuple[str, str]:
    r0 = records[0]
    where = f"{r0['strategy']}, {r0['sharding_strategy'] or 'no sharding'}, {r0['replicas']} replica(s) x {r0['shard_degree']} shard(s)"
    return (f"Memory per rank at {r0['stage']} (step {r0['step']}): {where}",
            f"Collectives per rank in one optimizer step ({r0.get('backward_passes', 1)} micro-batch(es))")


def format_report(records: Sequence[dict]) -> str:
    """The report as plain text: a memory table and a communication table."""
    mem_title, comm_title = _titles(records)
    text = _plain_table(mem_title, *_memory_rows(records))
    header, rows = _comm_rows(records)
    if rows:
        text += "\n\n" + _plain_table(comm_title, header, rows)
    return text


def print_report(records: Sequence[dict]) -> None:
    """Print the report with ``rich`` tables, or as plain text when ``rich`` is not installed."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional for this function
        print(format_report(records))
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 140))  # logs and notebooks: do not wrap every cell
    mem_title, comm_title = _titles(records)
    for title, (header, rows) in ((mem_title, _memory_rows(records)), (comm_title, _comm_rows(records))):
        if not rows:
            continue
        table = Table(title=title)
        for column in header:
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(*row)
        console.print(table)


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
            axis with :class:`~lightning_smp.comm.CommCounter`. Only that step pays for counting; the others run
            with nothing installed. Counting never changes results.
        comm_step: which optimizer step to count (1 = the first). FSDP1 keeps the root unit's parameters gathered
            after a forward without backward (the validation sanity check, a validation run), so the step right
            after one skips the root's all-gather; ``comm_step=2`` counts a steady step of a run with validation.
            A report made before the counted step shows ``comm: None``.
        print_table: print the tables on rank 0.
        log_metrics: log the figures to the Trainer's loggers.
        filename: name of the JSON file in the log directory; ``None`` writes no file.
    """

    def __init__(self, count_communication: bool = True, comm_step: int = 1, print_table: bool = True,
                 log_metrics: bool = True, filename: str | None = REPORT_FILENAME) -> None:
        if isinstance(comm_step, bool) or not isinstance(comm_step, int) or comm_step < 1:
            from lightning_smp.errors import HybridShardConfigError

            raise HybridShardConfigError(
                f"comm_step={comm_step!r} must be a positive integer: the optimizer step (1 = the first) whose"
                " collectives are counted."
            )
        self.count_communication = count_communication
        self.comm_step = comm_step
        self.print_table = print_table
        self.log_metrics = log_metrics
        self.filename = filename
        self.report: list[dict] = []
        self.reports: dict[str, list[dict]] = {}
        self.json_path: Path | None = None
        self._counter: CommCounter | None = None
        self._comm: dict | None = None
        self._backward_passes = 0
        self._grads_bytes: int | None = None
        self._last_step = 0

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_counter"] = None  # holds process groups: not picklable, and only meaningful inside a fit
        return state

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.report, self.reports, self._comm, self._grads_bytes = [], {}, None, None
        self._backward_passes, self._last_step = 0, trainer.global_step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.count_communication or self._comm is not None or trainer.global_step != self.comm_step - 1:
            return
        if self._counter is None:
            model = trainer.strategy.model or pl_module
            self._counter = CommCounter(groups=comm_groups(trainer.strategy, model))
            self._counter.__enter__()
        self._backward_passes += 1

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        # gradients are complete here and may be set to None before the next report
        self._grads_bytes = gradient_bytes(trainer.strategy.model or pl_module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:
            return  # a micro-batch of gradient accumulation: no optimizer step yet
        self._last_step = trainer.global_step
        if self._counter is not None:
            self._stop_counting()
        if "first_step" not in self.reports:
            self._make_report(trainer, pl_module, "first_step")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_counting()
        self._make_report(trainer, pl_module, "fit_end")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None

    def _stop_counting(self) -> None:
        if self._counter is None:
            return
        self._counter.__exit__(None, None, None)
        self._comm = self._counter.counts()
        self._counter = None

    def _make_report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        model = strategy.model or pl_module
        record: dict[str, Any] = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "stage": stage,
            "step": trainer.global_step,
            "strategy": type(strategy).__name__,
        }
        record.update(measure_memory(model, trainer.optimizers, self._grads_bytes))
        record.update(peak_memory(strategy.root_device))
        record["comm"] = self._comm
        passes = self._backward_passes or trainer.accumulate_grad_batches
        record["comm_textbook"] = textbook(model, passes)
        record["backward_passes"] = passes
        records = [record]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, record)
            records = sorted(gathered, key=lambda r: r["rank"])
        # a collective (broadcast of the directory) on every rank
        log_dir = trainer.log_dir if trainer.loggers else trainer.default_root_dir
        self.reports[stage] = records
        self.report = records
        if not trainer.is_global_zero:
            return
        if self.print_table:
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


__all__ = [
    "MEMORY_FIELDS",
    "PEAK_FIELDS",
    "REPORT_FILENAME",
    "MemorySavingsCallback",
    "comm_groups",
    "format_report",
    "gradient_bytes",
    "measure_memory",
    "metrics",
    "optimizer_state_bytes",
    "peak_memory",
    "print_report",
    "shard_layout",
    "textbook",
]
