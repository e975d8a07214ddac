"""Gradient accumulation under FSDP2: reduction turned off for the micro-batches before a window's last, and, before
each optimizer step, the check that it is back on and that no deferred sum waits outside ``.grad``."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

from torch.nn import Module

from lightning_smp.engines import unused
from lightning_smp.engines.fsdp2 import groups as fsdp2_groups
from lightning_smp.engines.fsdp2.groups import fsdp_modules
from lightning_smp.errors import GradientSyncError


@contextmanager
def reducing_off(model: Module, all_reduce_only: bool) -> Generator[None, None, None]:
    # per module (recurse=False): a model the user sharded module by module has no FSDP2 root
    modules = fsdp_modules(model)
    for module in modules:
        if all_reduce_only:
            module.set_requires_all_reduce(False, recurse=False)
        else:
            module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        # always back on: the last micro-batch must all-reduce, or ``.grad`` stays None and the step does nothing
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)


def settle_gradients(model: Module, defer_unused: bool = False) -> unused.Unreduced | None:
    off = fsdp2_groups.reduction_turned_off(model)
    if off:
        raise GradientSyncError(
            f"{len(off)} FSDP2 module(s) still have their gradient reduction turned off"
            " (set_requires_all_reduce(False) or set_requires_gradient_sync(False)) as the optimizer is about to"
            " step: their .grad is None or unreduced and the step would silently skip them. Fix: turn it back on"
            " before the last micro-batch's backward (HybridShardFSDPStrategy does so for accumulate_grad_batches;"
            " do not call these setters yourself)."
        )
    # the state, not only the flags: a sum still waiting for its all-reduce was never applied to any .grad
    pending = fsdp2_groups.holding_unreduced_sums(model)
    if pending:
        raise GradientSyncError(
            f"{len(pending)} FSDP2 parameter group(s) hold a gradient sum that was never all-reduced across replicas"
            " as the optimizer is about to step: the step would skip those gradients or apply them to the wrong"
            " window. Fix: run the last micro-batch's backward with gradient sync on (outside no_backward_sync),"
            " or discard the window with model.reset_iter_state() on the sharded root."
        )
    if defer_unused:
        return fsdp2_groups.unreduced(model)
    fsdp2_groups.restore_unused(model)
    return None


def discard_unreduced_gradients(model: Module) -> None:
    unused.forget(fsdp2_groups.presences(model))
    # the deferred all-reduce keeps each group's partial sum outside .grad; the root's reset_iter_state (torch's
    # recovery API) discards it, as zero_grad discards DDP's accumulated .grad
    if fsdp2_groups.holding_unreduced_sums(model):
        reset = getattr(model, "reset_iter_state", None)
        if reset is None:
            raise GradientSyncError(
                "optimizer.zero_grad() in the middle of an accumulation window: the deferred gradient sums cannot"
                " be discarded on this model (no sharded root with reset_iter_state). Fix: call zero_grad at an"
                " optimizer step boundary, or use gradient_accumulation='every_micro_batch'."
            )
        reset()


__all__ = ["discard_unreduced_gradients", "reducing_off", "settle_gradients"]
