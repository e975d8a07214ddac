"""Writing a checkpoint: atomically, never over another run's files, each tensor written once.

The run identity (:class:`CheckpointRun`) is state with one owner, the front end (the Trainer strategy), which passes
it to :func:`save` and moves it on when a run resumes from a checkpoint.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_smp.checkpoint.atomic import commit, remove, temporary_name, write_file
from lightning_smp.checkpoint.format import FORMAT_VERSION, META_FILENAME, RUN_KEY
from lightning_smp.checkpoint.safety import plain_checkpoint, unsafe_entry
from lightning_smp.collectives import Collectives
from lightning_smp.degree import Layout
from lightning_smp.errors import CheckpointError, CheckpointPathError, UnsupportedOptionError
from lightning_smp.names import SHARDED, StateDictType

PathLike = str | os.PathLike


class CheckpointRun:
    """The identity of the run that writes checkpoints: a path holding another run's checkpoint is never overwritten.

    The id is made on rank 0 at the first save and shared with every rank; a run resumed from a checkpoint takes
    over the id of the run that wrote it (:meth:`continue_from`), so that it may replace that run's files.
    """

    def __init__(self, run_id: str | None = None) -> None:
        self.run_id = run_id

    def ensure(self, collectives: Collectives) -> str:
        """This run's id, made and shared now if it has none yet. Collective the first time."""
        if self.run_id is None:
            self.run_id = collectives.broadcast(uuid.uuid4().hex)
        return self.run_id

    def continue_from(self, checkpoint: dict[str, Any]) -> None:
        """Continue the run that wrote ``checkpoint`` (a checkpoint dict as loaded)."""
        record = checkpoint.get(RUN_KEY)
        if isinstance(record, dict) and record.get("run_id"):
            self.run_id = record["run_id"]


def run_record(run_id: str, kind: StateDictType, world_size: int, layout: Layout | None) -> dict[str, Any]:
    """This library's record in a checkpoint: format, run id, and the layout that wrote it."""
    record: dict[str, Any] = {"format_version": FORMAT_VERSION, "run_id": run_id, "state_dict_type": kind,
                              "world_size": world_size}
    if layout is not None:
        record.update(hybrid_shard_degree=layout.degree, replicate=layout.replicate, shard=layout.shard,
                      sharding_strategy=layout.sharding_strategy)
    return record


def run_id_of(path: Path) -> str | None:
    """The id of the run that wrote the checkpoint at ``path``; None if it is none of ours or unreadable."""
    try:
        if path.is_dir():
            meta = path / META_FILENAME
            if not meta.is_file():
                return None
            record = torch.load(meta, map_location="cpu", weights_only=True).get(RUN_KEY)
        else:
            record = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get(RUN_KEY)
    except Exception:  # noqa: BLE001 - anything unreadable counts as "not ours"
        return None
    return record.get("run_id") if isinstance(record, dict) else None


def collision(path: Path, run_id: str) -> str | None:
    """Why ``path`` must not be overwritten by run ``run_id``, or None if it is free or this run's own checkpoint."""
    if not os.path.lexists(path):
        return None
    owner = run_id_of(path)
    if owner == run_id:
        return None
    what = f"a checkpoint of another run (run id {owner})" if owner else "something that is not a checkpoint of this run"
    return (
        f"checkpoint path {str(path)!r} already holds {what}; refusing to overwrite it. Fix: save under another"
        " name or dirpath (ModelCheckpoint adds -v1, -v2 ... unless enable_version_counter=False), delete it"
        " yourself, or continue that run with trainer.fit(..., ckpt_path=...)."
    )


