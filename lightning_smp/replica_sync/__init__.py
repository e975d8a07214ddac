"""Semi-synchronous replica groups (DiLoCo): each replica group trains on its own and the groups meet every ``every``
steps, averaging the change of their parameters, which an outer optimizer applies (:mod:`.outer`)."""

from lightning_smp.replica_sync.outer import BUCKET_BYTES, OuterSync, SyncReport, fragment_sizes

__all__ = ["BUCKET_BYTES", "OuterSync", "SyncReport", "fragment_sizes"]
