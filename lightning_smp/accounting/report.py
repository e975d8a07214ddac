"""One memory-and-communication report, with or without a Trainer: :func:`memory_report`.

The memory callback makes its reports with it, and a hand-written loop (Fabric, plain PyTorch) calls it directly::

    counter = lightning_smp.count_communication(model)   # a CommCounter on the model's axes
    with counter:                                          # one optimizer step, all its micro-batches
        ...
    records = lightning_smp.memory_report(model, [optimizer], comm=counter.counts())

The records are the callback's (fields documented in :mod:`lightning_smp.callbacks.memory`), gathered on every
rank; rank 0 prints the same tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.accounting.counter import CommCounter
from lightning_smp.accounting.memory import comm_groups, measure_memory, peak_memory, textbook
from lightning_smp.accounting.render import comm_mismatches, print_report
from lightning_smp.collectives import Collectives
from lightning_smp.engines.textbook import ring_bytes
from lightning_smp.names import NO_SYNC, SHARD_AXIS, GradientAccumulation


def _module(model: Any) -> Any:
    # Fabric hands out wrappers (of modules and optimizers); what they wrap is inside
    from lightning.fabric.wrappers import _unwrap_objects

    return _unwrap_objects(model)


def _device(model: Module) -> torch.device:
    from torch.distributed.tensor import DTensor

    param = next(model.parameters(), None)
    if param is None:
        return torch.device("cpu")
    return param.to_local().device if isinstance(param, DTensor) else param.device


def count_communication(model: Any, mesh: Any = None) -> CommCounter:
    """A :class:`~lightning_smp.accounting.CommCounter` on ``model``'s axes (the shard group and the replicas)."""
    return CommCounter(groups=comm_groups(_module(model), mesh))


def memory_report(
    model: Any,
    optimizers: Sequence[Optimizer] = (),
    *,
    comm: dict | None = None,
    backward_passes: int = 1,
    accumulation: GradientAccumulation = NO_SYNC,
    grads_bytes: int | None = None,
    root_gathered: bool = False,
    stage: str = "manual",
    step: int = 0,
    strategy: str | None = None,
    print_table: bool = True,
    checkpoint_staging_bytes: int | None = None,
    replica_sync_bytes: int | None = None,
    replica_sync_backup: str | None = None,
    engine: str | None = None,
    replica_sync: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Measure what this rank holds, gather every rank's record (a collective: call it on every rank) and, on rank
    0, print the memory and communication tables; return the records, sorted by rank, on every rank.

    Args:
        model: the sharded model (``fabric.setup_module``'s result is unwrapped), a DDP model or a plain module.
        optimizers: whose state to count (Fabric's wrappers are unwrapped).
        comm: :meth:`CommCounter.counts` of one optimizer step (see :func:`count_communication`), or ``None``.
        backward_passes, accumulation: the micro-batches of that step and what the earlier ones communicated
            (``fabric.no_backward_sync`` runs the strategy's ``gradient_accumulation``), for the textbook figure.
        grads_bytes: the gradient memory to report (e.g. the most held during the step); measured now if ``None``.
        root_gathered: a forward without backward ran right before the counted step (see the textbook).
        stage, step, strategy: labels of the record.
        checkpoint_staging_bytes: host memory this rank's background checkpoint saves stage (the strategy's
            ``checkpoint_staging_bytes``), or ``None`` without ``async_save``.
        replica_sync_bytes: memory this rank keeps for ``replica_sync``'s outer loop (the strategy's
            ``replica_sync_bytes``), or ``None`` without it; ``replica_sync_backup``: where (``"device"`` or
            ``"cpu"``, ``replica_sync``'s ``backup``).
        engine: the engine that runs the model (``"fsdp1"``, ``"fsdp2"``, ``"ddp"``), for the title.
        replica_sync: with ``replica_sync``, the groups and a sync: ``{"describe", "groups", "every", "bytes",
            "ring_bytes"}`` (:func:`replica_sync_figures`); ``None`` without it.
    """
    module: Module = _module(model)
    plain: list[Optimizer] = [_module(o) for o in optimizers]
    collectives = Collectives.current(_device(module))
    record: dict[str, Any] = {
        "rank": collectives.rank,
        "world_size": collectives.world_size,
        "stage": stage,
        "step": step,
        "strategy": strategy or type(module).__name__,
    }
    record.update(measure_memory(module, plain, grads_bytes))
    record.update(peak_memory(collectives.device))
    record["checkpoint_staging_bytes"] = checkpoint_staging_bytes
    record["replica_sync_bytes"] = replica_sync_bytes
    record["replica_sync_backup"] = replica_sync_backup
    record["engine"] = engine
    record["replica_sync"] = replica_sync
    record["comm"] = comm
    record["comm_textbook"] = textbook(module, backward_passes, accumulation, root_gathered=root_gathered)
    if (replica_sync is not None and replica_sync.get("synced_in_step") and record["comm_textbook"]
            and (record.get("shard_degree") or 1) > 1):
        # (a sync in the counted step: its report's norms, one all-reduce of 3 float64 inside the group; the
        # sync's own all-reduce across the groups has its row, amortised)
        shard = record["comm_textbook"].setdefault(SHARD_AXIS, {}).setdefault(
            "all_reduce", {"count": 0, "bytes": 0, "ring_bytes": 0})
        shard["count"] += 1
        shard["bytes"] += 24
        shard["ring_bytes"] += ring_bytes("all_reduce", 24, record.get("shard_degree") or 1)
    record["backward_passes"] = backward_passes
    record["gradient_accumulation"] = accumulation
    record["comm_mismatch"] = [list(pair) for pair in comm_mismatches(record)]
    records = sorted(collectives.all_gather(record), key=lambda r: r["rank"])
    if print_table and collectives.rank == 0:
        print_report(records)
    return records


def replica_sync_figures(describe: str, groups: int, every: int, sync_bytes: int,
                         crossed_in_step: Mapping[str, int] | None = None, landed_in_step: bool | None = None,
                         compress: str = "none") -> dict[str, Any]:
    """What the report shows of ``replica_sync``: its line, the replica groups (the replicate axis), one sync's
    crossing of this rank's ``sync_bytes`` across them (as sent: encoded under ``compress``; it sends
    ``2 (groups - 1) / groups`` of them), which runs once every ``every`` optimizer steps, the collectives across
    the groups the counted step started, by kind (none: it did not sync; an all-reduce per bucket of the fragments
    it sent, or under ``compress`` an all-to-all, ``"other"``, and an all-gather, whose second stage may start in a
    later step), and whether a sync landed in it (its report's norms; ``None``: where it started)."""
    crossed = dict(crossed_in_step or {})
    return {"describe": describe, "groups": groups, "every": every, "bytes": sync_bytes,
            "ring_bytes": round(ring_bytes("all_reduce", sync_bytes, groups)),
            "synced_in_step": bool(crossed) if landed_in_step is None else landed_in_step,
            "crossed_in_step": crossed, "all_reduces_in_step": crossed.get("all_reduce", 0), "compress": compress}


__all__ = ["count_communication", "memory_report", "replica_sync_figures"]
