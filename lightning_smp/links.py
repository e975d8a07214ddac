"""The links between ranks as a user describes them: :class:`Links` (bandwidths, latencies, compute, what the backend
does), named presets of real clusters, and the JSON files :func:`save_links` writes (a calibration, or your own
figures). The planner times a step on them (:mod:`lightning_smp.planner.links`); the ``links`` option is checked
against them when the strategy is created.

The presets are vendor figures per direction and per GPU, sourced in ``docs/planner.md``; latencies are the
order of magnitude of one NCCL ring step.
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
                " byte). Fix: pass e.g. engine_costs={strategy.engine.name: (1.5e-3, 3.5e-9)}, or leave it out (calibrate()"
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


__all__ = ["ACHIEVED_FRACTION", "DEFAULT_PRESET", "LINK_PRESETS", "Links", "links_for", "load_links", "save_links"]
