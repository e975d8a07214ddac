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

from lightning_smp.config.mapping import did_you_mean, typed_items
from lightning_smp.degree import Layout
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.names import (
    AUTO,
    BACKUP_CPU,
    BACKUP_DEVICE,
    COMPRESS_NONE,
    OUTER_AVERAGE,
    OUTER_NESTEROV,
    REPLICA_SYNC_BACKUPS,
    REPLICA_SYNC_COMPRESSIONS,
    REPLICA_SYNC_OUTERS,
)

#: the outer optimizer's keys each ``outer`` stands for (a key given alongside wins over its preset)
OUTER_PRESETS: dict[str, dict[str, Any]] = {
    OUTER_AVERAGE: {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False},
    OUTER_NESTEROV: {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True},
}


@dataclass(frozen=True)
class ReplicaSync:
    """Semi-synchronous replica groups (DiLoCo, arXiv 2311.08105): inside a replica group training runs as without the
    option; across groups nothing is sent for ``every`` optimizer steps, then each rank averages its part of the
    pseudo-gradient (the parameters as last synced minus as they are) over the groups and an outer SGD steps the
    synced copy with it.

    Attributes:
        every: optimizer steps between two syncs of the whole model (DiLoCo's ``H``); each fragment syncs once per
            ``every`` steps. ``"auto"``: the smallest that hides the crossing under the window's compute, chosen
            from the first sync's measured crossing and the measured step (:mod:`lightning_smp.replica_sync.auto`).
        outer: the outer optimizer, where ``outer_lr``, ``outer_momentum`` and ``nesterov`` are not given:
            ``"average"``, the groups' mean (outer SGD lr 1, no momentum: plain parameter averaging, within 2 % of
            synchronous training at H = 5 to 100 on the benchmark), or ``"nesterov"``, the DiLoCo paper's (lr 0.7,
            Nesterov momentum 0.9: tuned for H = 500 and many workers, it trails at short windows).
        outer_lr: the outer SGD's learning rate (``None``: ``outer``'s).
        outer_momentum: the outer SGD's momentum (``None``: ``outer``'s; 0 for none).
        nesterov: Nesterov momentum for the outer SGD (``None``: ``outer``'s; needs ``outer_momentum > 0``).
        fragments: Streaming DiLoCo: the model cut into this many contiguous fragments, which sync in turn, one every
            ``every / fragments`` steps, each with its own outer optimizer (``every`` must be a multiple).
        backup: where the outer loop keeps its copies (the rank's part of the parameters as last synced, and the outer
            momentum): ``"device"``, beside the parameters, or ``"cpu"``, host memory (pinned where an accelerator
            runs), which frees two copies of the rank's parameter shard on the device (one without outer momentum)
            for a copy of each fragment to the host and back at its sync (torchft's ``backup_device``).
        delay: overlap: the inner steps a sync's crossing runs under before its outer step lands (0: the sync
            blocks); the outer step then moves each group's parameters by what it moves the synced copy, keeping the
            group's own progress of those steps. Below ``every / fragments``. ``"auto"``: the steps the measured
            crossing takes.
        compress: how the pseudo-gradients cross: ``"none"`` (in the parameters' dtype), ``"bf16"``, or ``"int8"`` /
            ``"int4"`` (a float32 scale per block of 256 values); every group applies the same decoded average.
    """

    every: int | str
    outer: str = OUTER_AVERAGE
    outer_lr: float | None = None
    outer_momentum: float | None = None
    nesterov: bool | None = None
    fragments: int = 1
    backup: str = BACKUP_DEVICE
    delay: int | str = 0
    compress: str = COMPRESS_NONE

    def __post_init__(self) -> None:
        for key, value in OUTER_PRESETS.get(self.outer, {}).items():  # (the preset fills the keys not given)
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)

    def outer_settings(self) -> tuple[float, float, bool]:
        """The outer SGD's learning rate, momentum and Nesterov flag, as given or from ``outer``'s preset."""
        lr, momentum, nesterov = self.outer_lr, self.outer_momentum, self.nesterov
        if lr is None or momentum is None or nesterov is None:  # (no preset of that name filled them)
            raise HybridShardConfigError(
                f"replica_sync outer={self.outer!r} is not one of {', '.join(map(repr, REPLICA_SYNC_OUTERS))}."
                f"{_MEANINGS['outer']}")
        return lr, momentum, nesterov

    @property
    def auto(self) -> bool:
        """Whether the first sync's measurement chooses ``every`` or ``delay``."""
        return AUTO in (self.every, self.delay)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "replica_sync") -> ReplicaSync:
        """The record of a merged ``replica_sync`` mapping, every key present and every rule checked."""
        checked = check_replica_sync(values, where) or {}
        if checked.get("every") is None:
            raise HybridShardConfigError(
                f"{where} lacks every. Fix: give replica_sync={{'every': 20}} (optimizer steps between syncs), or"
                " every='auto'."
            )
        record = cls(**checked)
        if isinstance(record.every, int) and record.every % record.fragments:
            fixed = record.every - record.every % record.fragments or record.fragments
            raise HybridShardConfigError(
                f"{where}: every={record.every} is not a multiple of fragments={record.fragments}: the fragments sync"
                f" in turn, each every {record.every} steps. Fix: every={fixed}, or fragments=1."
            )
        if isinstance(record.every, int) and isinstance(record.delay, int) and record.delay:
            spacing = record.every // record.fragments
            if record.delay >= spacing:
                raise HybridShardConfigError(
                    f"{where}: delay={record.delay} with every={record.every} and fragments={record.fragments}: a"
                    f" crossing must land before the next fragment's sync, {spacing} steps later. Fix: delay <="
                    f" {spacing - 1}, or every >= {(record.delay + 1) * record.fragments}."
                )
        if record.nesterov and record.outer_momentum == 0:
            preset = (f" (nesterov from outer={record.outer!r})" if checked.get("nesterov") is None else
                      f" (outer_momentum from outer={record.outer!r})" if checked.get("outer_momentum") is None else "")
            raise HybridShardConfigError(
                f"{where}: nesterov=True with outer_momentum=0{preset}: Nesterov needs momentum. Fix: nesterov=False"
                f" (or outer={OUTER_AVERAGE!r}, the groups' mean), or an outer_momentum above 0 (0.9)."
            )
        return record

    def describe(self) -> str:
        """One line for logs and reports: how often the groups sync, in how many fragments, with which outer
        optimizer, overlapped and compressed how, and where its copies live."""
        momentum = (f"momentum {self.outer_momentum:g}{' Nesterov' if self.nesterov else ''}" if self.outer_momentum
                    else "no momentum")
        every = "every auto steps" if self.every == AUTO else f"every {self.every} steps"
        overlap = (f", crossing under {self.delay} step(s)" if self.delay else "")
        compress = f", sent {self.compress}" if self.compress != COMPRESS_NONE else ""
        return (f"replica_sync {every}, {self.fragments} fragment(s), outer SGD lr {self.outer_lr:g} {momentum}"
                f"{overlap}{compress}, copies on the {self.backup}")


