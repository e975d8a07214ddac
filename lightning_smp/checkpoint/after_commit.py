"""What Lightning's ``ModelCheckpoint`` does after a save, held back until a background save is committed.

``ModelCheckpoint`` links ``last``, removes the checkpoint a new one replaces and notifies loggers right after
``trainer.save_checkpoint`` returns: with a background save that is before the checkpoint exists under its name, and a
crash in that window would leave nothing to resume from. The removal goes through the strategy
(``remove_checkpoint``, deferred there); the link and the loggers' ``after_save_checkpoint`` are called on the
callback and the loggers themselves, so :func:`defer_until_commit` routes those two, on these objects only and for one
``fit``, through :meth:`BackgroundSaver.after_commit`; the link itself is switched in one step
(:func:`link_atomically`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_smp.checkpoint.atomic import commit, temporary_name
from lightning_smp.checkpoint.background import BackgroundSaver

if TYPE_CHECKING:
    import lightning.pytorch as pl


def defer_until_commit(trainer: pl.Trainer, saver: BackgroundSaver) -> Callable[[], None]:
    """Make the ``last`` link of every ``ModelCheckpoint`` and every logger's ``after_save_checkpoint`` wait for the
    save in flight; return the function that undoes it (call it when ``fit`` ends)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    undo: list[Callable[[], None]] = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and "_link_checkpoint" not in vars(callback):

            def deferred_link(trainer: Any, filepath: str, linkpath: str) -> None:
                saver.after_commit(lambda: link_atomically(trainer, filepath, linkpath))

            callback._link_checkpoint = deferred_link  # type: ignore[method-assign]  # this instance only
            undo.append(partial(_forget, callback, "_link_checkpoint"))
    for logger in trainer.loggers:
        if "after_save_checkpoint" in vars(logger):
            continue
        notify = logger.after_save_checkpoint

        def deferred_notify(checkpoint_callback: Any, _notify: Any = notify) -> None:
            saver.after_commit(lambda: _notify(checkpoint_callback))

        logger.after_save_checkpoint = deferred_notify  # type: ignore[method-assign]  # this instance only
        undo.append(partial(_forget, logger, "after_save_checkpoint"))

    def restore() -> None:
        for step in undo:
            step()

    return restore


def link_atomically(trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
    """``ModelCheckpoint._link_checkpoint`` (``last`` as a relative link to ``filepath``), but switched in one step:
    the link is made under a temporary name and exchanged with what ``linkpath`` held (Lightning deletes that first,
    so that a reader could find ``last`` half removed or missing)."""
    if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
        link = Path(linkpath)
        tmp = temporary_name(link, "link")
        os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), tmp)
        commit(tmp, link)
    trainer.strategy.barrier()


def _forget(obj: Any, name: str) -> None:
    """Drop the instance attribute ``name`` of ``obj``: its class's method is in effect again."""
    obj.__dict__.pop(name, None)


__all__ = ["defer_until_commit"]
