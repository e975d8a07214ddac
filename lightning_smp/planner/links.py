"""The links between ranks, and how long a step's collectives take on them (an alpha-beta model of ring collectives).

A ring all-gather or reduce-scatter over ``p`` ranks takes ``p - 1`` steps, an all-reduce ``2 (p - 1)``; each step
costs the link's latency (alpha), and every rank sends :func:`~lightning_smp.engines.textbook.ring_bytes` in all at
the link's bandwidth (beta: bytes per second, one direction, per rank). A group whose ranks all sit in one node uses
the intra-node link; a group that spans nodes is as fast as its slowest hop, the inter-node link. A ring crosses
each node boundary once, so the groups of an axis that leave a node at the same time share the node's network
(:func:`crossing_groups`, :func:`inter_node_bandwidth`): the replica groups of a degree within a node, one per rank
of the node, get a rank's share each; one shard group spanning nodes gets the whole node's network.

The presets are vendor figures per direction and per GPU, sourced in ``docs/planner.md``; latencies are the
order of magnitude of one NCCL ring step. :mod:`.timing` turns these times and the compute into a step time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from lightning_smp.errors import HybridShardConfigError

_US = 1e-6
_GB = 1e9


#: The fraction of a GPU's dense 16-bit peak that large-model training achieves (model FLOPs utilisation): 38-43% in
#: "The Llama 3 Herd of Models" (2024, table 4, 16K H100s, BF16); an assumption for the presets, which a calibration
#: on the cluster at hand replaces with a measurement.
ACHIEVED_FRACTION = 0.4


@dataclass(frozen=True)
class Links:
    """The cluster as the planner sees it: bandwidths (bytes/s, one direction, per rank) and latencies (s, per ring
    step) inside a node and across, the FLOP/s one rank achieves (``0``: unknown, compute not counted), and whether
    communication overlaps compute (CUDA streams: yes; gloo on CPU, where both share the cores: no), whether the
    backend runs a reduce-scatter as a whole all-reduce (gloo does: twice the bytes and ring steps), and what each
    FSDP engine's own work costs (``engine_costs``: by engine name, ``(seconds, seconds per byte)`` per unit and
    micro-batch, its fixed cost and the cost of its copies of the unit; measured by :func:`~.calibrate.calibrate` on
    CPU, where that work shares the cores with the compute; none elsewhere, where it runs ahead of the device)."""

    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    description: str = ""
    device_flops: float = 0.0
    overlap: bool = True
    reduce_scatter_as_all_reduce: bool = False
    engine_costs: dict[str, tuple[float, float]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        # one form whatever the source (JSON gives lists): {name: (seconds, seconds per byte)}
        try:
            costs = {str(name): (float(fixed), float(per_byte))
                     for name, (fixed, per_byte) in dict(self.engine_costs).items()}
        except (TypeError, ValueError):
            raise HybridShardConfigError(
                f"Links(engine_costs={self.engine_costs!r}) is not a map of engine name to (seconds, seconds per"
                " byte). Fix: pass e.g. engine_costs={'fsdp2': (1.5e-3, 3.5e-9)}, or leave it out (calibrate()"
                " measures it on CPU)."
            ) from None
        object.__setattr__(self, "engine_costs", costs)


#: Named presets (see ``docs/planner.md`` for the sources).
_H100, _A100, _L40S = 989e12, 312e12, 362e12  # dense BF16 peak FLOP/s (datasheets, docs/planner.md)
LINK_PRESETS: dict[str, Links] = {
    "h100-nvlink-ib400": Links(450 * _GB, 3 * _US, 50 * _GB, 10 * _US,
                               "8x H100 SXM per node, NVLink 4 (900 GB/s both directions), one 400 Gb/s NIC per GPU",
                               ACHIEVED_FRACTION * _H100),
    "a100-nvlink-ib200": Links(300 * _GB, 3 * _US, 25 * _GB, 10 * _US,
                               "8x A100 SXM per node, NVLink 3 (600 GB/s both directions), one 200 Gb/s NIC per GPU",
                               ACHIEVED_FRACTION * _A100),
    "aws-p5": Links(450 * _GB, 3 * _US, 50 * _GB, 15 * _US,
                    "p5.48xlarge: 8x H100, NVLink 4, 3200 Gb/s EFA per node", ACHIEVED_FRACTION * _H100),
    "aws-p4d": Links(300 * _GB, 3 * _US, 6.25 * _GB, 15 * _US,
                     "p4d.24xlarge: 8x A100, NVLink 3, 400 Gb/s EFA per node", ACHIEVED_FRACTION * _A100),
    "pcie-ethernet": Links(25 * _GB, 5 * _US, 12.5 * _GB / 8, 20 * _US,
                           "8 GPUs (L40S) on PCIe 4.0 x16, one 100 Gb/s Ethernet NIC per node",
                           ACHIEVED_FRACTION * _L40S),
}
DEFAULT_PRESET = "h100-nvlink-ib400"


def save_links(links: Links, path: str | Path) -> Path:
    """Write ``links`` as JSON (what :func:`load_links` and ``lightning-smp plan --preset FILE`` read)."""
    path = Path(path)
    path.write_text(json.dumps(asdict(links), indent=1) + "\n")
    return path


def load_links(path: str | Path) -> Links:
    """``Links`` from a JSON file written by :func:`save_links` (a calibration, or your own figures)."""
    try:
        values = json.loads(Path(path).read_text())
        return Links(**values)
    except (OSError, ValueError, TypeError) as err:
        raise HybridShardConfigError(
            f"links file {str(path)!r} cannot be read as Links ({err}). Fix: write it with"
            " lightning_smp.planner.save_links (or `lightning-smp plan --calibrate true --save_links FILE`), with the"
            f" keys {', '.join(f.name for f in fields(Links))}."
        ) from None


def links_for(preset: str | Path | Links | None) -> Links:
    """A preset by name (``None``: :data:`DEFAULT_PRESET`), a JSON file (:func:`save_links`), or ``Links`` as given."""
    if isinstance(preset, Links):
        return preset
    name = DEFAULT_PRESET if preset is None else str(preset)
    if name in LINK_PRESETS:
        return LINK_PRESETS[name]
    if name.endswith(".json") or Path(name).is_file():
        return load_links(name)
    raise HybridShardConfigError(
        f"links={preset!r} is not a link preset or a JSON file. Valid presets: {', '.join(LINK_PRESETS)}; or a file"
        " written by lightning_smp.planner.save_links; or pass lightning_smp.planner.Links(intra_bandwidth=...,"
        " intra_latency=..., inter_bandwidth=..., inter_latency=..., device_flops=...)."
    )


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


__all__ = ["ACHIEVED_FRACTION", "DEFAULT_PRESET", "LINK_PRESETS", "Links", "collective_seconds", "group_spans_nodes",
           "as_run", "axis_link", "crossing_groups", "inter_node_bandwidth", "links_for", "load_links", "save_links"]
