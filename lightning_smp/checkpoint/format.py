"""What a checkpoint looks like on disk, and telling the two formats apart."""

from __future__ import annotations

from pathlib import Path

from lightning_smp.errors import CheckpointError
from lightning_smp.names import FULL, SHARDED, StateDictType

#: Name of the file with everything but model and optimizer tensors inside a sharded folder (Lightning's name, so
#: that Lightning's consolidation utility and ``_is_sharded_checkpoint`` recognise our folders).
META_FILENAME = "meta.pt"
#: Key of this library's own record inside every checkpoint dict (run id, format, the layout that wrote it).
RUN_KEY = "lightning_smp"
FORMAT_VERSION = 1
#: DCP's metadata file inside a sharded folder.
DCP_METADATA = ".metadata"


def checkpoint_kind(path: Path) -> StateDictType:
    """``"sharded"`` for a DCP folder, ``"full"`` for a file; raises :class:`CheckpointError` for anything else."""
    if path.is_dir() and ((path / DCP_METADATA).is_file() or (path / META_FILENAME).is_file()):
        return SHARDED
    if path.is_file():
        return FULL
    raise CheckpointError(
        f"ckpt_path={str(path)!r} is not a checkpoint: expected a file (full checkpoint) or a folder with a"
        " torch.distributed.checkpoint '.metadata' (sharded checkpoint). Fix: pass the path ModelCheckpoint or"
        " trainer.save_checkpoint wrote."
    )


__all__ = ["DCP_METADATA", "FORMAT_VERSION", "META_FILENAME", "RUN_KEY", "checkpoint_kind"]
