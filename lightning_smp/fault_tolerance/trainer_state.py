"""What the Trainer's loop holds besides the model and the optimizers, for fault-tolerant replica groups: a step that
is not committed leaves the loop's step counters as they were, and a healing group takes a live peer's schedulers,
loop counters and data position. Explicit inputs (the Trainer, its scheduler configs); the Trainer strategy wires
them in.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


def _optimizer_step_progress(trainer: Any) -> Any:
    """The progress whose ``total.completed`` is ``trainer.global_step`` (automatic or manual optimization's)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    module = trainer.lightning_module
    if module is None or module.automatic_optimization:
        return epoch_loop.automatic_optimization.optim_progress.optimizer.step
    return epoch_loop.manual_optimization.optim_step_progress


def uncount_step(trainer: Any) -> None:
    """An optimizer step the groups did not commit: called inside it, before the loop counts it as completed, so that
    ``global_step`` (and what keys on it: schedulers stepping by step, checkpoint triggers, loggers' steps) stays."""
    progress = _optimizer_step_progress(trainer)
    for tracker in (progress.total, progress.current):
        tracker.ready -= 1
        tracker.completed -= 1


def loop_state(trainer: Any, scheduler_configs: Sequence[Any]) -> dict[str, Any]:
    """The schedulers' state and the loop's counters, as a healing peer takes them (read at the start of a step)."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    return {
        "schedulers": [config.scheduler.state_dict() for config in scheduler_configs],
        "epoch_progress": fit_loop.epoch_progress.state_dict(),
        "batch_progress": epoch_loop.batch_progress.state_dict(),
        "optimizer_steps": _optimizer_step_progress(trainer).state_dict(),
        "batches_that_stepped": epoch_loop._batches_that_stepped,
    }


def load_loop_state(trainer: Any, scheduler_configs: Sequence[Any], state: dict[str, Any]) -> None:
    """Take a live peer's schedulers and counters (inside this group's first step, whose state the peer took at the
    start of the same step), and move this group's data on to the peer's position in the epoch: the batches between
    are drawn and dropped (each group reads its own part of the data, :attr:`distributed_sampler_kwargs`). A peer in a
    later epoch: this group goes on with the rest of its current epoch's order, counted as the peer's epoch."""
    if len(scheduler_configs) != len(state["schedulers"]):
        raise RuntimeError(f"the live peer has {len(state['schedulers'])} learning-rate schedulers, this group"
                           f" {len(scheduler_configs)}.")
    for config, scheduler_state in zip(scheduler_configs, state["schedulers"]):
        config.scheduler.load_state_dict(scheduler_state)
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    same_epoch = fit_loop.epoch_progress.current.completed == state["epoch_progress"]["current"]["completed"]
    behind = state["batch_progress"]["current"]["ready"] - epoch_loop.batch_progress.current.ready
    fit_loop.epoch_progress.load_state_dict(state["epoch_progress"])
    epoch_loop.batch_progress.load_state_dict(state["batch_progress"])
    _optimizer_step_progress(trainer).load_state_dict(state["optimizer_steps"])
    epoch_loop._batches_that_stepped = state["batches_that_stepped"]
    fetcher = fit_loop._data_fetcher
    if same_epoch and behind > 0 and fetcher is not None:
        skipped = 0
        for _ in range(behind):
            try:
                next(fetcher)
            except StopIteration:
                break
            skipped += 1
        log.info("healed: %d batches of this group's data skipped to the peer's position", skipped)


__all__ = ["load_loop_state", "loop_state", "uncount_step"]
