"""The ``fault_tolerance`` option: replica groups that keep training when one of them dies, and heal from a live peer
(:mod:`lightning_smp.fault_tolerance`, on torchft).

Its value is a mapping, so that every configuration source can set part of it and the sources merge key by key
(:mod:`lightning_smp.config`); torchft's own environment variables are a source too (:func:`torchft_environment`). Once
merged, :meth:`FaultTolerance.from_mapping` checks that nothing is missing and freezes it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_smp.config.mapping import typed_items
from lightning_smp.degree import Layout
from lightning_smp.errors import HybridShardConfigError

#: torchft's own variables (its Manager reads ``TORCHFT_LIGHTHOUSE``; its examples and torchtitan's launchers set the
#: other two per replica group)
ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
ENV_GROUP = "REPLICA_GROUP_ID"
ENV_GROUPS = "NUM_REPLICA_GROUPS"
#: the torchft release fault tolerance runs on (the ``ft`` extra pins it): the library reaches into its ``Manager``
#: (the commit vote's client, the quorum's id), whose API changes between releases
TORCHFT_VERSION = "0.2.0"


@dataclass(frozen=True)
class FaultTolerance:
    """Fault-tolerant replica groups: each group of ``hybrid_shard_degree`` ranks is its own job (one ``torchrun`` per
    node, typically), the groups meet through a torchft lighthouse, and the gradient reduction across groups runs on a
    process group that is rebuilt whenever a group leaves or joins.

    Attributes:
        lighthouse: the lighthouse's address, ``host:port`` or ``http://host:port`` (``lightning-smp lighthouse``
            runs one; torchft's ``TORCHFT_LIGHTHOUSE``).
        group: this replica group's id, ``0 .. groups - 1`` (``REPLICA_GROUP_ID``); it also picks the group's part
            of the data.
        groups: the replica groups the job is sized for (``NUM_REPLICA_GROUPS``): the data is split into ``groups x
            hybrid_shard_degree`` parts.
        min_groups: the fewest groups that may commit a step (torchft's ``min_replica_size``); fewer wait.
        timeout: seconds a collective across groups, a commit vote or a healing transfer may take before the step
            is dropped (not committed).
        quorum_timeout: seconds a group waits for a quorum of groups at the start of a step.
        host: the address this group's ranks are reached at by the other groups (its store, the process group
            across groups, healing transfers); ``None``: the address of the interface that reaches the lighthouse.
    """

    lighthouse: str
    group: int
    groups: int
    min_groups: int = 1
    timeout: float = 60.0
    quorum_timeout: float = 60.0
    host: str | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "fault_tolerance") -> FaultTolerance:
        """The record of a merged ``fault_tolerance`` mapping, every key present and every rule checked."""
        checked = check_fault_tolerance(values, where) or {}
        missing = [name for name in ("lighthouse", "group", "groups") if checked.get(name) is None]
        if missing:
            raise HybridShardConfigError(
                f"{where} lacks {', '.join(missing)}. Fix: give fault_tolerance={{'lighthouse': 'host:port',"
                f" 'group': <this group's id>, 'groups': <number of groups>}} (or set {ENV_LIGHTHOUSE},"
                f" {ENV_GROUP} and {ENV_GROUPS})."
            )
        record = cls(**checked)
        if record.group >= record.groups:
            raise HybridShardConfigError(
                f"{where}: group={record.group} is not one of the {record.groups} groups (0 .. {record.groups - 1})."
                " Fix: number the groups from 0."
            )
        if record.min_groups > record.groups:
            raise HybridShardConfigError(
                f"{where}: min_groups={record.min_groups} is more than groups={record.groups}: no step could commit."
                f" Fix: min_groups <= {record.groups}."
            )
        return record

    @property
    def lighthouse_url(self) -> str:
        """The lighthouse as torchft's clients take it."""
        return self.lighthouse if "://" in self.lighthouse else f"http://{self.lighthouse}"


_KINDS: dict[str, tuple[type, ...]] = {
    "lighthouse": (str,), "group": (int,), "groups": (int,), "min_groups": (int,), "timeout": (int, float),
    "quorum_timeout": (int, float), "host": (str,),
}
if set(_KINDS) != {f.name for f in fields(FaultTolerance)}:  # one list of keys
    raise RuntimeError("lightning_smp.config.fault_tolerance: the keys and their kinds differ")


