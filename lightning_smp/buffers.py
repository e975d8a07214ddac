"""Buffers (BatchNorm's running statistics, any ``register_buffer``) kept as DDP keeps them.

FSDP never syncs buffers: each rank updates its own running statistics from its own batches, so every rank but one
validates, tests and predicts with a model that was never saved, and a metric logged with ``sync_dist=True`` averages
ranks that disagree. DDP (``broadcast_buffers=True``, its default) copies global rank 0's buffers to every rank
before a forward that follows a training forward with gradient sync on, and before nothing else. :class:`BufferSync`
runs that rule around the sharded root's forward, on every rank alike (costing what it costs DDP: one broadcast of
the buffers, nothing for a model without any):

- after each forward: the next one syncs if this one ran with gradients enabled outside an accumulation window (the
  window's micro-batches are DDP's ``no_sync``); a forward called inside another (an FSDP2 step that calls
  ``self(x)``) counts once;
- before a forward that is due: one coalesced broadcast of every buffer from global rank 0 (c10d's
  ``_broadcast_coalesced``, as DDP's ``_sync_buffers``).

A checkpoint holds rank 0's buffers, as DDP's does, with or without this rule: a full state is gathered on rank 0,
and a sharded one gives each replicated tensor to the lowest rank holding it (``checkpoint/saving.py``). Under the
DDP engine, ``DistributedDataParallel`` runs the rule itself. ``broadcast_buffers=False`` keeps each rank's own
buffers (DDP's same switch).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.nn import Module

from lightning_smp.replicas import broadcast_tensors

_ATTRIBUTE = "_lightning_smp_buffer_sync"


class BufferSync:
    """Global rank 0's buffers to every rank, by DDP's rule (see the module's docstring), on ``root``."""

    def __init__(self, root: Module, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        self.root = root
        self.device = device
        #: the ranks that share buffers (``None``: the world; ``replica_sync``: the replica group, its first rank's)
        self.group = group
        #: DDP's ``require_forward_param_sync``: true at construction, so the first forward syncs
        self.due = True
        self._windows = 0  # accumulation windows entered and not left (nested contexts count once each)
        self._depth = 0  # forwards of the root in progress

    def sync(self) -> None:
        """Collective: every rank's buffers become global rank 0's (of the group's first rank)."""
        buffers = list(self.root.buffers())
        if buffers:
            source = 0 if self.group is None else dist.get_global_rank(self.group, 0)
            broadcast_tensors(buffers, source, self.group, self.device)

    def _before_forward(self, module: Module, args: tuple) -> None:
        self._depth += 1
        if self._depth == 1 and self.due:
            self.sync()

    def _after_forward(self, module: Module, args: tuple, output: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.due = torch.is_grad_enabled() and self._windows == 0

    @contextmanager
    def window(self) -> Generator[None, None, None]:
        self._windows += 1
        try:
            yield
        finally:
            self._windows -= 1


def install(root: Module, device: torch.device, group: dist.ProcessGroup | None = None) -> BufferSync:
    """Keep ``root``'s buffers as DDP does (its forward hooks run the rule) among ``group``'s ranks (``None``: the
    world); installing twice returns the first."""
    existing = find(root)
    if existing is not None:
        return existing
    sync = BufferSync(root, device, group)
    root.register_forward_pre_hook(sync._before_forward)
    # always_call: a forward that raised still ends, or the next one would never count as outermost
    root.register_forward_hook(sync._after_forward, always_call=True)
    setattr(root, _ATTRIBUTE, sync)
    return sync


def find(root: Module | None) -> BufferSync | None:
    return getattr(root, _ATTRIBUTE, None) if root is not None else None


@contextmanager
def accumulation_window(root: Module | None) -> Generator[None, None, None]:
    """Around an accumulation window's micro-batches before the last (the front ends' ``block_backward_sync`` and
    ``no_backward_sync``): their forwards leave the next forward unsynced, as DDP's ``no_sync`` does."""
    sync = find(root)
    if sync is None:
        yield
        return
    with sync.window():
        yield


__all__ = ["BufferSync", "accumulation_window", "find", "install"]
