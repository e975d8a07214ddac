"""``make bench-buffers``: what ``broadcast_buffers=True`` (DDP's rule for BatchNorm's running statistics) costs a step.

A Fabric loop on 4 CPU ranks (gloo, degree 2, both FSDP engines) trains an MLP with a BatchNorm after every layer,
with ``broadcast_buffers`` on and off; the runs of one round are neighbours, in reversed order every other round, so
that the machine's drift over minutes falls on both alike. Per engine: the median step time of each setting (the
slowest rank, warm-up steps left out), their ratio with its spread over rounds, and the bytes the rule broadcasts per
step (every buffer, once per forward that follows a synced training forward: here every step).

Writes ``benchmarks/results/buffer_sync.{md,json}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORLD, DEGREE, WARM = 4, 2, 2


def _model(width: int, layers: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width),
                                                     torch.nn.ReLU()) for _ in range(layers)])


def _loop(fabric: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """Runs in every rank: the step times and the buffers' bytes."""
    import torch
    import torch.distributed as dist

    model = fabric.setup_module(_model(settings["width"], settings["layers"]))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(settings["batch"], settings["width"])
    times = []
    for _ in range(settings["steps"]):
        start = time.perf_counter()
        fabric.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    everyone: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(everyone, times)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return {"step_s": [max(rank[i] for rank in everyone) for i in range(len(times))], "buffer_bytes": buffer_bytes}


def measure(version: int, broadcast: bool, settings: dict[str, Any]) -> dict[str, Any]:
    """One 4-rank Fabric run: the slowest rank's median step after the warm-up."""
    import lightning as L
    import torch

    from lightning_smp.fabric import HybridShardFSDPStrategy

    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=DEGREE, fsdp_version=version, broadcast_buffers=broadcast,
                                       start_method="fork", auto_wrap_policy={torch.nn.Linear})
    result = L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD).launch(_loop, settings)
    return {"step_s": statistics.median(result["step_s"][WARM:]), "buffer_bytes": result["buffer_bytes"]}


def run(settings: dict[str, Any], rounds: int) -> dict[str, Any]:
    rows: dict[tuple[int, bool], list[float]] = {}
    buffer_bytes = 0
    for index in range(rounds):
        for version in (1, 2):
            order = (True, False) if index % 2 == 0 else (False, True)
            for broadcast in order:
                measured = measure(version, broadcast, settings)
                rows.setdefault((version, broadcast), []).append(measured["step_s"])
                buffer_bytes = measured["buffer_bytes"]
    engines = []
    for version in (1, 2):
        on, off = rows[(version, True)], rows[(version, False)]
        ratios = [a / b for a, b in zip(on, off)]
        engines.append({"fsdp_version": version, "on_s": statistics.median(on), "off_s": statistics.median(off),
                        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                        "rounds": len(ratios)})
    return {"settings": settings, "rounds": rounds, "buffer_bytes_per_step": buffer_bytes, "engines": engines,
            "params": settings["layers"] * (settings["width"] ** 2 + 3 * settings["width"])}


def render(result: dict[str, Any]) -> str:
    from lightning_smp.accounting.render import fmt_bytes, tables_text

    rows = [[f"FSDP{e['fsdp_version']}", f"{e['on_s']:.4f}", f"{e['off_s']:.4f}",
             f"{e['ratio']:.3f} ({e['ratio_min']:.3f}-{e['ratio_max']:.3f})"] for e in result["engines"]]
    header = ["engine", "step, on (s)", "step, off (s)", "on / off (min-max over rounds)"]
    text = tables_text([("broadcast_buffers on 4 CPU ranks, degree 2 (gloo)", header, rows)], left=["engine"])
    s = result["settings"]
    return "\n".join([
        f"Model: {s['layers']} x (Linear({s['width']}, {s['width']}), BatchNorm1d, ReLU) ({result['params']:,}"
        f" parameters), AdamW, batch {s['batch']} per rank; {s['steps']} steps per run, {result['rounds']} rounds.",
        f"Broadcast per step: {fmt_bytes(result['buffer_bytes_per_step'])} (every buffer, from global rank 0).",
        "", text])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--output", type=Path, default=RESULTS / "buffer_sync")
    args = parser.parse_args(argv)
    settings = {k: getattr(args, k) for k in ("width", "layers", "batch", "steps")}
    result = run(settings, args.rounds)
    from benchmarks.report import write_small_results  # matplotlib and the library: only once there is a result

    return write_small_results(args.output, result, render)


if __name__ == "__main__":
    main()
