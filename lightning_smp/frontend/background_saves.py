"""Both front ends' side of checkpoints written in the background (``async_save``): the saver made at setup, its
state, waiting for it, and ending it after an error. What runs is :mod:`lightning_smp.checkpoint.background`."""

from __future__ import annotations

import logging

from lightning_smp.checkpoint.background import BackgroundSaver
from lightning_smp.checkpoint.local import LocalStateCheck
from lightning_smp.collectives import Collectives, checkpoint_group
from lightning_smp.core import HybridShardCore

log = logging.getLogger("lightning_smp.frontend")


class BackgroundSaves:
    """Mixin of :class:`~lightning_smp.frontend.HybridShardFrontEnd`: the background saver's glue."""

    core: HybridShardCore
    #: writes sharded checkpoints in the background (``async_save``); made with its process group at setup
    _background: BackgroundSaver | None = None

    def _start_background_saves(self, device_type: str) -> None:
        """With ``async_save``: the saver, on its own gloo group (the writing threads' collectives must never queue
        behind the training's)."""
        if self.core.async_save and self._background is None:
            self._background = BackgroundSaver(checkpoint_group(device_type))

    @property
    def async_save(self) -> bool:
        """Whether sharded checkpoints are written in the background (see :mod:`lightning_smp.checkpoint.background`)."""
        return self.core.async_save

    @property
    def _local_state_check(self) -> LocalStateCheck | None:
        """The background saver's record of whether the engine's local description of the state holds (``None``
        without ``async_save``): what a save's state comes from (:func:`~lightning_smp.checkpoint.local.model_state_to_save`)."""
        return self._background.local_state if self._background is not None else None

    @property
    def checkpoint_staging_bytes(self) -> int:
        """Host memory this rank's staged copy of the largest background save took so far (0 without
        ``async_save``, and on ranks whose shards another replica writes)."""
        return self._background.peak_staged_bytes if self._background is not None else 0

    @property
    def checkpoint_in_flight(self) -> bool:
        """Whether a background save was submitted whose outcome has not been taken yet (see :meth:`wait_for_checkpoint`)."""
        return self._background is not None and self._background.in_flight

    def wait_for_checkpoint(self) -> None:
        """Block until the checkpoint being written in the background is committed (and what waited for it has run);
        raise its failure, the same on every rank. Nothing without ``async_save`` or a save in flight. Call it on
        every rank; the end of ``fit``, the next save and every load call it for you."""
        if self._background is not None:
            self._background.wait()

    def _poll_checkpoint(self, collectives: Collectives) -> None:
        """At a training step: take the outcome of a background save whose write ended on every rank."""
        if self._background is not None:
            self._background.poll(collectives)

    def end_checkpoint_after_error(self) -> None:
        """After training failed: wait for the write in flight (it commits if every rank wrote), skip what waited for
        it, and log (not raise) its own failure, which must not hide the error that ended training."""
        if self._background is not None and self._background.in_flight:
            try:
                self._background.wait(side_effects=False)
            except Exception as err:  # noqa: BLE001 - logged; the training error is the one raised
                log.error("%s", err)


__all__ = ["BackgroundSaves"]
