"""Fault-tolerant replica groups (``fault_tolerance=``, on torchft): each replica group of ``hybrid_shard_degree``
ranks is its own job, the groups meet through a lighthouse (:mod:`.lighthouse`), the gradient reduction across
groups goes through torchft's ``Manager`` (:mod:`.session`), a step commits in every group or in none, and a group that
(re)starts while others train copies a live peer's state (:mod:`.state`, :mod:`.trainer_state`). See
``docs/fault-tolerance.md``."""

from lightning_smp.config.fault_tolerance import FaultTolerance
from lightning_smp.fault_tolerance.lighthouse import Lighthouse, start_lighthouse
from lightning_smp.fault_tolerance.session import ReplicaGroups

__all__ = ["FaultTolerance", "Lighthouse", "ReplicaGroups", "start_lighthouse"]
