"""Measure the cluster at hand: the links inside a node and across nodes, and what one rank computes per second.

:func:`calibrate` runs on every rank of a running job (a collective): it times all-reduces of a few sizes inside each
node and across nodes, all groups of a kind at once (as a training step's collectives run: every rank of a node sends
through the node's network together, so the figure is each rank's share), and fits the alpha-beta model of
:mod:`.links` to them; it times matrix multiplications on every rank at once, sustained (what one rank computes
while the others compute too); and on CPU it times each FSDP engine's own work per unit
(:func:`.engine_costs.engine_costs`). The result is a :class:`~.links.Links` the planner takes as it takes a preset,
and which :func:`~.links.save_links` writes as JSON for ``lightning-smp plan --preset FILE``. Every rank returns the same figures (each is the slowest rank's).
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch.nn import Module

from lightning_smp.autocast import autocast_context
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.links import Links
from lightning_smp.planner.engine_costs import engine_costs
from lightning_smp.planner.timed import agreed_runs, slowest, sync

#: Bytes of the timed all-reduces (a small one for the latency, larger ones for the bandwidth).
SIZES = (1 << 12, 1 << 20, 1 << 22)
#: Rounds of timed compute (the median is kept): at least one run each, however long a run takes.
ROUNDS = 3


def _default_device() -> torch.device:
    accelerator = torch.accelerator.current_accelerator()
    if dist.get_backend() == "gloo" or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _time_all_reduce(group: dist.ProcessGroup, size: int, repeats: int, device: torch.device) -> float:
    data = torch.ones(max(size // 4, 1), dtype=torch.float32, device=device)
    dist.all_reduce(data, group=group)  # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        dist.barrier()  # every group of the kind starts together, as in a step
        sync(device)
        start = time.perf_counter()
        dist.all_reduce(data, group=group)
        sync(device)
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


def _matmul_flops(device: torch.device, size: int, seconds: float) -> float:
    """What this rank computes per second while every rank computes: the same number of matrix multiplications on
    every rank at once, for about ``seconds`` (ranks that share cores or a memory bus slow each other down, as they
    do in a training step; one multiplication alone would measure an idle machine)."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)

    def run() -> None:
        torch.mm(a, b)

    return 2.0 * size**3 / _timed_run(run, device, seconds)


def _timed_run(run: Callable[[], None], device: torch.device, seconds: float) -> float:
    """The seconds one ``run()`` takes while every rank runs it: every rank runs it the same number of times, about
    ``seconds`` in all, in :data:`ROUNDS` rounds that all ranks start together; the median round's time per run.
    Timed as one stretch, a run longer than ``seconds`` would be timed once, and partly on cores that the ranks
    which finished first had left idle."""
    run()  # warm-up
    per_round = agreed_runs(run, device, seconds / ROUNDS)
    times = []
    for _ in range(ROUNDS):
        dist.barrier()  # every rank starts together, as the ranks of a step do after a collective
        start = time.perf_counter()
        for _ in range(per_round):
            run()
        sync(device)
        times.append((time.perf_counter() - start) / per_round)
    return statistics.median(times)


def _model_flops(model: Module, example_input: Any, step: Callable[[Module, Any], torch.Tensor] | None,
                 device: torch.device, seconds: float, precision: str) -> float:
    """The FLOP/s one forward and backward of ``model`` on ``example_input`` achieves on this rank while every rank
    runs it: its FLOPs (counted as the planner counts them) over its time. A copy trains, unsharded: the model must
    fit on one device."""
    from lightning_smp.planner.activations import _default_step, trace_micro_batch

    if any(p.is_meta for p in model.parameters()):
        raise HybridShardConfigError(
            f"calibrate(model=...) times the model, and {type(model).__name__} has parameters on the meta device."
            " Fix: build it on a real device, or calibrate without model= (a matrix multiplication's rate)."
        )
    trace = trace_micro_batch(model, example_input, step=step, device=device, precision=precision)
    work = copy.deepcopy(model).to(device)
    batch = _to_device(example_input, device)
    run_step = step or _default_step

    def run() -> None:
        with autocast_context(precision, device.type) or nullcontext():  # as the run computes
            loss = run_step(work, batch)
        loss.backward()
        for param in work.parameters():
            param.grad = None

    return (trace.forward_flops + trace.backward_flops) / _timed_run(run, device, seconds)


