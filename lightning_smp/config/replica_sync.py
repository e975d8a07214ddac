"""The ``replica_sync`` option: replica groups that train on their own and sync across the replicate axis every
``every`` steps (DiLoCo; :mod:`lightning_smp.replica_sync`).

Its value is a mapping, so that every configuration source can set part of it and the sources merge key by key
(:mod:`lightning_smp.config`); once merged, :meth:`ReplicaSync.from_mapping` checks that nothing is missing and
freezes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_smp.config.mapping import typed_items
from lightning_smp.degree import Layout
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.names import BACKUP_CPU, BACKUP_DEVICE, REPLICA_SYNC_BACKUPS


@dataclass(frozen=True)
class ReplicaSync:
    """Semi-synchronous replica groups (DiLoCo, arXiv 2311.08105): inside a replica group training runs as without the
    option; across groups nothing is sent for ``every`` optimizer steps, then each rank averages its part of the
    pseudo-gradient (the parameters as last synced minus as they are) over the groups and an outer SGD steps the
    synced copy with it.

    Attributes:
        every: optimizer steps between two syncs of the whole model (DiLoCo's ``H``); each fragment syncs once per
            ``every`` steps.
        outer_lr: the outer SGD's learning rate (0.7: the paper's, torchft's and torchtitan's).
        outer_momentum: the outer SGD's momentum (0.9; 0 for none).
        nesterov: Nesterov momentum for the outer SGD (needs ``outer_momentum > 0``).
        fragments: Streaming DiLoCo: the model cut into this many contiguous fragments, which sync in turn, one every
            ``every / fragments`` steps, each with its own outer optimizer (``every`` must be a multiple).
        backup: where the outer loop keeps its copies (the rank's part of the parameters as last synced, and the outer
            momentum): ``"device"``, beside the parameters, or ``"cpu"``, host memory (pinned where an accelerator
            runs), which frees two copies of the rank's parameter shard on the device (one without outer momentum)
            for a copy of each fragment to the host and back at its sync (torchft's ``backup_device``).
    """

    every: int
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1
    backup: str = BACKUP_DEVICE

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "replica_sync") -> ReplicaSync:
        """The record of a merged ``replica_sync`` mapping, every key present and every rule checked."""
        checked = check_replica_sync(values, where) or {}
        if checked.get("every") is None:
            raise HybridShardConfigError(
                f"{where} lacks every. Fix: give replica_sync={{'every': 20}} (optimizer steps between syncs)."
            )
        record = cls(**checked)
        if record.every % record.fragments:
            fixed = record.every - record.every % record.fragments or record.fragments
            raise HybridShardConfigError(
                f"{where}: every={record.every} is not a multiple of fragments={record.fragments}: the fragments sync"
                f" in turn, each every {record.every} steps. Fix: every={fixed}, or fragments=1."
            )
        if record.nesterov and record.outer_momentum == 0:
            raise HybridShardConfigError(
                f"{where}: nesterov=True with outer_momentum=0: Nesterov needs momentum. Fix: nesterov=False, or an"
                " outer_momentum above 0 (0.9)."
            )
        return record

    def describe(self) -> str:
        """One line for logs and reports: how often the groups sync, in how many fragments, with which outer
        optimizer, and where its copies live."""
        momentum = (f"momentum {self.outer_momentum:g}{' Nesterov' if self.nesterov else ''}" if self.outer_momentum
                    else "no momentum")
        return (f"replica_sync every {self.every} steps, {self.fragments} fragment(s), outer SGD lr"
                f" {self.outer_lr:g} {momentum}, copies on the {self.backup}")


_KINDS: dict[str, tuple[type, ...]] = {
    "every": (int,), "outer_lr": (int, float), "outer_momentum": (int, float), "nesterov": (bool,),
    "fragments": (int,), "backup": (str,),
}
#: where ``backup`` may keep the outer loop's copies
BACKUPS = REPLICA_SYNC_BACKUPS
if set(_KINDS) != {f.name for f in fields(ReplicaSync)}:  # one list of keys
    raise RuntimeError("lightning_smp.config.replica_sync: the keys and their kinds differ")


def check_replica_sync(value: Any, where: str = "replica_sync") -> dict[str, Any] | None:
    """``value`` (a mapping, a :class:`ReplicaSync`, or ``None``: off) as a plain mapping of checked keys; a source
    may give part of it (the sources merge key by key)."""
    items = typed_items(value, ReplicaSync, _KINDS, where, "{'every': 20} (sync every 20 steps)")
    if items is None:
        return None
    checked: dict[str, Any] = {}
    for key, number in items.items():
        if key == "backup":
            if number not in BACKUPS:
                raise HybridShardConfigError(
                    f"{where}: backup={number!r} is not a place the outer copies can live. Fix: {BACKUP_DEVICE!r}"
                    f" (beside the parameters) or {BACKUP_CPU!r} (host memory).")
            checked[key] = number
            continue
        if key in ("every", "fragments") and number < 1:
            raise HybridShardConfigError(f"{where}: {key}={number!r} is not a count >= 1. Fix: e.g. every=20, fragments=1.")
        if key == "outer_lr" and number <= 0:
            raise HybridShardConfigError(f"{where}: outer_lr={number!r} is not positive. Fix: e.g. 0.7.")
        if key == "outer_momentum" and not 0 <= number < 1:
            raise HybridShardConfigError(f"{where}: outer_momentum={number!r} is not in [0, 1). Fix: e.g. 0.9, or 0.")
        checked[key] = float(number) if key in ("outer_lr", "outer_momentum") else number
    return checked


def one_group_refusal(layout: Layout) -> str | None:
    """Why ``replica_sync`` cannot run on ``layout`` (a single replica group: nothing to sync across), or ``None``
    where it can: the strategies' refusal when they are created, and the planner's reason to leave a degree out."""
    if layout.replicate >= 2:
        return None
    leaving_two = [str(d) for d in range(1, layout.world_size // 2 + 1) if layout.world_size % d == 0]
    return (
        f"replica_sync with one replica group: {layout.given()} on {layout.world_size} rank(s) makes one group of"
        " them all, so there is nothing to sync across. Fix: "
        + (f"hybrid_shard_degree={' or '.join(leaving_two)} (two replica groups or more), or drop replica_sync."
           if leaving_two else "more ranks (two replica groups or more), or drop replica_sync.")
    )


__all__ = ["BACKUPS", "ReplicaSync", "check_replica_sync", "one_group_refusal"]
