"""Amounts of memory as people write them: ``40GB``, ``400MiB``, ``12000000000`` (the ``memory_budget`` option, the
planner's ``budget_bytes``)."""

from __future__ import annotations

import re
from typing import Any

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


__all__ = ["UNITS", "parse_bytes"]
