"""What the Trainer's loop holds besides the model and the optimizers, for fault-tolerant replica groups: a step that
is not committed leaves the loop's step counters as they were, and a healing group takes a live peer's schedulers,
loop counters and data position. Explicit inputs (the Trainer, its scheduler configs); the Trainer strategy wires
them in.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from lightning_smp.errors import FaultToleranceError, UnsupportedOptionError

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


def check_data_can_follow(module: Any) -> None:
    """Refused before the first step: a ``training_step`` that takes the dataloader iterator draws as many batches per
    step as it likes, so a live peer's count of steps is not a data position a healing group could move to."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    if is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True):
        raise UnsupportedOptionError(
            "fault_tolerance with a training_step that takes dataloader_iter: a group that heals moves its data to a"
            " live peer's position, counted in batches per step, and a step that draws its own batches has none."
            " Fix: training_step(self, batch, batch_idx).")


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
    start of the same step), and move this group's data to the peer's position: the peer's epoch (its samplers'
    ``set_epoch``, so a shuffled order is that epoch's), and in it the batch after the peer's (the batches before are
    drawn and dropped; each group reads its own part of the data, :attr:`distributed_sampler_kwargs`)."""
    if len(scheduler_configs) != len(state["schedulers"]):
        raise RuntimeError(f"the live peer has {len(state['schedulers'])} learning-rate schedulers, this group"
                           f" {len(scheduler_configs)}.")
    for config, scheduler_state in zip(scheduler_configs, state["schedulers"]):
        config.scheduler.load_state_dict(scheduler_state)
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    fit_loop.epoch_progress.load_state_dict(state["epoch_progress"])
    epoch_loop.batch_progress.load_state_dict(state["batch_progress"])
    _optimizer_step_progress(trainer).load_state_dict(state["optimizer_steps"])
    epoch_loop._batches_that_stepped = state["batches_that_stepped"]
    fetcher = fit_loop._data_fetcher
    if fetcher is not None:
        _move_data_to(fetcher, epoch=fit_loop.epoch_progress.current.processed,
                      fetched=epoch_loop.batch_progress.current.ready)


def _move_data_to(fetcher: Any, *, epoch: int, fetched: int) -> None:
    """Start the training data again at ``epoch`` (as Lightning's fit loop starts an epoch: the samplers' epoch, then
    a new iterator) and draw the ``fetched`` batches the peer has drawn in it, so that the next batch is the one the
    peer reads next. One path whether the peer is in this group's epoch or a later one."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    for loader in fetcher.combined_loader.flattened:
        _set_sampler_epoch(loader, epoch)
    iter(fetcher)
    for drawn in range(fetched):
        try:
            next(fetcher)
        except StopIteration:
            raise FaultToleranceError(
                f"the live peer has drawn {fetched} batches of epoch {epoch}, this group's training data holds"
                f" {drawn}: both groups must read data of the same length (the same dataset, batch size and"
                " number of groups).") from None
    log.info("healed: this group's data moved to the peer's position (epoch %d, %d batches drawn)", epoch, fetched)


__all__ = ["check_data_can_follow", "load_loop_state", "loop_state", "uncount_step"]
