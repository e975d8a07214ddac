"""Timing on every rank at once, what the calibration (:mod:`.calibrate`) and the engines' probe
(:mod:`.engine_costs`) share: a wait for the device, the slowest rank's figures, and a run count every rank agrees on."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU), so that a timing ends with the work."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def slowest(values: Sequence[float], device: torch.device) -> list[float]:
    """The largest of each value over every rank (every rank gets the same list)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def agreed_runs(run: Callable[[], None], device: torch.device, seconds: float) -> int:
    """How many times every rank runs ``run`` to fill about ``seconds`` (at least once), from one timed run: the same
    count on every rank (the slowest rank's), so that no rank runs its last ones alone on idle cores."""
    sync(device)
    start = time.perf_counter()
    run()
    sync(device)
    once = max(time.perf_counter() - start, 1e-9)
    return int(max(-slowest([-min(seconds / once, 10_000.0)], device)[0], 1.0))


__all__ = ["agreed_runs", "slowest", "sync"]
