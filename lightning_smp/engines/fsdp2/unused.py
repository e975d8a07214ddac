"""FSDP2's notes for :mod:`lightning_smp.engines.unused`: which parameters of a parameter group had a gradient.

Every unit this engine shards reduce-scatters all its parameters that require a gradient, zeros for those a
micro-batch did not use (``set_reduce_scatter_unused_params``, so that the deferred all-reduce keeps one layout for a
window); the post-backward of each group is where autograd's gradient is still visible, before it is replaced.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from lightning_smp.engines.unused import Presence

_ATTRIBUTE = "_lightning_smp_presence"


def track(group: Any) -> None:
    """Note, at each post-backward of ``group`` (an ``FSDPParamGroup``), which of its parameters hold a gradient."""
    if hasattr(group, _ATTRIBUTE):
        return
    presence = Presence(lambda: [fsdp_param.sharded_param for fsdp_param in group.fsdp_params],
                        lambda: [fsdp_param._param_fqn or fsdp_param._module_info.param_name
                                 for fsdp_param in group.fsdp_params])
    original = group.post_backward

    @functools.wraps(original)
    def post_backward(*args: Any) -> Any:
        presence.note_start()  # the deferred all-reduce writes the sharded .grad only at the window's end
        for index, fsdp_param in enumerate(group.fsdp_params):
            if hasattr(fsdp_param, "_unsharded_param") and (
                    fsdp_param.unsharded_accumulated_grad is not None or fsdp_param.unsharded_param.grad is not None):
                presence.mark_used(index)
        return original(*args)

    group.post_backward = post_backward  # torch calls it through the instance (hook and final callback alike)
    setattr(group, _ATTRIBUTE, presence)


def presences(groups: Iterable[Any]) -> list[Presence]:
    return [getattr(group, _ATTRIBUTE) for group in groups if hasattr(group, _ATTRIBUTE)]
