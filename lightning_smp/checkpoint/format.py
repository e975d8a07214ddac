"""What a checkpoint looks like on disk, and telling the two formats apart."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_smp.checkpoint.atomic import is_temporary
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
#: Where a checkpoint written by Fabric records which of the user's state keys held the module and the optimizers.
FABRIC_KEYS = "lightning_smp_fabric"
#: Where a checkpoint of fault-tolerant replica groups records torchft's step (a run without them ignores it).
REPLICA_GROUPS_KEY = "lightning_smp_replica_groups"
#: Where a checkpoint of semi-synchronous replica groups (``replica_sync``) records the outer loop's step count; the
#: outer optimizer's state and the inner optimizers' states of the groups after the first are entries named
#: ``<this>_outer`` and ``<this>_group<g>_<index>`` (:func:`tensor_entries`: written by DCP with the model's).
REPLICA_SYNC_KEY = "lightning_smp_replica_sync"
#: The Trainer's keys of the model and the optimizer states (Lightning's ``dump_checkpoint`` layout).
MODEL_KEY, OPTIMIZERS_KEY = "state_dict", "optimizer_states"


def tensor_entries(checkpoint: dict[str, Any]) -> list[str]:
    """The keys of ``checkpoint`` beside the model's and the optimizers' that hold sharded state (written by DCP in a
    sharded checkpoint, and never judged as plain values): ``replica_sync``'s outer and per-group optimizer states."""
    return [key for key in checkpoint if key.startswith(f"{REPLICA_SYNC_KEY}_")]


def checkpoint_kind(path: Path) -> StateDictType:
    """``"sharded"`` for a DCP folder, ``"full"`` for a file; raises :class:`CheckpointError` for anything else,
    including a save's temporary (uncommitted, possibly half written, whatever files it holds)."""
    if is_temporary(path):
        raise CheckpointError(
            f"ckpt_path={str(path)!r} is the temporary of a save that was never committed (it may be half written)."
            " Fix: pass the checkpoint under its own name; the run that left this removes it at its next save."
        )
    if path.is_dir() and ((path / DCP_METADATA).is_file() or (path / META_FILENAME).is_file()):
        return SHARDED
    if path.is_file():
        return FULL
    raise CheckpointError(
        f"ckpt_path={str(path)!r} is not a checkpoint: expected a file (full checkpoint) or a folder with a"
        " torch.distributed.checkpoint '.metadata' (sharded checkpoint). Fix: pass the path ModelCheckpoint or"
        " trainer.save_checkpoint wrote."
    )


def fabric_layout(checkpoint: dict[str, Any], module_key: str, optimizer_keys: Sequence[str],
                  drop: Sequence[str] = ()) -> dict[str, Any]:
    """A full checkpoint in the layout Fabric's ``FSDPStrategy`` writes: the model and each optimizer under the keys
    of the state the user saved (``{"model": ..., "optimizer": ...}``), everything else but ``drop`` as it is; the
    keys are recorded under :data:`FABRIC_KEYS` so that :func:`trainer_layout` can map it back."""
    out = {k: v for k, v in checkpoint.items() if k not in (MODEL_KEY, OPTIMIZERS_KEY, *drop)}
    out[module_key] = checkpoint.get(MODEL_KEY, {})
    out.update(zip(optimizer_keys, checkpoint.get(OPTIMIZERS_KEY, [])))
    out[FABRIC_KEYS] = {"module": module_key, "optimizers": list(optimizer_keys)}
    return out


def trainer_layout(checkpoint: dict[str, Any], module_key: str | None = None,
                   optimizer_keys: Sequence[str] = ()) -> dict[str, Any]:
    """A full checkpoint in the Trainer's layout (``state_dict``, ``optimizer_states``), whichever front end wrote
    it: a Fabric checkpoint is mapped through its :data:`FABRIC_KEYS` record, else through ``module_key`` and
    ``optimizer_keys`` (a checkpoint written by Lightning's own Fabric ``FSDPStrategy``) and given the keys the
    Trainer needs to resume from it; a Trainer one is returned as it is."""
    if MODEL_KEY in checkpoint:
        return checkpoint
    record = checkpoint.get(FABRIC_KEYS)
    if isinstance(record, dict):
        module_key, optimizer_keys = record.get("module"), record.get("optimizers", [])
    if module_key is None or module_key not in checkpoint:
        return checkpoint
    out = dict(checkpoint)
    out[MODEL_KEY] = out.pop(module_key)
    present = [k for k in optimizer_keys if k in out]
    if present:
        out[OPTIMIZERS_KEY] = [out.pop(k) for k in present]
    # what the Trainer needs to resume from a Fabric checkpoint (its loops then start from zero)
    out.setdefault("lr_schedulers", [])
    out.setdefault("pytorch-lightning_version", lightning_version())
    return out


def lightning_version() -> str:
    import lightning

    return lightning.__version__


__all__ = [
    "DCP_METADATA",
    "FABRIC_KEYS",
    "FORMAT_VERSION",
    "META_FILENAME",
    "MODEL_KEY",
    "OPTIMIZERS_KEY",
    "REPLICA_GROUPS_KEY",
    "RUN_KEY",
    "checkpoint_kind",
    "fabric_layout",
    "lightning_version",
    "trainer_layout",
]
