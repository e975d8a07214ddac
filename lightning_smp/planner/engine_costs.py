"""Each FSDP engine's own work per unit and micro-batch, measured (``Links.engine_costs``, for
:func:`.calibrate.calibrate` on CPU): its hooks and its copies into and out of the collectives' buffers, which there share the cores with the
compute and add to every micro-batch (:func:`~.timing.engine_seconds`)."""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn import Module

from lightning_smp.planner.timed import agreed_runs, slowest, sync

#: The engines' probe: units of two sizes (a unit's fixed cost and its cost per byte are told apart by them), and a
#: micro-batch of a few rows (the engine's work does not grow with the batch; the compute's noise would).
PROBE_UNITS, PROBE_WIDTHS, PROBE_ROWS = 4, (64, 1024), 8
#: Rounds of the engines' probe, each timing the plain probe and then the wrapped one (the median difference kept).
PROBE_ROUNDS = 5


def _timed_difference(base: Callable[[], None], other: Callable[[], None], device: torch.device,
                      seconds: float) -> float:
    """How much longer one ``other()`` takes than one ``base()`` while every rank runs them: in each of
    :data:`PROBE_ROUNDS` rounds every rank runs ``base`` and then ``other`` the same number of times, each stretch
    between barriers (the slowest rank's time); the median of the rounds' differences. Interleaved, so that the
    machine's drift over the rounds reaches both alike."""
    base()  # warm-up
    other()
    runs = agreed_runs(other, device, seconds / PROBE_ROUNDS / 2)
    differences = []
    for _ in range(PROBE_ROUNDS):
        stretches = []
        for run in (base, other):
            dist.barrier()
            begin = time.perf_counter()
            for _ in range(runs):
                run()
            sync(device)
            dist.barrier()
            stretches.append((time.perf_counter() - begin) / runs)
        differences.append(stretches[1] - stretches[0])
    return statistics.median(differences)


class _ProbeUnit(Module):
    """One unit of the engines' probe: a square layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def fit_unit_cost(unit_bytes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """``(seconds, seconds per byte)`` of an engine's work per unit from its time per unit at two unit sizes: the
    line through both points (neither part below zero)."""
    (small, large), (at_small, at_large) = unit_bytes, seconds
    per_byte = max((at_large - at_small) / (large - small), 0.0)
    return max(at_small - per_byte * small, 0.0), per_byte


def engine_costs(device: torch.device, seconds: float) -> dict[str, tuple[float, float]]:
    """Each FSDP engine's own work per unit and micro-batch (``Links.engine_costs``): a probe of
    :data:`PROBE_UNITS` units runs forward and backward plain and wrapped by the engine over a group of this rank
    alone (the engine's hooks and copies, with no collective to wait for), on every rank at once, at two unit sizes.
    Every engine that ``fsdp_version`` selects is measured (:data:`~lightning_smp.engines.FSDP_ENGINES`); every rank
    returns the slowest rank's figures."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lightning_smp.degree import Layout
    from lightning_smp.engines import FSDP_ENGINES
    from lightning_smp.engines.base import ShardingPlan
    from lightning_smp.names import FULL_SHARD

    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    layout = Layout(world_size=1, degree=0, replicate=1, shard=1, requested_strategy=FULL_SHARD,
                    sharding_strategy=FULL_SHARD)
    plan = ShardingPlan(layout=layout, device=device, mesh=DeviceMesh.from_group(alone, device.type),
                        options={"auto_wrap_policy": ModuleWrapPolicy({_ProbeUnit})})
    sizes = [width * width * 4 + width * 4 for width in PROBE_WIDTHS]  # fp32 weight and bias
    per_unit: list[float] = []
    try:
        for engine in FSDP_ENGINES:
            for width in PROBE_WIDTHS:
                torch.manual_seed(0)
                plain = torch.nn.Sequential(*(_ProbeUnit(width) for _ in range(PROBE_UNITS))).to(device)
                with warnings.catch_warnings():  # FSDP1 runs NO_SHARD over one rank, and says so
                    warnings.simplefilter("ignore")
                    wrapped = engine.complete(engine.wrap(copy.deepcopy(plain), plan), plan)
                batch = torch.randn(PROBE_ROWS, width, device=device)
                per_unit.append(_timed_difference(_probe_pass(plain, batch), _probe_pass(wrapped, batch), device,
                                                  seconds) / PROBE_UNITS)
    finally:
        dist.destroy_process_group(alone)
    worst = slowest(per_unit, device)
    count = len(PROBE_WIDTHS)
    return {engine.name: fit_unit_cost(sizes, worst[i * count:(i + 1) * count])
            for i, engine in enumerate(FSDP_ENGINES)}


def _probe_pass(model: Module, batch: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(batch).sum().backward()
        for param in model.parameters():
            param.grad = None

    return run


__all__ = ["PROBE_ROUNDS", "PROBE_ROWS", "PROBE_UNITS", "PROBE_WIDTHS", "engine_costs", "fit_unit_cost"]