def check_fault_tolerance(value: Any, where: str = "fault_tolerance") -> dict[str, Any] | None:
    """``value`` (a mapping, a :class:`FaultTolerance`, or ``None``: off) as a plain mapping of checked keys; a
    source may give part of it (the sources merge key by key)."""
    items = typed_items(value, FaultTolerance, _KINDS, where, "{'lighthouse': 'host:29510', 'group': 0, 'groups': 2}")
    if items is None:
        return None
    checked: dict[str, Any] = {}
    for key, item in items.items():
        if (key == "group" and item < 0) or (key in ("groups", "min_groups") and item < 1):
            raise HybridShardConfigError(f"{where}: {key}={item!r} is out of range. Fix: a group id >= 0, counts >= 1.")
        if key in ("timeout", "quorum_timeout") and item <= 0:
            raise HybridShardConfigError(f"{where}: {key}={item!r} is not a positive number of seconds.")
        if key == "lighthouse" and not item.strip():
            raise HybridShardConfigError(f"{where}: lighthouse is empty. Fix: 'host:port' of the lighthouse.")
        checked[key] = float(item) if key in ("timeout", "quorum_timeout") else item
    return checked


def check_torchft(installed: str | None) -> None:
    """``installed``: torchft's version here (``None``: not installed); anything but :data:`TORCHFT_VERSION` is
    refused, before any process starts."""
    if installed != TORCHFT_VERSION:
        have = "torchft is not installed" if installed is None else f"torchft {installed} is installed"
        raise HybridShardConfigError(
            f"fault_tolerance runs on torchft {TORCHFT_VERSION} (its Manager's API changes between releases), and"
            f" {have}. Fix: pip install 'lightning-smp[ft]' (torchft=={TORCHFT_VERSION})."
        )


def check_fault_tolerant_layout(settings: FaultTolerance, layout: Layout | None, *, fixed_by: str | None,
                                auto: bool) -> None:
    """What fault-tolerant replica groups need of this job's layout, checked before any process starts (the same
    answer on every rank): the job is one replica group of ``hybrid_shard_degree`` ranks; ``fixed_by`` names a
    ``device_mesh``/``process_group`` argument. (Its engine's part: ``Capabilities.fault_tolerance``, checked by the
    core.)"""
    if auto:
        raise HybridShardConfigError(
            "hybrid_shard_degree='auto' with fault_tolerance: each replica group is its own job, whose size is the"
            " degree. Fix: pass the number of ranks each group runs as hybrid_shard_degree (plan it with"
            " `lightning-smp plan`)."
        )
    if fixed_by is not None:
        raise HybridShardConfigError(
            f"{fixed_by} with fault_tolerance: the replica groups are separate jobs, joined through the lighthouse,"
            f" so the mesh is each group's own shard group. Fix: drop {fixed_by}."
        )
    if layout is not None and layout.replicate != 1:
        raise HybridShardConfigError(
            f"fault_tolerance: each replica group runs as its own job of hybrid_shard_degree ranks, but this job has"
            f" {layout.world_size} ranks and {layout.given()}: {layout.replicate} replicas of its own. Fix: launch"
            f" each group with {layout.shard} ranks (one torchrun per group), or pass"
            f" hybrid_shard_degree={layout.world_size}."
        )


def torchft_environment() -> dict[str, Any] | None:
    """The ``fault_tolerance`` that torchft's own variables give (``TORCHFT_LIGHTHOUSE`` with ``REPLICA_GROUP_ID``;
    ``NUM_REPLICA_GROUPS`` if set), or ``None`` when they do not name a group."""
    lighthouse, group = os.environ.get(ENV_LIGHTHOUSE, "").strip(), os.environ.get(ENV_GROUP, "").strip()
    if not lighthouse or not group:
        return None
    values: dict[str, Any] = {"lighthouse": lighthouse}
    for key, name in (("group", ENV_GROUP), ("groups", ENV_GROUPS)):
        raw = os.environ.get(name, "").strip()
        if raw:
            try:
                values[key] = int(raw)
            except ValueError:
                raise HybridShardConfigError(f"environment variable {name}={raw!r} is not a whole number.") from None
    return values


__all__ = ["ENV_GROUP", "ENV_GROUPS", "ENV_LIGHTHOUSE", "TORCHFT_VERSION", "FaultTolerance", "check_fault_tolerance",
           "check_torchft",
           "check_fault_tolerant_layout", "torchft_environment"]