_KINDS: dict[str, tuple[type, ...]] = {
    "every": (int, str), "outer": (str,), "outer_lr": (int, float), "outer_momentum": (int, float),
    "nesterov": (bool,), "fragments": (int,), "backup": (str,), "delay": (int, str), "compress": (str,),
}
#: the keys whose value is one of a few words, and those words
_CHOICES: dict[str, tuple[str, ...]] = {"outer": REPLICA_SYNC_OUTERS, "backup": REPLICA_SYNC_BACKUPS,
                                        "compress": REPLICA_SYNC_COMPRESSIONS}
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
        if key in _CHOICES:
            if number not in _CHOICES[key]:
                raise HybridShardConfigError(
                    f"{where}: {key}={number!r} is not one of {', '.join(map(repr, _CHOICES[key]))}.{_MEANINGS[key]}"
                    f"{did_you_mean(number, _CHOICES[key])}")
            checked[key] = number
            continue
        if isinstance(number, str):  # (every, delay: a number, or the word that leaves it to the measurement)
            if number != AUTO:
                raise HybridShardConfigError(
                    f"{where}: {key}={number!r} is neither a number of steps nor {AUTO!r}. Fix: e.g. {key}="
                    f"{20 if key == 'every' else 2}, or {key}={AUTO!r} (chosen from the measured crossing and step).")
            checked[key] = number
            continue
        if key == "delay" and number < 0:
            raise HybridShardConfigError(f"{where}: delay={number!r} is negative. Fix: 0 (no overlap) or e.g. 2.")
        if key in ("every", "fragments") and number < 1:
            raise HybridShardConfigError(f"{where}: {key}={number!r} is not a count >= 1. Fix: e.g. every=20, fragments=1.")
        if key == "outer_lr" and number <= 0:
            raise HybridShardConfigError(f"{where}: outer_lr={number!r} is not positive. Fix: e.g. 0.7.")
        if key == "outer_momentum" and not 0 <= number < 1:
            raise HybridShardConfigError(f"{where}: outer_momentum={number!r} is not in [0, 1). Fix: e.g. 0.9, or 0.")
        checked[key] = float(number) if key in ("outer_lr", "outer_momentum") else number
    return checked


#: what a wrong word of each choice key needs to be told
_MEANINGS = {"outer": f" Fix: {OUTER_AVERAGE!r} (the groups' mean) or {OUTER_NESTEROV!r} (the DiLoCo paper's).",
             "backup": f" Fix: {BACKUP_DEVICE!r} (beside the parameters) or {BACKUP_CPU!r} (host memory).",
             "compress": f" Fix: {COMPRESS_NONE!r} (the parameters' dtype), 'bf16', 'int8' or 'int4'."}


def fault_tolerant_sync_refusal(sync: ReplicaSync) -> str | None:
    """Why ``sync`` cannot run under ``fault_tolerance`` (each sync one round of torchft's Manager: a quorum, an
    all-reduce and a commit vote that a failure refuses whole), or ``None`` where it can. An overlapped crossing, a
    compressed one and a window chosen by measurement are not offered there yet."""
    offered = {"delay": 0, "compress": COMPRESS_NONE}
    given = {key: getattr(sync, key) for key in offered if getattr(sync, key) != offered[key]}
    if sync.every == AUTO:
        given["every"] = AUTO
    if not given:
        return None
    listed = ", ".join(f"{key}={value!r}" for key, value in given.items())
    return (f"replica_sync {listed} with fault_tolerance: each sync there is one blocking round of torchft's Manager"
            " (quorum, all-reduce of float32 pseudo-gradients, commit vote), which does not yet carry an overlapped,"
            " compressed or self-timed crossing. Fix: under fault_tolerance leave delay=0, compress='none' and give"
            " every a number (lightning-smp plan prints the one 'auto' would choose); or drop fault_tolerance to"
            " overlap and compress the syncs of one job's replica groups.")


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


__all__ = ["BACKUPS", "OUTER_PRESETS", "ReplicaSync", "check_replica_sync", "fault_tolerant_sync_refusal",
           "one_group_refusal"]