def save(checkpoint: dict[str, Any], filepath: PathLike, *, kind: StateDictType, collectives: Collectives,
         run: CheckpointRun, layout: Layout | None = None, storage_options: Any | None = None) -> None:
    """Write ``checkpoint`` (Lightning's ``dump_checkpoint`` layout) to ``filepath`` atomically. Call it on every rank.

    ``kind="sharded"``: ``checkpoint["state_dict"]`` and ``["optimizer_states"]`` hold this rank's shards and go to a
    ``torch.distributed.checkpoint`` folder; ``"full"``: they are full on rank 0, which writes one file.

    Raises:
        UnsupportedOptionError: ``storage_options`` was given (a ``TypeError`` too, as in Lightning's FSDPStrategy).
        CheckpointPathError: ``filepath`` is a folder holding something else than a checkpoint of this run.
        CheckpointError: ``filepath`` holds something else than a checkpoint of this run, the checkpoint holds
            objects that only unpickling code could load, or writing failed on some rank.
    """
    check_storage_options(storage_options)
    rank = collectives.rank
    path = Path(collectives.broadcast(os.fspath(filepath)))
    run_id = run.ensure(collectives)
    checkpoint = plain_checkpoint(checkpoint)  # what is written, and what the check below judges
    # decide on rank 0, fail on every rank alike (and with the same type), before anything is written
    problem, error = None, CheckpointError
    if rank == 0:
        problem = collision(path, run_id)
        if problem is not None and path.is_dir() and not path.is_symlink():
            error = CheckpointPathError
        elif problem is None:
            problem = unsafe_entry({k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")})
    problem, folder = collectives.broadcast((problem, error is CheckpointPathError))
    if problem is not None:
        raise (CheckpointPathError if folder else CheckpointError)(problem)

    checkpoint[RUN_KEY] = run_record(run_id, kind, collectives.world_size, layout)
    tmp = Path(collectives.broadcast(str(temporary_name(path))))

    def write() -> None:
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        collectives.barrier()
        if kind == SHARDED:
            _save_sharded(checkpoint, tmp, rank)
        elif rank == 0:
            write_file(checkpoint, tmp)

    # every rank's files must be complete before the checkpoint becomes visible under its name
    _on_every_rank(collectives, write, path, tmp)
    _on_every_rank(collectives, lambda: commit(tmp, path) if rank == 0 else None, path, tmp)


def check_storage_options(storage_options: Any) -> None:
    """Refuse ``storage_options`` (a ``TypeError`` too, as in Lightning's FSDPStrategy): nothing here writes through
    a ``CheckpointIO``."""
    if storage_options is not None:
        raise UnsupportedOptionError(
            f"storage_options={storage_options!r} is not supported by HybridShardFSDPStrategy.save_checkpoint: it"
            " writes with torch.save / torch.distributed.checkpoint, not with a CheckpointIO. Fix: pass None."
        )


def _on_every_rank(collectives: Collectives, step: Callable[[], Any], path: Path, tmp: Path) -> None:
    """Run ``step`` on every rank; if it failed on any rank (disk full, permissions...), remove the temporary
    files and raise the same error on every rank, instead of leaving the others waiting in the next collective."""
    failure: str | None = None
    try:
        step()
    except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
        failure = f"rank {collectives.rank}: {type(err).__name__}: {err}"
    first = next((f for f in collectives.all_gather(failure) if f is not None), None)
    if first is None:
        return
    if collectives.rank == 0:
        remove(tmp)
    raise CheckpointError(
        f"Saving the checkpoint {str(path)!r} failed on {first}. Nothing was written under that name; a previous"
        " checkpoint there is intact."
    )


def _save_sharded(checkpoint: dict[str, Any], folder: Path, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state: dict[str, Any] = {"model": checkpoint.pop("state_dict")}
    for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{idx}"] = optim_state
    folder.mkdir(parents=True, exist_ok=True)
    # a replicated chunk goes to the lowest rank holding it: replica group 0 writes, the other replicas write no
    # tensor data (an empty file each)
    dcp.save(state, storage_writer=FileSystemWriter(folder, sync_files=True),
             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
             no_dist=not (dist.is_available() and dist.is_initialized()))
    if rank == 0:
        write_file(checkpoint, folder / META_FILENAME)


__all__ = ["CheckpointRun", "check_storage_options", "collision", "run_id_of", "run_record", "save"]
