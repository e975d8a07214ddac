"""What crosses between the nodes of a cluster run: the bytes gloo's rings send across node boundaries for the
collectives a rank counted, and the kernel's counter of a node's link, read from inside a rank."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from lightning_smp.engines.textbook import ring_bytes


def link_tx_bytes(interface: str | None = None) -> int:
    """Bytes this node has sent on its link so far, read from inside the node (a rank of a cluster run): the kernel's
    counter of ``interface`` (default ``GLOO_SOCKET_IFNAME``)."""
    name = interface or os.environ["GLOO_SOCKET_IFNAME"]
    return int(Path(f"/sys/class/net/{name}/statistics/tx_bytes").read_text())


def crossing_edges(group: Sequence[int], node_of: Sequence[int]) -> int:
    """Edges of the ring ``group[0] -> group[1] -> ... -> group[0]`` whose two ranks sit on different nodes."""
    n = len(group)
    if n < 2:
        return 0
    return sum(node_of[group[i]] != node_of[group[(i + 1) % n]] for i in range(n))


#: what gloo runs for each collective: every one on a ring; its reduce-scatter is a full all-reduce
GLOO_RUNS_AS = {"all_gather": "all_gather", "reduce_scatter": "all_reduce", "all_reduce": "all_reduce",
                "broadcast": "broadcast"}


def cross_node_bytes(counts: dict[str, dict[str, dict[str, int]]], groups: dict[str, Sequence[Sequence[int]]],
                     node_of: Sequence[int]) -> float:
    """Bytes that cross between nodes (both directions) for the collectives one rank counted, as gloo runs them.

    ``counts`` is a :class:`~lightning_smp.accounting.CommCounter`'s ``{axis: {op: {"count", "bytes"}}}`` of one
    rank; ``groups[axis]`` lists every group of that axis (each runs the same collectives, as every rank of a mesh
    axis does). A collective of ``B`` logical bytes on a ring of ``n`` ranks sends ``(n-1)/n B`` (all-gather) or
    ``2(n-1)/n B`` (all-reduce; gloo's reduce-scatter too) from each rank to the next; the bytes that cross are that
    times the ring edges between nodes (:func:`crossing_edges`).
    """
    total = 0.0
    for axis, ops in counts.items():
        for op, entry in ops.items():
            if not entry["bytes"] or op not in GLOO_RUNS_AS:
                continue
            for group in groups.get(axis, ()):
                total += ring_bytes(GLOO_RUNS_AS[op], entry["bytes"], len(group)) * crossing_edges(group, node_of)
    return total


__all__ = ["GLOO_RUNS_AS", "cross_node_bytes", "crossing_edges", "link_tx_bytes"]
