"""What one rank measures in a run, at the same points under Lightning and in the plain loop.

Measured per rank:

- **step time**: wall time between the starts of consecutive batches (Lightning's ``on_train_batch_start``; the
  same point of the plain loop), so forward, backward, optimizer step and fetching the next batch all count; and
  the process's CPU time over the same interval (less sensitive to other programs on the machine);
- **model-state bytes** and their floor, from the real tensors at the end of the last warm-up step
  (:func:`lightning_smp.callbacks.memory.measure_memory`, gradients as they were before the optimizer step);
- **traffic** of that same step per mesh axis (:class:`lightning_smp.accounting.CommCounter`) next to the textbook figure
  (:func:`lightning_smp.callbacks.memory.textbook`), and the size of the group each axis runs on;
- **peak memory**: resident memory of the process (reset at the start of the run where Linux allows it) and, on
  CUDA, ``max_memory_allocated``/``max_memory_reserved``.

Only the measured step pays for counting collectives; the timed steps run with nothing installed.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import Module

from benchmarks.settings import Settings
from lightning_smp.accounting.counter import CommCounter
from lightning_smp.accounting.memory import comm_groups, gradient_bytes, measure_memory, textbook
from lightning_smp.callbacks.memory import strategy_mesh


def reset_peak_rss() -> None:
    """Start the process's peak-RSS count afresh (Linux >= 4.0), so that a run in a reused process is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak then covers the whole process
        pass


def current_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


class StepProbe:
    """Timestamps batch starts and measures memory and traffic of one step (the last warm-up step).

    Used by the Lightning callback and the plain loop alike, so both are measured at the same points.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []
        self.counter: CommCounter | None = None
        self.grads_bytes: int | None = None
        self.measured: dict[str, Any] = {}

    @property
    def measured_step(self) -> int:
        return self.settings.warmup - 1

    def batch_start(self, index: int, groups: dict[str, Any]) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())
        if index == self.measured_step:
            self.counter = CommCounter(groups=groups)
            self.counter.__enter__()

    def before_optimizer_step(self, index: int, model: Module) -> None:
        if index == self.measured_step:
            # complete here; gone (set to None) before the next backward
            self.grads_bytes = gradient_bytes(model)

    def batch_end(self, index: int, model: Module, optimizers: list[torch.optim.Optimizer], groups: dict[str, Any]) -> None:
        if index != self.measured_step or self.counter is None:
            return
        self.counter.__exit__(None, None, None)
        comm = self.counter.counts()
        self.counter = None
        self.measured = {
            "memory": measure_memory(model, optimizers, self.grads_bytes),
            "comm": comm,
            "comm_textbook": textbook(model, 1),
            "group_sizes": {axis: _group_size(group) for axis, group in groups.items()},
        }

    def close(self) -> None:
        if self.counter is not None:  # an exception inside the measured step
            self.counter.__exit__(None, None, None)
            self.counter = None

    def step_times(self, cpu: bool = False) -> list[float]:
        """Durations of the timed steps (seconds): from each timed batch start to the next batch start.

        ``cpu=True``: the CPU time the process (all its threads) spent in each of them instead of wall time; it
        hardly changes when other programs compete for the cores, wall time does.
        """
        w, n = self.settings.warmup, self.settings.steps
        starts = (self.cpu_starts if cpu else self.starts)[w : w + n + 1]
        return [b - a for a, b in itertools.pairwise(starts)]


def _group_size(group: Any) -> int:
    return (group or dist.group.WORLD).size()


def lightning_probe_callback(probe: StepProbe) -> Any:
    """A Lightning callback that calls ``probe`` where the plain loop does: batch start, before the optimizer
    step, batch end (and closes it on an exception)."""
    from lightning.pytorch.callbacks import Callback

    class _Probe(Callback):
        def __init__(self) -> None:
            self.groups: dict[str, Any] = {}

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.groups = comm_groups(trainer.strategy.model, strategy_mesh(trainer.strategy))

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            probe.batch_start(batch_idx, self.groups)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            probe.before_optimizer_step(trainer.global_step, trainer.strategy.model)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            probe.batch_end(batch_idx, trainer.strategy.model, trainer.optimizers, self.groups)

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            probe.close()

    return _Probe()
