"""FSDP1 under ``no_sync``: reduce what a window accumulated for a unit that the window's last backward did not reach.

Only a unit's own post-backward hook reduces its gradient, and the hook fires only when the last backward reaches the
unit's parameters. A unit used in an earlier micro-batch of the window but not in the last one (its forward skipped,
or its output left out of that loss) kept its accumulated, unsharded gradient: under a sharded strategy FSDP stopped
on an ``AssertionError`` about ``_saved_grad_shard``; under ``NO_SHARD`` each replica stepped with its own gradient,
silently. FSDP calls one final callback at the end of every backward of a root; for the roots this engine sharded, the
callback first reduces such units exactly as their hook would have (every rank in the same order: the units of the
root, in order), then runs FSDP's own.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from torch.nn import Module

_ROOTS: weakref.WeakSet[Module] = weakref.WeakSet()
_INSTALLED: list[bool] = []


def track(root: Module) -> None:
    """Reduce left-out units at the end of each backward of ``root`` (an FSDP1 root that this engine sharded)."""
    _ROOTS.add(root)
    if _INSTALLED:
        return
    from torch.distributed.fsdp import _runtime_utils

    original = _runtime_utils._post_backward_final_callback

    @functools.wraps(original)
    def final_callback(state: Any, module: Any) -> None:
        if state in _ROOTS:
            reduce_left_out(state)
        original(state, module)
        if state in _ROOTS:
            register_unsharded_views(state)

    # FSDP looks the callback up in its module when it queues it, at the root's pre-backward hook
    _runtime_utils._post_backward_final_callback = final_callback
    _INSTALLED.append(True)


def reduce_left_out(root: Any) -> None:
    """Before FSDP finalises the gradients of ``root``'s backward: reduce every unit that holds a gradient accumulated
    under ``no_sync`` and whose hook did not run in this backward; forget the accumulation of a unit whose gradient was
    dropped since (``zero_grad`` in the middle of the window)."""
    from torch.distributed.fsdp._common_utils import HandleTrainingState

    if not root._sync_gradients:
        return  # inside no_sync: this backward accumulates too
    for state in root._all_fsdp_states:
        handle = state._handle
        if handle is None or not handle.flat_param.requires_grad:
            continue
        flat = handle.flat_param
        # _post_backward_called: a hook ran since FSDP last handed out .grad (it resets it only in a synced backward)
        if not flat._post_backward_called or handle._training_state == HandleTrainingState.BACKWARD_POST:
            continue
        if flat.grad is None:
            flat._post_backward_called = False  # the accumulated gradient was dropped: nothing left to reduce
            continue
        _reduce_as_the_hook_would(state, handle)


def register_unsharded_views(root: Any) -> None:
    """After FSDP's own end of backward: under ``NO_SHARD`` with ``use_orig_params``, give every unit whose forward ran
    but whose hook did not (its output left out of the loss) its parameters back as registered ``nn.Parameter``
    views. Its forward left them plain tensors, FSDP's catch-all reshard skips ``NO_SHARD`` (nothing to free), and a
    full state dict then misses them (an ``AssertionError``)."""
    for state in root._all_fsdp_states:
        handle = state._handle
        if handle is None or handle.uses_sharded_strategy or not handle._use_orig_params:
            continue
        if any(info.module._parameters.get(info.param_name) is None for info in handle.flat_param._param_infos):
            handle._use_sharded_views()  # NO_SHARD: the unflattened views, registered as parameters


def _reduce_as_the_hook_would(state: Any, handle: Any) -> None:
    from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState
    from torch.distributed.fsdp._runtime_utils import (
        _low_precision_hook_enabled,
        _post_backward_reshard,
        _reduce_grad,
        _reduce_grad_no_shard,
    )

    flat = handle.flat_param
    # the states the hook runs in (FSDP's reduction helpers check them)
    before = state.training_state, handle._training_state
    state.training_state, handle._training_state = TrainingState.FORWARD_BACKWARD, HandleTrainingState.BACKWARD_POST
    try:
        if hasattr(flat, "_post_backward_hook_state"):
            # its forward ran in this micro-batch (only the loss left it out): resharded first, as by the hook
            _post_backward_reshard(state, handle)
        current = state._device_handle.current_stream()
        state._post_backward_stream.wait_stream(current)
        with state._device_handle.stream(state._post_backward_stream):
            if (not _low_precision_hook_enabled(state) and flat.grad.dtype != handle._reduce_dtype
                    and not handle._force_full_precision):
                flat.grad.data = flat.grad.to(handle._reduce_dtype)
            if handle.uses_sharded_strategy:
                _reduce_grad(state, handle)  # the sharded sum waits in _saved_grad_shard, as after the hook
            else:
                _reduce_grad_no_shard(state, handle)
    finally:
        state.training_state, handle._training_state = before


__all__ = ["reduce_left_out", "register_unsharded_views", "track"]
