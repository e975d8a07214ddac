"""``make bench-guard``: what the step guard's reduction costs, one all-reduce per mesh axis (what it runs) against one
over the whole world (the alternative: one collective where there are two).

The step guard (``lightning_smp.engines.unused.restore_unused``) reduces one byte per parameter by MAX before every
optimizer step. It runs one all-reduce on each axis of the mesh in turn, so that each is counted on its axis; one
world-wide all-reduce would give the same bytes in one collective. This times both through the function itself, on
4 CPU ranks (gloo, the ``(2, 2)`` mesh of degree 2), each call after the same compute chunk (ranks reach a step
skewed, as they do in training), the two variants interleaved and in reversed order every other round.

Writes ``benchmarks/results/guard_sync.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORLD, DEGREE = 4, 2
VARIANTS = ("per axis", "world")


def _rank(rank: int, port: int, settings: dict[str, Any], queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_smp.engines.unused import Presence, restore_unused
    from lightning_smp.names import MESH_AXES

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD // DEGREE, DEGREE), mesh_dim_names=MESH_AXES)
    groups = {"per axis": [mesh.get_group(axis) for axis in reversed(range(mesh.ndim))],
              "world": [dist.group.WORLD]}
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(settings["params"])]
    for param in params:
        param.grad = torch.ones(1)
    presence = Presence(lambda: params)
    work = torch.randn(settings["width"], settings["width"], generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for index in range(settings["rounds"] * settings["calls"]):
        order = VARIANTS if (index // settings["calls"]) % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            dist.barrier()
            for _ in range(settings["compute"]):
                work = torch.tanh(work @ work)  # a forward's worth of work, longer on some ranks than others
            presence.note_start()
            for position in range(presence.size):
                presence.mark_used(position)
            start = time.perf_counter()
            restore_unused([presence], torch.device("cpu"), groups[variant])
            times[variant].append(time.perf_counter() - start)
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, times)
    if rank == 0:  # a call ends for the step when its slowest rank is through
        queue.put({v: [max(r[v][i] for r in everyone) for i in range(len(times[v]))] for v in VARIANTS})
    dist.destroy_process_group()


def run(settings: dict[str, Any]) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_rank, args=(rank, port, settings, queue)) for rank in range(WORLD)]
    for process in processes:
        process.start()
    times = queue.get(timeout=600)
    for process in processes:
        process.join(timeout=60)
    per_round = {v: [statistics.median(times[v][i:i + settings["calls"]])
                     for i in range(0, len(times[v]), settings["calls"])] for v in VARIANTS}
    ratios = [w / a for w, a in zip(per_round["world"], per_round["per axis"])]
    return {"settings": settings, "calls": {v: len(times[v]) for v in VARIANTS},
            "median_ms": {v: statistics.median(times[v]) * 1e3 for v in VARIANTS},
            "world_over_per_axis": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def render(result: dict[str, Any]) -> str:
    from lightning_smp.accounting.render import tables_text

    s, ms = result["settings"], result["median_ms"]
    rows = [[variant, f"{ms[variant]:.3f}"] for variant in VARIANTS]
    text = tables_text([("step guard, mesh (2, 2), gloo", ["reduced over", "ms per call"],
                         rows)], left=["reduced over"])
    return "\n".join([
        f"{s['params']} parameters (one byte each), after {s['compute']} tanh(matmul) of {s['width']} x {s['width']};"
        f" {s['calls']} calls per round, {s['rounds']} rounds; the slowest rank's time of each call.",
        f"world / per axis: {result['world_over_per_axis']:.3f} (per-round medians, min-max"
        f" {result['ratio_min']:.3f}-{result['ratio_max']:.3f})", "", text])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=54, help="the bitmap's length (make bench's model: 54)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--compute", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--output", type=Path, default=RESULTS / "guard_sync")
    args = parser.parse_args(argv)
    settings = {k: getattr(args, k) for k in ("params", "width", "compute", "calls", "rounds")}
    result = run(settings)
    from benchmarks.report import write_small_results  # matplotlib and the library: only once there is a result

    return write_small_results(args.output, result, render)


if __name__ == "__main__":
    main()
