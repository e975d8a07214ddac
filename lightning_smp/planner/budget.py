"""The memory budget of one rank: parsed from what a user writes (``40GB``, ``400MiB``, ``12000000000``), or read
from the device.

The budget is what the training itself may use on one device (model state, transients, activations, the planner's
headroom), not the process's fixed runtime overhead (a CUDA context, imported libraries). The default is the device's
free memory (``mem_get_info`` of the root device's backend), on the CPU the available RAM divided by the ranks of
the node: the memory that is really there when the plan is made.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lightning_smp.errors import HybridShardConfigError

#: Units of a budget string, case-insensitive: decimal (kB, MB, GB, TB, as vendors quote device memory) and binary.
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any, parameter: str = "memory_budget") -> int:
    """``value`` in bytes: an int, or a string such as ``"40GB"``, ``"400MB"``, ``"1.5GiB"`` or ``"123"``.

    Raises:
        HybridShardConfigError: not a positive amount with a known unit; the message names ``parameter``.
    """
    fix = (f"Fix: pass {parameter} as a whole number of bytes or a string such as '40GB', '400MB' or '1.5GiB'"
           f" (units: {', '.join(u for u in UNITS if u)}).")
    if isinstance(value, bool):
        raise HybridShardConfigError(f"{parameter}={value!r} is not an amount of memory. {fix}")
    if isinstance(value, float) and value.is_integer():  # YAML reads 4.0e10 as a float
        value = int(value)
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and (match := _PATTERN.match(value)) and match.group(2).lower() in UNITS:
        number = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    else:
        raise HybridShardConfigError(f"{parameter}={value!r} is not an amount of memory. {fix}")
    if number <= 0:
        raise HybridShardConfigError(f"{parameter}={value!r} is not positive. {fix}")
    return number


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


__all__ = ["UNITS", "default_budget", "parse_bytes"]
