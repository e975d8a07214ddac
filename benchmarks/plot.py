"""The memory plot of a run: model state per rank by degree (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.settings import Settings
from benchmarks.tables import MIB


def plot_memory(summary: dict[str, Any], settings: Settings, path: Path) -> Path:
    """Draw per-rank model-state memory by degree (``smp_hybrid``, ZeRO-2, plain-torch HSDP, FSDP2, the floor, DDP and
    Lightning FULL_SHARD for reference) into ``path`` (PNG, matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in summary["configs"] if not c["memory_callback"]]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    styles = {"smp_hybrid": ("o", -0.18), "smp_hybrid_zero2": ("s", -0.06), "torch_hsdp": ("^", 0.06),
              "smp_hybrid_fsdp2": ("D", 0.18)}
    degrees = sorted({c["degree"] for c in configs if c["degree"] is not None})
    positions = {d: i for i, d in enumerate(degrees)}
    for kind, (marker, offset) in styles.items():
        xs, ys = [], []
        for c in configs:
            if c["kind"] != kind:
                continue
            for f in c["ranks"]:
                xs.append(positions[c["degree"]] + offset + 0.02 * (f["rank"] - (settings.world_size - 1) / 2))
                ys.append(f["model_state_bytes"] / MIB)
        if xs:
            ax.scatter(xs, ys, marker=marker, s=22, label=f"{kind} (each rank)", zorder=3)
    floors = {}
    for c in configs:
        if c["kind"] == "smp_hybrid":
            floors[c["degree"]] = max(f["floor_bytes"] for f in c["ranks"]) / MIB
    if floors:
        xs = [positions[d] for d in sorted(floors)]
        ax.plot(xs, [floors[d] for d in sorted(floors)], "k--", lw=1, label="floor: unsharded / degree + padding")
    for kind, style, label in (("ddp", ":", "DDP (each rank)"), ("lightning_fsdp", "-.", "Lightning FULL_SHARD")):
        ref = next((c for c in configs if c["kind"] == kind), None)
        if ref:
            ax.axhline(max(f["model_state_bytes"] for f in ref["ranks"]) / MIB, ls=style, lw=1, color="grey", label=label)
    ax.set_xticks(range(len(degrees)), [str(d) for d in degrees])
    ax.set_xlabel("hybrid_shard_degree")
    ax.set_ylabel("model state per rank (MiB)\nparameters + gradients + AdamW state")
    ax.set_title(f"Model state per rank by degree ({settings.world_size} ranks, {settings.model.parameter_count() / 1e6:.2f} M parameters)",
                 fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
