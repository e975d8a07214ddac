"""Lightning callbacks of ``lightning_smp``: the per-rank memory savings and communication report, and what
fault-tolerant replica groups did at each step."""

from lightning_smp.callbacks.fault_tolerance import ReplicaGroupMetrics
from lightning_smp.callbacks.memory import MemorySavingsCallback

__all__ = ["MemorySavingsCallback", "ReplicaGroupMetrics"]
