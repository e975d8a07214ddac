"""Measure the cluster at hand: the links inside a node and across nodes, and what one rank computes per second.

:func:`calibrate` runs on every rank of a running job (a collective): it times all-reduces of a few sizes inside each
node and across nodes, all groups of a kind at once (as a training step's collectives run: every rank of a node sends
through the node's network together, so the figure is each rank's share), and fits the alpha-beta model of
:mod:`.links` to them; and it times a matrix multiplication on every rank at once. The result is a
:class:`~.links.Links` the planner takes as it takes a preset, and which :func:`~.links.save_links` writes as JSON for
``lightning-smp plan --preset FILE``. Every rank returns the same figures (each is the slowest rank's).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_smp.errors import HybridShardConfigError
from lightning_smp.planner.links import Links

#: Bytes of the timed all-reduces (a small one for the latency, larger ones for the bandwidth).
SIZES = (1 << 12, 1 << 20, 1 << 22)


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _default_device() -> torch.device:
    accelerator = torch.accelerator.current_accelerator()
    if dist.get_backend() == "gloo" or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _slowest(values: Sequence[float], device: torch.device) -> list[float]:
    """The largest of each value over every rank (every rank gets the same list)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _time_all_reduce(group: dist.ProcessGroup, size: int, repeats: int, device: torch.device) -> float:
    data = torch.ones(max(size // 4, 1), dtype=torch.float32, device=device)
    dist.all_reduce(data, group=group)  # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        dist.barrier()  # every group of the kind starts together, as in a step
        _sync(device)
        start = time.perf_counter()
        dist.all_reduce(data, group=group)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit_alpha_beta(sizes: Sequence[int], seconds: Sequence[float], ranks: int) -> tuple[float, float]:
    """``(bandwidth, latency)`` of a ring all-reduce over ``ranks`` from its time at each size: ``t = 2 (p - 1) alpha
    + 2 (p - 1) / p * size / beta``, by least squares (a latency below zero is taken as zero)."""
    steps = 2 * (ranks - 1)
    sent = [steps / ranks * size for size in sizes]
    mean_x, mean_y = statistics.fmean(sent), statistics.fmean(seconds)
    spread = sum((x - mean_x) ** 2 for x in sent)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sent, seconds)) / spread if spread else 0.0
    if slope <= 0:  # noise above the bytes' own time: the largest size's rate, no latency
        return sent[-1] / seconds[-1], 0.0
    return 1.0 / slope, max(mean_y - slope * mean_x, 0.0) / steps


def _matmul_flops(device: torch.device, size: int, repeats: int) -> float:
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    a @ b  # warm-up
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def calibrate(devices_per_node: int | None = None, *, sizes: Sequence[int] = SIZES, repeats: int = 5,
              matmul_size: int | None = None, device: torch.device | str | None = None) -> Links:
    """The links and the compute of the running job, measured (call it on every rank; it takes a few seconds).

    Args:
        devices_per_node: ranks per node, numbered node by node (default: torchrun's ``LOCAL_WORLD_SIZE``).
        sizes: bytes of the timed all-reduces; repeats: timings per size (the median is kept).
        matmul_size: the side of the timed matrix multiplication (default 1024 on CPU, 8192 on an accelerator).
        device: where the tensors live (default: the CPU under gloo, else the current accelerator).

    Raises:
        HybridShardConfigError: no process group, or ``devices_per_node`` does not divide the world.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise HybridShardConfigError(
            "calibrate() measures the links of a running job, and no process group exists. Fix: call it on every"
            " rank after torch.distributed.init_process_group (the strategies have one from setup on), or run"
            " `torchrun --nproc_per_node N --nnodes M -m lightning_smp plan --calibrate true ...`."
        )
    world = dist.get_world_size()
    per_node = devices_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node:
        raise HybridShardConfigError(
            f"devices_per_node={per_node} does not divide the world of {world} ranks. Fix: pass the ranks of one node"
            " (ranks are numbered node by node)."
        )
    device = torch.device(device) if device is not None else _default_device()
    nodes = world // per_node
    mesh = init_device_mesh(device.type, (nodes, per_node), mesh_dim_names=("inter", "intra"))
    measured: dict[str, tuple[float, float]] = {}
    for axis, ranks in (("intra", per_node), ("inter", nodes)):
        if ranks > 1:
            times = [_time_all_reduce(mesh.get_group(axis), size, repeats, device) for size in sizes]
            measured[axis] = fit_alpha_beta(sizes, _slowest(times, device), ranks)
    intra = measured.get("intra", measured.get("inter", (float("inf"), 0.0)))
    inter = measured.get("inter", intra)
    side = matmul_size or (1024 if device.type == "cpu" else 8192)
    flops = -_slowest([-_matmul_flops(device, side, 3)], device)[0]  # the slowest rank's (the max of negatives)
    return Links(intra_bandwidth=intra[0], intra_latency=intra[1], inter_bandwidth=inter[0], inter_latency=inter[1],
                 description=f"calibrated: {nodes} node(s) x {per_node} rank(s), {device.type}"
                             f" ({dist.get_backend()}), {time.strftime('%Y-%m-%d %H:%M')}",
                 device_flops=flops, overlap=device.type != "cpu",
                 reduce_scatter_as_all_reduce=dist.get_backend() == "gloo")


__all__ = ["SIZES", "calibrate", "fit_alpha_beta"]
