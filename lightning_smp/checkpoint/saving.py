"""Writing a checkpoint: atomically, never over another run's files, each tensor written once.

The run identity (:class:`CheckpointRun`) is state with one owner, the front end (the Trainer strategy), which passes
it to :func:`save` and moves it on when a run resumes from a checkpoint.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from lightning_smp.checkpoint.atomic import commit, remove, remove_leftovers, temporary_name, write_file
from lightning_smp.checkpoint.background import BackgroundSaver, describe_failure, stage
from lightning_smp.checkpoint.format import FORMAT_VERSION, META_FILENAME, RUN_KEY, tensor_entries
from lightning_smp.checkpoint.safety import plain_checkpoint, unsafe_entry
from lightning_smp.collectives import Collectives
from lightning_smp.degree import Layout
from lightning_smp.engines.chunks import TensorChunks
from lightning_smp.errors import CheckpointError, CheckpointPathError, UnsupportedOptionError
from lightning_smp.names import SHARDED, StateDictType

PathLike = str | os.PathLike


class CheckpointRun:
    """The identity of the run that writes checkpoints: a path holding another run's checkpoint is never overwritten.

    The id is made on rank 0 at the first save and shared with every rank (by :func:`save`); a run resumed from a checkpoint takes
    over the id of the run that wrote it (:meth:`continue_from`), so that it may replace that run's files.
    """

    def __init__(self, run_id: str | None = None) -> None:
        self.run_id = run_id

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
         run: CheckpointRun, layout: Layout | None = None, storage_options: Any | None = None,
         background: BackgroundSaver | None = None, writes_data: bool = True) -> None:
    """Write ``checkpoint`` (Lightning's ``dump_checkpoint`` layout) to ``filepath`` atomically. Call it on every rank.

    ``kind="sharded"``: ``checkpoint["state_dict"]`` and ``["optimizer_states"]`` hold this rank's shards and go to a
    ``torch.distributed.checkpoint`` folder; ``"full"``: they are full on rank 0, which writes one file.

    ``background`` (sharded only): return once the state is staged and let the saver write and commit it (see
    :mod:`~lightning_smp.checkpoint.background`); a save still in flight is waited for first, and its failure raised.
    ``writes_data``: whether this rank's shards are the ones written (the lowest rank of its replica group; see
    :meth:`~lightning_smp.checkpoint.state_dict.ShardedModel.writes_data`): only those ranks stage a copy.

    Raises:
        UnsupportedOptionError: ``storage_options`` was given (a ``TypeError`` too, as in Lightning's FSDPStrategy).
        CheckpointPathError: ``filepath`` is a folder holding something else than a checkpoint of this run.
        CheckpointError: ``filepath`` holds something else than a checkpoint of this run, the checkpoint holds
            objects that only unpickling code could load, or writing failed on some rank.
    """
    check_storage_options(storage_options)
    if background is not None and kind != SHARDED:
        raise UnsupportedOptionError(f"a background save writes sharded checkpoints, not {kind!r} ones")
    if background is not None:
        background.wait()  # one save in flight; its failure is raised here, on every rank
    rank = collectives.rank
    checkpoint = plain_checkpoint(checkpoint)  # what is written, and what the check below judges
    # decide on rank 0 (the path, the run id, any problem, the temporary name) and tell every rank in one collective,
    # so that all fail alike (and with the same type) before anything is written
    decision: tuple[str, str, str | None, bool, str] | None = None
    if rank == 0:
        path = Path(os.fspath(filepath))
        run_id = run.run_id or uuid.uuid4().hex
        problem, folder = collision(path, run_id), False
        if problem is not None:
            folder = path.is_dir() and not path.is_symlink()
        else:
            tensors = ("state_dict", "optimizer_states", *tensor_entries(checkpoint))
            problem = unsafe_entry({k: v for k, v in checkpoint.items() if k not in tensors})
        decision = (str(path), run_id, problem, folder, str(temporary_name(path, owner=run_id)))
    where, run_id, problem, folder, temporary = cast("tuple[str, str, str | None, bool, str]",
                                                     collectives.broadcast(decision))
    path, tmp = Path(where), Path(temporary)
    run.run_id = run_id
    if problem is not None:
        raise (CheckpointPathError if folder else CheckpointError)(problem)
    checkpoint[RUN_KEY] = run_record(run_id, kind, collectives.world_size, layout)

    def prepare() -> None:
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_leftovers(path.parent, run_id, keep=tmp)  # of a save of this run that was killed part way

    if background is not None:
        _submit(checkpoint, path, tmp, collectives, background, writes_data, prepare)
        return

    def write() -> None:
        prepare()
        collectives.barrier()  # the folder exists before any rank writes into it
        if kind == SHARDED:
            _save_sharded(checkpoint, tmp, rank)
        elif rank == 0:
            write_file(checkpoint, tmp)

    # every rank's files must be complete before the checkpoint becomes visible under its name
    _on_every_rank(collectives, write, path, tmp)
    _on_every_rank(collectives, lambda: commit(tmp, path) if rank == 0 else None, path, tmp)


def _submit(checkpoint: dict[str, Any], path: Path, tmp: Path, collectives: Collectives,
            background: BackgroundSaver, writes_data: bool, prepare: Callable[[], None]) -> None:
    """Stage what this rank writes (on every rank alike: a failure raises everywhere), then hand it to ``background``.

    A rank whose shards another replica writes passes its live state: DCP plans from its shapes only and removes its
    items (:class:`_WritesNothing` checks that it does). Rank 0 ``prepare``s the folder meanwhile; the agreement that
    ends this step also keeps every writing thread from starting before that.
    """
    rank = collectives.rank
    shards = _dcp_state(checkpoint)
    staged: dict[str, Any] = {}

    def copy_off() -> None:
        prepare()
        nbytes = 0
        if writes_data:
            staged["shards"], nbytes = stage(shards, background.buffers)
        else:
            staged["shards"] = shards
        if rank == 0:
            staged["meta"], more = stage(checkpoint)
            nbytes += more
        staged["bytes"] = nbytes

    _on_every_rank(collectives, copy_off, path, tmp)

    def write() -> None:
        _write_sharded(staged["shards"], tmp, writes_data, staged.get("meta"), background.group)

    background.submit(path, write, lambda: commit(tmp, path), lambda: remove(tmp), staged_bytes=staged["bytes"],
                      rank=rank)


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
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - re-raised below, on every rank (DCP's is a
        # BaseException)
        failure = describe_failure(err, collectives.rank)
    first = next((f for f in collectives.all_gather(failure) if f is not None), None)
    if first is None:
        return
    if collectives.rank == 0:
        remove(tmp)
    raise CheckpointError(
        f"Saving the checkpoint {str(path)!r} failed on {first}. Nothing was written under that name; a previous"
        " checkpoint there is intact."
    )


def _dcp_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What DCP writes (taken out of ``checkpoint``, which keeps what ``meta.pt`` holds): the model, the optimizers
    and the other entries of sharded state (:func:`~lightning_smp.checkpoint.format.tensor_entries`)."""
    state: dict[str, Any] = {"model": checkpoint.pop("state_dict")}
    for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{idx}"] = optim_state
    for key in tensor_entries(checkpoint):
        state[key] = checkpoint.pop(key)
    return state


def _save_sharded(checkpoint: dict[str, Any], folder: Path, rank: int) -> None:
    state = _dcp_state(checkpoint)
    _write_sharded(state, folder, True, checkpoint if rank == 0 else None, None)


def _write_sharded(state: dict[str, Any], folder: Path, writes_data: bool, meta: dict[str, Any] | None,
                   group: Any) -> None:
    """DCP's files of ``state`` into ``folder`` over ``group`` (``None``: the world), then ``meta`` (rank 0's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    folder.mkdir(parents=True, exist_ok=True)
    # a replicated chunk goes to the lowest rank holding it: replica group 0 writes, the other replicas write no
    # tensor data (an empty file each)
    distributed = dist.is_available() and dist.is_initialized()
    dcp.save(state, storage_writer=FileSystemWriter(folder, sync_files=True),
             planner=_WritesNothing(writes_data), process_group=group, no_dist=not distributed)
    if meta is not None:
        write_file(meta, folder / META_FILENAME)


class _WritesNothing(DefaultSavePlanner):
    """DCP's planner, deduplicating each replicated chunk to the lowest rank holding it; on a rank that staged nothing
    (``writes_data=False``) it refuses a final plan that would still read its live training tensors."""

    def __init__(self, writes_data: bool) -> None:
        super().__init__(dedup_save_to_lowest_rank=True)
        self.writes_data = writes_data

    def finish_plan(self, new_plan: Any) -> Any:
        if not self.writes_data and new_plan.items:
            keys = ", ".join(sorted({item.index.fqn for item in new_plan.items})[:3])
            raise CheckpointError(
                f"this rank was to write {len(new_plan.items)} item(s) ({keys}, ...) of another replica's shards, but"
                " only the lowest rank of each replica group stages a copy; refusing to write live training tensors"
            )
        return super().finish_plan(new_plan)

    def lookup_object(self, index: Any) -> Any:
        # an engine's own pieces of a tensor (TensorChunks): the piece at the chunk's offsets
        found = self.state_dict.get(index.fqn)
        if isinstance(found, TensorChunks):
            return found.tensor_at(index.offset)
        return super().lookup_object(index)


__all__ = ["CheckpointRun", "check_storage_options", "collision", "run_id_of", "run_record", "save"]
