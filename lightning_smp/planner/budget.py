"""The memory budget of one rank read from the device (what a user writes, ``40GB``, is parsed by
:func:`lightning_smp.sizes.parse_bytes`).

The budget is what the training itself may use on one device (model state, transients, activations, the planner's
headroom), not the process's fixed runtime overhead (a CUDA context, imported libraries). The default is the device's
free memory (``mem_get_info`` of the root device's backend), on the CPU the available RAM divided by the ranks of
the node: the memory that is really there when the plan is made.
"""

from __future__ import annotations

import torch

from lightning_smp.errors import HybridShardConfigError


def default_budget(device: torch.device, local_ranks: int) -> int:
    """The free memory of ``device`` (an accelerator), or on the CPU the available RAM shared by ``local_ranks``."""
    if device.type != "cpu":
        backend = getattr(torch, device.type, None)
        mem_get_info = getattr(backend, "mem_get_info", None)
        if mem_get_info is None:
            raise HybridShardConfigError(
                f"memory_budget is not set and torch.{device.type} cannot report its free memory. Fix: pass"
                " memory_budget (e.g. '40GB') with hybrid_shard_degree='auto'."
            )
        return int(mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available) // max(1, local_ranks)


__all__ = ["default_budget"]
