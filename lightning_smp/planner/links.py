"""The links between ranks, and how long a step's collectives take on them (an alpha-beta model of ring collectives).

A ring all-gather or reduce-scatter over ``p`` ranks takes ``p - 1`` steps, an all-reduce ``2 (p - 1)``; each step
costs the link's latency (alpha), and every rank sends :func:`~lightning_smp.engines.textbook.ring_bytes` in all at
the link's bandwidth (beta: bytes per second, one direction, per rank). A group whose ranks all sit in one node uses
the intra-node link; a group that spans nodes is as fast as its slowest hop, the inter-node link. A ring crosses
each node boundary once, so the groups of an axis that leave a node at the same time share the node's network
(:func:`crossing_groups`, :func:`inter_node_bandwidth`): the replica groups of a degree within a node, one per rank
of the node, get a rank's share each; one shard group spanning nodes gets the whole node's network.

The links themselves (:class:`~lightning_smp.links.Links`, the presets, the JSON files) are
:mod:`lightning_smp.links`; :mod:`.timing` turns these times and the compute into a step time.
"""

from __future__ import annotations

from lightning_smp.links import Links

#: Ring steps of each collective over ``p`` ranks.
_STEPS = {"all_gather": lambda p: p - 1, "reduce_scatter": lambda p: p - 1, "all_reduce": lambda p: 2 * (p - 1),
          "broadcast": lambda p: p - 1}


def as_run(figure_axis: dict[str, dict[str, float]], reduce_scatter_as_all_reduce: bool) -> dict[str, dict[str, float]]:
    """One axis of a textbook figure as the backend runs it: gloo's reduce-scatter is an all-reduce
    (``Links.reduce_scatter_as_all_reduce``), twice the bytes and the ring steps."""
    if not reduce_scatter_as_all_reduce or "reduce_scatter" not in figure_axis:
        return figure_axis
    scattered = figure_axis["reduce_scatter"]
    merged = dict(figure_axis)
    merged.pop("reduce_scatter")
    reduced = dict(merged.get("all_reduce", {"count": 0, "bytes": 0, "ring_bytes": 0.0}))
    merged["all_reduce"] = {"count": reduced["count"] + scattered["count"], "bytes": reduced["bytes"] + scattered["bytes"],
                            "ring_bytes": reduced["ring_bytes"] + 2 * scattered["ring_bytes"]}
    return merged


def collective_seconds(figure_axis: dict[str, dict[str, float]], group_size: int, bandwidth: float,
                       latency: float) -> float:
    """Seconds of one axis of a textbook figure (``{op: {"count", "ring_bytes"}}``) on one link."""
    if group_size <= 1:
        return 0.0
    seconds = 0.0
    for op, entry in figure_axis.items():
        if entry["count"]:
            seconds += entry["count"] * _STEPS[op](group_size) * latency + entry["ring_bytes"] / bandwidth
    return seconds


def crossing_groups(world_size: int, shard: int, axis_is_shard: bool, devices_per_node: int) -> int:
    """How many groups of the axis leave one node at once (the most over the nodes): they share the node's network.
    One group spanning nodes (a ring's single crossing per node) has all of it; ``k`` groups, a ``k``-th each."""
    nodes_of: dict[int, set[int]] = {}  # a group (by its first rank) -> the nodes its ranks sit in
    for rank in range(world_size):
        first = rank // shard * shard if axis_is_shard else rank % shard
        nodes_of.setdefault(first, set()).add(rank // devices_per_node)
    crossing: dict[int, int] = {}
    for nodes in nodes_of.values():
        if len(nodes) > 1:
            for node in nodes:
                crossing[node] = crossing.get(node, 0) + 1
    return max(crossing.values(), default=0)


def inter_node_bandwidth(links: Links, groups_crossing: int, devices_per_node: int) -> float:
    """The bandwidth each of ``groups_crossing`` concurrent groups gets across nodes: the node's network
    (``inter_bandwidth``, a rank's share when every rank of the node sends at once, times the ranks of a node)
    shared among the groups that leave the node."""
    return links.inter_bandwidth * devices_per_node / max(groups_crossing, 1)


def group_spans_nodes(world_size: int, shard: int, axis_is_shard: bool, devices_per_node: int) -> bool:
    """Whether any group of the axis leaves the node of its first rank (ranks numbered node by node): the shard
    groups are ``shard`` consecutive ranks, the replica groups the ranks ``shard`` apart."""
    return crossing_groups(world_size, shard, axis_is_shard, devices_per_node) > 0


def axis_link(links: Links, world_size: int, shard: int, axis_is_shard: bool,
              devices_per_node: int) -> tuple[tuple[float, float], bool]:
    """``((bandwidth, latency), spans_nodes)`` of the groups of one axis: the intra-node link, or, for groups that
    leave their node, the node's network shared among the groups crossing at once."""
    crossing = crossing_groups(world_size, shard, axis_is_shard, devices_per_node)
    if not crossing:
        return (links.intra_bandwidth, links.intra_latency), False
    return (inter_node_bandwidth(links, crossing, devices_per_node), links.inter_latency), True


__all__ = ["as_run", "axis_link", "collective_seconds", "crossing_groups", "group_spans_nodes", "inter_node_bandwidth"]
