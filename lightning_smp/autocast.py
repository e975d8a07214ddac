"""Autocast for a Lightning precision string on any device type: what the precision plugins of both front ends, the
planner's activation trace and the calibration all run their forward passes in."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch


def autocast_context(precision: str, device_type: str) -> AbstractContextManager | None:
    """``torch.autocast`` on ``device_type`` for a ``*-mixed`` precision (Lightning's FSDP plugins hard-code
    ``"cuda"``), else ``None``."""
    if "mixed" not in precision:
        return None
    return torch.autocast(device_type, dtype=torch.bfloat16 if precision == "bf16-mixed" else torch.float16)


__all__ = ["autocast_context"]
