"""Lightning callbacks of ``lightning_smp``: the per-rank memory savings and communication report."""

from lightning_smp.callbacks.memory import MemorySavingsCallback

__all__ = ["MemorySavingsCallback"]
