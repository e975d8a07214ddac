"""FSDP1's notes for :mod:`lightning_smp.engines.unused`: which original parameters of a flat parameter had a gradient.

FSDP1 reduces a flat parameter whole, so an original parameter that no rank used, beside used ones in its unit, gets
a zero ``.grad`` view. With ``use_orig_params=True`` (Lightning's default) the optimizer steps the original parameters,
and the forward reads each one through a fresh view of the flat parameter: a hook on that view fires exactly when
autograd gives the parameter a gradient. With ``use_orig_params=False`` the forward reads them through such views too,
but the optimizer steps whole flat parameters and no part of one can be left out: a part no rank used is refused
before the step (``Presence(whole=True)``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

from torch.nn import Module

from lightning_smp.engines.unused import Presence

_ATTRIBUTE = "_lightning_smp_presence"
_ROOTS: weakref.WeakSet[Module] = weakref.WeakSet()
_INSTALLED: list[bool] = []


def track(root: Module) -> None:
    """Note, for each handle of ``root`` (an FSDP1 root), which parameters are used (every handle, frozen ones too:
    the bitmap has one byte per parameter, as the planner counts it)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for unit in FullyShardedDataParallel.fsdp_modules(root):
        handle = unit._handle
        if handle is not None and not hasattr(handle, _ATTRIBUTE):
            _track_handle(handle)
    _ROOTS.add(root)
    if not _INSTALLED:
        _note_starts_at_the_roots_pre_backward()
        _INSTALLED.append(True)


def _note_starts_at_the_roots_pre_backward() -> None:
    """The root's pre-backward hook runs first in every backward: after ``zero_grad`` (which Lightning calls between
    the forward and the backward) and before FSDP writes any ``.grad``."""
    from torch.distributed.fsdp import _runtime_utils

    original = _runtime_utils._pre_backward_hook

    @functools.wraps(original)
    def pre_backward_hook(state: Any, module: Any, handle: Any, *args: Any, **kwargs: Any) -> Any:
        if state in _ROOTS:
            for presence in presences(s._handle for s in state._all_fsdp_states if s._handle is not None):
                presence.note_start()
        return original(state, module, handle, *args, **kwargs)

    # FSDP looks the hook up in its module each time it registers it on a forward's outputs
    _runtime_utils._pre_backward_hook = pre_backward_hook


def _track_handle(handle: Any) -> None:
    from torch.distributed.fsdp._flat_param import HandleTrainingState

    flat = handle.flat_param
    if handle._use_orig_params:
        presence = Presence(lambda: list(flat._params or []), lambda: flat._fqns)
    else:  # the optimizer steps the flat parameter itself
        presence = Presence(lambda: [flat] * len(flat._param_infos), lambda: flat._fqns, whole=True)
    original = handle._use_unsharded_views

    @functools.wraps(original)
    def use_unsharded_views(as_params: bool) -> None:
        original(as_params)
        if as_params or handle._training_state != HandleTrainingState.FORWARD:
            return
        # the forward's views: the module computes with these tensors (backward's recomputation reuses them)
        for index, info in enumerate(flat._param_infos):
            view = getattr(info.module, info.param_name, None)
            if view is not None and view.requires_grad:
                view.register_hook(functools.partial(_mark, presence, index))

    handle._use_unsharded_views = use_unsharded_views  # FSDP calls it through the instance
    if handle._use_orig_params and handle.uses_sharded_strategy:
        # Outside its unit's forward an original parameter is this rank's shard of it (a view of the local flat
        # shard), and FSDP assigns its .grad without autograd: a gradient autograd accumulates into it means a loss
        # read the shard (a penalty over self.parameters() in training_step), which the step check refuses
        for index, param in enumerate(flat._params or []):
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(functools.partial(_read_as_shard, presence, index))
    setattr(handle, _ATTRIBUTE, presence)


def _mark(presence: Presence, index: int, grad: Any) -> None:
    presence.mark_used(index)


def _read_as_shard(presence: Presence, index: int, param: Any) -> None:
    presence.mark_read_as_shard(index)


def roots() -> list[Module]:
    """The live roots :func:`track` follows."""
    return list(_ROOTS)


def presences(handles: Iterable[Any]) -> list[Presence]:
    return [getattr(handle, _ATTRIBUTE) for handle in handles if hasattr(handle, _ATTRIBUTE)]