def _to_device(value: Any, device: torch.device) -> Any:
    """``value``'s tensors on ``device``; a meta one (a model built on the meta device) as zeros: only time counts."""
    def move(tensor: torch.Tensor) -> torch.Tensor:
        return torch.zeros(tensor.shape, dtype=tensor.dtype, device=device) if tensor.is_meta else tensor.to(device)

    return apply_to_collection(value, torch.Tensor, move)


def calibrate(devices_per_node: int | None = None, *, sizes: Sequence[int] = SIZES, repeats: int = 5,
              matmul_size: int | None = None, compute_seconds: float = 0.5,
              device: torch.device | str | None = None, model: Module | None = None, example_input: Any = None,
              step: Callable[[Module, Any], torch.Tensor] | None = None, precision: str = "32-true",
              engines: bool = True) -> Links:
    """The links and the compute of the running job, measured (call it on every rank; it takes a few seconds).

    Args:
        devices_per_node: ranks per node, numbered node by node (default: torchrun's ``LOCAL_WORLD_SIZE``).
        sizes: bytes of the timed all-reduces; repeats: timings per size (the median is kept).
        matmul_size: the side of the timed matrix multiplication (default 1024 on CPU, 8192 on an accelerator).
        compute_seconds: about how long every rank computes at once.
        model, example_input, step: time the compute as forward and backward passes of ``model`` on
            ``example_input`` (one rank's micro-batch; ``step(model, batch) -> loss`` as for the planner), on an
            unsharded copy that must fit on one device, instead of a matrix multiplication: the rate the model's own
            layers achieve, element-wise operations and small matrices included; ``precision``: the run's (a
            ``*-mixed`` one is timed under autocast).
        device: where the tensors live (default: the CPU under gloo, else the current accelerator).
        engines: on CPU, also time each FSDP engine's own work per unit (``Links.engine_costs``, about a second per
            engine): there it shares the cores with the compute and adds to the step; on an accelerator it runs
            ahead of the device and is not timed.

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
            measured[axis] = fit_alpha_beta(sizes, slowest(times, device), ranks)
    intra = measured.get("intra", measured.get("inter", (float("inf"), 0.0)))
    inter = measured.get("inter", intra)
    if model is not None and example_input is None:
        raise HybridShardConfigError(
            f"calibrate(model={type(model).__name__}) times the model's forward and backward, and example_input is"
            " None. Fix: pass example_input= (one rank's micro-batch), or no model= (a matrix multiplication's rate)."
        )
    if model is not None:
        rate = _model_flops(model, example_input, step, device, compute_seconds, precision)
        timed = type(model).__name__
    else:
        side = matmul_size or (1024 if device.type == "cpu" else 8192)
        rate, timed = _matmul_flops(device, side, compute_seconds), f"{side}x{side} matmul"
    flops = -slowest([-rate], device)[0]  # the slowest rank's
    costs = engine_costs(device, compute_seconds) if engines and device.type == "cpu" else {}
    return Links(intra_bandwidth=intra[0], intra_latency=intra[1], inter_bandwidth=inter[0], inter_latency=inter[1],
                 description=f"calibrated: {nodes} node(s) x {per_node} rank(s), {device.type}"
                             f" ({dist.get_backend()}), compute of {timed}, {time.strftime('%Y-%m-%d %H:%M')}",
                 device_flops=flops, overlap=device.type != "cpu",
                 reduce_scatter_as_all_reduce=dist.get_backend() == "gloo", engine_costs=costs)


__all__ = ["SIZES", "agreed_runs", "calibrate", "fit_alpha_beta", "slowest", "sync"]
