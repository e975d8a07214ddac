"""``async_save=True``: sharded checkpoints written in the background, with every guarantee of a blocking save.

Real 4-rank runs (fork launcher, gloo), both engines, both front ends. Writes are slowed down where a test needs a
save to be in flight (:func:`slow_writes`), so that an ordering mistake shows as a wrong order, not as a race.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from lightning_smp import CheckpointError, HybridShardConfigError, HybridShardFSDPStrategy, MemorySavingsCallback
from lightning_smp import checkpoint as ckpt
from lightning_smp.checkpoint import META_FILENAME, atomic
from lightning_smp.checkpoint.atomic import is_temporary
from lightning_smp.engines.chunks import TensorChunks
from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy
from tests.checkpoint_runs import CkptModel, assert_same_state, probe, run
from tests.helpers import (
    BACKENDS,
    FSDP_VERSIONS,
    GLOO_TIMEOUT,
    RankRecorder,
    accelerator_for,
    cpu_trainer,
    kill_when_ready,
    make_loader,
    process_group_backend_for,
    require_devices,
)

WORLD, DEGREE = 4, 2  # replica groups {0, 2} and {1, 3}: ranks 0 and 1 write, 2 and 3 hold the same shards


def slow_writes(monkeypatch: pytest.MonkeyPatch, seconds: float, fail_on: tuple[int, int] | None = None) -> None:
    """Make every background write take ``seconds`` longer (inherited by the forked ranks); with ``fail_on=(rank,
    n)``, that rank's ``n``-th background write raises instead."""
    real = FileSystemWriter.write_data
    count = {"n": 0}

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            count["n"] += 1
            if fail_on is not None and (torch.distributed.get_rank(), count["n"]) == fail_on:
                raise OSError(28, "No space left on device")
            time.sleep(seconds)
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)


def committed(path: Path) -> bool:
    """Whether ``path`` is a whole sharded checkpoint: DCP's metadata, every rank's file and ours."""
    return (path / ".metadata").is_file() and (path / META_FILENAME).is_file() and all(
        (path / f"__{rank}_0.distcp").is_file() for rank in range(WORLD))


class StagingProbe(Callback):
    """Each rank records how much host memory its staged copies took."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        # what a save of this rank holds: its shards of the model and of the optimizer state (collective)
        shards = [strategy.lightning_module_state_dict(), *[strategy.optimizer_state(o) for o in trainer.optimizers]]
        record = {"staged": strategy.checkpoint_staging_bytes, "shard_bytes": _local_bytes(shards)}
        (self.folder / f"staging_rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _local_bytes(obj: Any) -> int:
    if isinstance(obj, TensorChunks):  # the engine's own pieces (FSDP1: flat-shard ranges, gathered from nothing)
        return sum(data.numel() * data.element_size() for _, data in obj.pieces)
    if hasattr(obj, "to_local"):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_local_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_local_bytes(v) for v in obj)
    return 0


# ------------------------------------------------------------------------------------------------------ equality


@pytest.mark.parametrize("version", FSDP_VERSIONS)
@pytest.mark.parametrize("backend", BACKENDS)  # the timeout comes with the backend
def test_background_checkpoints_equal_blocking_ones(tmp_path: Path, backend: str, version: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step's checkpoint, written while the next steps change the weights, equals the blocking one bitwise;
    only the lowest rank of each replica group stages a copy, of its shards and their optimizer state (on the GPU:
    into pinned host memory)."""
    require_devices(backend, WORLD)
    slow_writes(monkeypatch, 0.2)
    names = {}
    for background in (False, True):
        folder = tmp_path / f"async_{background}"
        callback = ModelCheckpoint(dirpath=folder / "ckpts", save_top_k=-1, every_n_train_steps=1)
        report = (MemorySavingsCallback(),) if background else ()
        run(folder, WORLD, DEGREE, tag="run", max_steps=4, callbacks=(callback, StagingProbe(folder), *report),
            accelerator=accelerator_for(backend),
            strategy_kwargs={"async_save": background, "fsdp_version": version,
                             "process_group_backend": process_group_backend_for(backend)})
        names[background] = sorted(p.name for p in (folder / "ckpts").iterdir())
    assert names[True] == names[False] == [f"epoch=0-step={s}.ckpt" for s in range(1, 5)]
    for name in names[True]:
        blocking = ckpt.read_full(tmp_path / "async_False" / "ckpts" / name)
        background = ckpt.read_full(tmp_path / "async_True" / "ckpts" / name)
        assert_same_checkpoint(background, blocking)
    # training itself is unchanged
    assert_same_state(probe(tmp_path / "async_True", "run", "end"), probe(tmp_path / "async_False", "run", "end"))
    # FSDP1's background saves describe each rank's flat-shard range as it is (nothing gathered): the first layer's
    # weight (33 x 16, 528 elements in two ranges of 350 and 178) is four rectangles, not torch's two row blocks
    layout = {background: _chunks_of(tmp_path / f"async_{background}" / "ckpts" / names[True][-1], "model.net.0.weight")
              for background in (False, True)}
    assert layout[False] == [((0, 0), (17, 16)), ((17, 0), (16, 16))]
    assert layout[True] == ([((0, 0), (21, 16)), ((21, 0), (1, 14)), ((21, 14), (1, 2)), ((22, 0), (11, 16))]
                            if version == 1 else layout[False])
    staging = [json.loads((tmp_path / "async_True" / f"staging_rank{r}.json").read_text()) for r in range(WORLD)]
    assert [s["staged"] for s in staging[1:]] == [staging[1]["shard_bytes"], 0, 0]  # its shards, exactly
    assert staging[0]["staged"] >= staging[0]["shard_bytes"] > 0  # and rank 0 the rest (meta.pt's tensors)
    # the memory report says the same, per rank
    reports = json.loads((tmp_path / "async_True" / "memory_report.json").read_text())["reports"]
    assert [r["checkpoint_staging_bytes"] for r in reports["fit_end"]] == [s["staged"] for s in staging]


def _chunks_of(folder: Path, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    from lightning_smp.checkpoint.safety import SafeFileSystemReader

    chunks = SafeFileSystemReader(folder).read_metadata().state_dict_metadata[key].chunks
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks)


def assert_same_checkpoint(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    for key in ("epoch", "global_step", "loops"):
        assert actual[key] == expected[key], key
    assert list(actual["state_dict"]) == list(expected["state_dict"])
    for key, value in expected["state_dict"].items():
        assert torch.equal(actual["state_dict"][key], value), key
    for mine, theirs in zip(actual["optimizer_states"], expected["optimizer_states"], strict=True):
        assert mine["param_groups"] == theirs["param_groups"]
        assert sorted(mine["state"]) == sorted(theirs["state"])
        for idx, state in theirs["state"].items():
            for name, value in state.items():
                assert torch.equal(torch.as_tensor(mine["state"][idx][name]), torch.as_tensor(value)), (idx, name)


def _fabric_saves(fabric: L.Fabric, folder: str) -> dict[str, Any]:
    """Three steps, a save after each (each written while the next step runs, the last one as the loop ends); the
    full state after each step."""
    from tests.fabric_loops import fabric_state, make_net, rank_batches

    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    states = []
    for step, (x, y) in enumerate(rank_batches(fabric)[:3]):
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        fabric.save(Path(folder) / f"step{step}", {"model": model, "optimizer": optimizer, "step": step})
        states.append(fabric_state(fabric, model, optimizer))
    # no wait_for_checkpoint(): the last save is still being written as the loop returns, and the rank waits for it
    assert fabric.strategy.checkpoint_in_flight
    return {"states": states, "staged": fabric.strategy.checkpoint_staging_bytes,
            "described": dict(fabric.strategy._background.local_state.verdicts)}


def _fabric_loads(fabric: L.Fabric, path: str) -> dict[str, Any]:
    from tests.fabric_loops import load_fabric_state

    return load_fabric_state(fabric, path)


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_fabric_background_saves_hold_the_state_at_the_call(tmp_path: Path, version: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each save holds the state at its call although the next steps run while it is written; it loads under the
    other engine at another degree (one unit per layer: several flat parameters under FSDP1)."""
    slow_writes(monkeypatch, 0.2)
    strategy = FabricStrategy(hybrid_shard_degree=DEGREE, fsdp_version=version, async_save=True, start_method="fork",
                              auto_wrap_policy={torch.nn.Linear})
    saved = L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD).launch(_fabric_saves, str(tmp_path))
    assert saved["staged"] > 0  # rank 0 writes
    # FSDP1 described its flat shards itself (checked equal to torch's state dicts at the first save); FSDP2's own
    # state dicts are its shards already
    assert saved["described"] == {"model": version == 1, "optimizer_0": version == 1}
    for step in range(3):
        path = tmp_path / f"step{step}"
        assert committed(path)
        other = FabricStrategy(hybrid_shard_degree=4, fsdp_version=3 - version, start_method="fork")
        loaded = L.Fabric(strategy=other, accelerator="cpu", devices=WORLD).launch(_fabric_loads, str(path))
        assert loaded["step"] == step
        assert loaded["weights"] == saved["states"][step]["weights"]
        assert loaded["optimizer"] == saved["states"][step]["optimizer"]


# ---------------------------------------------------------------------------------------- side effects and readers


class StepMetric(CkptModel):
    """Logs the step as a metric that grows: each new top-k checkpoint replaces the oldest."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("progress", float(self.global_step), sync_dist=True)
        return loss


class RecordingLogger(Logger):
    """Records, at each ``after_save_checkpoint``, whether the checkpoint it is told about is committed."""

    def __init__(self, events: Path) -> None:
        super().__init__()
        self.events = events

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        path = Path(checkpoint_callback._last_checkpoint_saved)
        _record(self.events, "logger", path.name, committed(path))


def _record(events: Path, kind: str, name: str, ok: bool, **extra: Any) -> None:
    with open(events, "a") as f:
        f.write(json.dumps({"kind": kind, "name": name, "ok": ok, **extra}) + "\n")


def _watch(folder: Path, stop: threading.Event, seen: list[str], bad: list[str]) -> None:
    """A reader polling the checkpoint folder: every name it sees must be a whole checkpoint."""
    while not stop.is_set():
        entries = list(folder.iterdir()) if folder.is_dir() else []
        for entry in entries:
            if entry.name.startswith("."):
                continue  # a temporary: never under a checkpoint's name
            target = entry
            if entry.is_symlink():
                try:
                    target = entry.parent / os.readlink(entry)
                except OSError:
                    continue  # re-linked while we looked (Lightning removes the link, then makes the new one)
            if not committed(target):
                time.sleep(0.05)
                if os.path.lexists(target):  # (not merely removed while we looked)
                    bad.append(entry.name)
            elif entry.name not in seen:
                seen.append(entry.name)
        time.sleep(0.002)


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize(("version", "save_last"), [(1, True), (2, "link")], ids=["fsdp1-copy", "fsdp2-link"])
def test_links_removals_and_loggers_wait_for_the_commit(tmp_path: Path, version: int, save_last: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    slow_writes(monkeypatch, 0.3)
    ckpts, events = tmp_path / "ckpts", tmp_path / "events.jsonl"
    real_remove, real_symlink = atomic.remove_atomically, os.symlink

    def remove_checkpoint(path: Path) -> None:
        names = [p.name for p in ckpts.iterdir() if not p.name.startswith(".") and p.name.startswith("epoch")]
        _record(events, "remove", path.name, path.name in names, top_k_present=len(names))
        real_remove(path)

    def symlink(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        _record(events, "link", Path(src).name, committed(Path(dst).parent / src))
        real_symlink(src, dst, *args, **kwargs)

    monkeypatch.setattr("lightning_smp.strategy.remove_atomically", remove_checkpoint)  # what the strategy calls
    monkeypatch.setattr(os, "symlink", symlink)
    stop, seen, bad = threading.Event(), [], []
    watcher = threading.Thread(target=_watch, args=(ckpts, stop, seen, bad), daemon=True)
    watcher.start()
    try:
        callback = ModelCheckpoint(dirpath=ckpts, monitor="progress", mode="max", save_top_k=2,
                                   every_n_train_steps=1, save_last=save_last)
        torch.manual_seed(0)
        run(tmp_path, WORLD, DEGREE, tag="order", max_steps=5, callbacks=(callback,), model=StepMetric(),
            logger=RecordingLogger(events), strategy_kwargs={"async_save": True, "fsdp_version": version})
    finally:
        stop.set()
        watcher.join(10)
    assert not bad, f"a reader saw a partial checkpoint under its name: {bad}"
    assert "last.ckpt" in seen and "epoch=1-step=5.ckpt" in seen  # (4 steps an epoch on 4 ranks)
    recorded = [json.loads(line) for line in events.read_text().splitlines()]
    removals = [e for e in recorded if e["kind"] == "remove"]
    # steps 3, 4, 5 each replaced the oldest of the two kept: removed only once the replacement was committed
    assert [e["name"] for e in removals] == [f"epoch=0-step={s}.ckpt" for s in (1, 2, 3)]
    assert all(e["ok"] and e["top_k_present"] == 3 for e in removals), removals
    loggers = [e for e in recorded if e["kind"] == "logger"]
    assert loggers and all(e["ok"] for e in loggers), loggers
    links = [e for e in recorded if e["kind"] == "link"]
    assert all(e["ok"] for e in links), links
    assert (len(links) == 5) == (save_last == "link")
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=1-step=5.ckpt", "last.ckpt"]
    last = ckpt.read_full(ckpts / "last.ckpt")
    assert last["global_step"] == 5


def test_a_removed_checkpoint_is_never_seen_half_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint's name is gone before the first of its files is deleted; what is left under a hidden name is
    gone afterwards; a path that does not exist is no error."""
    folder, link = tmp_path / "epoch=0-step=2.ckpt", tmp_path / "last.ckpt"
    folder.mkdir()
    for name in (".metadata", META_FILENAME, "__0_0.distcp", "__1_0.distcp"):
        (folder / name).write_bytes(b"shard")
    full = tmp_path / "epoch=0-step=3.ckpt"
    full.write_bytes(b"full")
    link.symlink_to(full.name)
    real_remove = atomic.remove
    seen: list[tuple[str, list[str]]] = []

    def remove(path: Path) -> None:  # the deletion, as a reader polling the folder would see it at that moment
        seen.append((path.name, sorted(os.listdir(tmp_path))))
        real_remove(path)

    monkeypatch.setattr(atomic, "remove", remove)
    for path in (folder, link, full):  # a sharded folder, a link, a full file
        seen.clear()
        before = sorted(os.listdir(tmp_path))
        atomic.remove_atomically(path)
        [(deleted, listing)] = seen
        assert deleted.startswith(f".{path.name}.removing-") and is_temporary(tmp_path / deleted)
        assert listing == sorted([*(n for n in before if n != path.name), deleted])  # only the name changed
        assert sorted(os.listdir(tmp_path)) == [n for n in before if n != path.name]  # then it went, whole
    assert not os.listdir(tmp_path)  # (the link went, not what it pointed to: that went by its own name)
    seen.clear()
    atomic.remove_atomically(folder)  # already gone, as Lightning's removal allows
    atomic.remove_atomically(tmp_path / "never-there" / "x.ckpt")
    assert not seen


def _checkpoint_name(entry: str) -> str:
    """The checkpoint a top-level entry of the folder is, or was before a removal renamed it."""
    return entry[1:].split(".removing-")[0] if entry.startswith(".") else entry


def record_deletions(monkeypatch: pytest.MonkeyPatch, folder: Path, events: Path) -> None:
    """Each file or folder deleted inside ``folder`` (in the forked ranks too) is recorded at the moment it goes:
    what it was, and what a reader listing ``folder`` then found: each ``*.ckpt`` name and whether it was whole (a
    sharded folder with all its files, a full file that loads). Deletions under a hidden name go unchecked."""
    root = os.path.realpath(folder)

    def whole(path: Path) -> bool:
        if path.is_dir():
            return committed(path)
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - a file that does not load is not a whole checkpoint
            return False
        return True

    def watched(real: Any) -> Any:
        def delete(path: Any, *, dir_fd: int | None = None) -> None:
            name = os.fsdecode(path)
            # shutil.rmtree deletes a folder's entries relative to its open descriptor
            parent = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.path.dirname(
                os.path.abspath(name))
            where = os.path.join(os.path.realpath(parent), os.path.basename(name))
            if where.startswith(root + os.sep):
                names = sorted(n for n in os.listdir(root) if n.endswith(".ckpt") and not n.startswith("."))
                top = os.path.relpath(where, root).split(os.sep)[0]
                with open(events, "a") as f:
                    f.write(json.dumps({"top": top, "listing": {n: whole(folder / n) for n in names}}) + "\n")
            real(path, dir_fd=dir_fd)

        return delete

    for name in ("unlink", "remove", "rmdir"):
        monkeypatch.setattr(os, name, watched(getattr(os, name)))


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize(("background", "kind"), [(True, "sharded"), (False, "sharded"), (False, "full")],
                         ids=["background-sharded", "blocking-sharded", "blocking-full"])
def test_a_replaced_checkpoint_disappears_whole(tmp_path: Path, background: bool, kind: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelCheckpoint(save_top_k=1) removes the previous checkpoint at each step: at every moment a file of one
    goes, the folder shows only whole checkpoints, and no longer the one being removed."""
    ckpts, events = tmp_path / "ckpts", tmp_path / "deletions.jsonl"
    record_deletions(monkeypatch, ckpts, events)
    callback = ModelCheckpoint(dirpath=ckpts, save_top_k=1, every_n_train_steps=1)
    run(tmp_path, WORLD, DEGREE, tag="replace", kind=kind, max_steps=3, callbacks=(callback,),
        strategy_kwargs={"async_save": background})
    recorded = [json.loads(line) for line in events.read_text().splitlines()]
    removed = sorted({_checkpoint_name(e["top"]) for e in recorded})
    assert removed == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]  # each replaced, once the next was saved
    for event in recorded:
        assert not event["top"].startswith("epoch"), f"deleted under its own name: {event}"
        assert _checkpoint_name(event["top"]) not in event["listing"], event
        assert event["listing"] and all(event["listing"].values()), f"a reader saw a partial checkpoint: {event}"
    assert os.listdir(ckpts) == ["epoch=0-step=3.ckpt"]  # nothing left under a hidden name


# ------------------------------------------------------------------------------------------------------ failures


def record_checkpoint_errors(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Each rank records a ``CheckpointError`` raised where the Trainer strategy takes a background save's outcome
    (inside the ranks: the fork launcher calls the callbacks' ``on_exception`` in the launching process only)."""
    for name in ("on_train_batch_start", "on_train_end", "save_checkpoint"):
        real = getattr(HybridShardFSDPStrategy, name)

        def recording(self: Any, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            try:
                return _real(self, *args, **kwargs)
            except CheckpointError as err:
                record = {"type": type(err).__name__, "message": str(err), "where": _name,
                          "step": self.lightning_module.trainer.global_step}
                (folder / f"error_rank{self.global_rank}.json").write_text(json.dumps(record))
                raise

        monkeypatch.setattr(HybridShardFSDPStrategy, name, recording)


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_a_failed_background_write_raises_on_every_rank(tmp_path: Path, version: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's second write fails: every rank raises at the same step, naming the path; the checkpoint it would
    have replaced is kept, and nothing is left under a temporary name."""
    slow_writes(monkeypatch, 0.1, fail_on=(1, 2))
    record_checkpoint_errors(monkeypatch, tmp_path)
    ckpts = tmp_path / "ckpts"
    callback = ModelCheckpoint(dirpath=ckpts, monitor="progress", mode="max", save_top_k=1, every_n_train_steps=1)
    torch.manual_seed(0)
    with pytest.raises(Exception, match="in the background failed on rank 1: OSError"):
        run(tmp_path, WORLD, DEGREE, tag="fail", max_steps=6, callbacks=(callback,),
            model=StepMetric(), strategy_kwargs={"async_save": True, "fsdp_version": version})
    errors = [json.loads((tmp_path / f"error_rank{r}.json").read_text()) for r in range(WORLD)]
    assert len({json.dumps(e, sort_keys=True) for e in errors}) == 1, errors  # the same error, at the same step
    target = ckpts / "epoch=0-step=2.ckpt"
    assert errors[0]["type"] == "CheckpointError" and repr(str(target)) in errors[0]["message"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=0-step=1.ckpt"]  # kept: its replacement failed
    assert committed(ckpts / "epoch=0-step=1.ckpt")


def _fabric_fails(fabric: L.Fabric, folder: str) -> dict[str, Any]:
    from tests.fabric_loops import make_net, rank_batches

    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    outcome: dict[str, Any] = {}
    batches = rank_batches(fabric)[:6]
    # steps go on while the save is in flight (each step polls it, every rank together), however long a loaded
    # machine takes to write: the failure must come out of a step, not out of the end of the program
    for step in range(10_000):
        if step >= len(batches) and not fabric.strategy.checkpoint_in_flight:
            break
        x, y = batches[step % len(batches)]
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        try:
            optimizer.step()
        except CheckpointError as err:
            outcome = {"step": step, "message": str(err)}
            break
        optimizer.zero_grad()
        if step == 0:
            fabric.save(Path(folder) / "ckpt", {"model": model, "optimizer": optimizer})
    everyone = [None] * fabric.world_size
    torch.distributed.all_gather_object(everyone, outcome)
    return {"outcomes": everyone}


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_fabric_background_failure_raises_at_a_step_on_every_rank(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    slow_writes(monkeypatch, 0.0, fail_on=(2, 1))
    strategy = FabricStrategy(hybrid_shard_degree=DEGREE, fsdp_version=2, async_save=True, start_method="fork")
    result = L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD).launch(_fabric_fails, str(tmp_path))
    outcomes = result["outcomes"]
    assert all(o == outcomes[0] for o in outcomes) and outcomes[0], outcomes
    assert f"{str(tmp_path / 'ckpt')!r} in the background failed on rank 2: OSError" in outcomes[0]["message"]
    assert not list(tmp_path.iterdir())


def _fabric_last_save_fails(fabric: L.Fabric, folder: str) -> None:
    from tests.fabric_loops import make_net, rank_batches

    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    x, y = rank_batches(fabric)[0]
    fabric.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    fabric.save(Path(folder) / "last", {"model": model, "optimizer": optimizer})  # returns; the loop ends


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_fabric_raises_a_failed_last_save_when_the_loop_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_writes(monkeypatch, 0.2, fail_on=(3, 1))
    strategy = FabricStrategy(hybrid_shard_degree=DEGREE, fsdp_version=1, async_save=True, start_method="fork")
    with pytest.raises(Exception, match=r"/last' in the background failed on rank 3: OSError"):
        L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD).launch(_fabric_last_save_fails, str(tmp_path))
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------------- configuration


def test_async_save_needs_the_sharded_format_and_a_boolean(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(HybridShardConfigError, match="async_save=True .* state_dict_type='full'.* Fix"):
        HybridShardFSDPStrategy(hybrid_shard_degree=2, state_dict_type="full", async_save=True)
    with pytest.raises(HybridShardConfigError, match=r"async_save='yes' \(str\) is not a boolean"):
        FabricStrategy(hybrid_shard_degree=2, async_save="yes")
    # from a configuration source: refused when the Trainer is created, the same on every rank
    monkeypatch.setenv("LIGHTNING_SMP_CONFIG", json.dumps({"hybrid_shard_degree": 2, "async_save": True}))
    with pytest.raises(HybridShardConfigError, match="async_save=True"):
        cpu_trainer(HybridShardFSDPStrategy(state_dict_type="full"), devices=4)
    trainer = cpu_trainer(HybridShardFSDPStrategy(), devices=4)
    assert trainer.strategy.async_save is True
    assert cpu_trainer(HybridShardFSDPStrategy(async_save=False), devices=4).strategy.async_save is False


def test_a_description_that_differs_from_torchs_state_is_caught() -> None:
    """The check the first background save runs before trusting an engine's own description of its shards."""
    from lightning_smp.checkpoint.local import differences

    reference = {"w": torch.arange(12.0).view(4, 3), "step": torch.tensor(3.0), "groups": [{"lr": 0.1}]}
    mine = {"w": TensorChunks.of_flat_range((4, 3), 2, torch.arange(2.0, 12.0)), "step": torch.tensor(3.0),
            "groups": [{"lr": 0.1}]}
    other = {"w": TensorChunks.of_flat_range((4, 3), 0, torch.arange(2.0)), "step": torch.tensor(3.0),
             "groups": [{"lr": 0.1}]}

    def gather(obj: Any) -> list[Any]:
        return [obj]  # one rank

    assert differences(mine, reference, gather) is None  # elements 2..11: a piece of row 0, then rows 1 to 3
    assert differences(other, reference, gather) is None  # elements 0..1, as another rank would hold them
    wrong = {**mine, "w": mine["w"].map_tensors(lambda data, i: data + (i == 1))}
    assert "the values at (1, 0)" in differences(wrong, reference, gather)
    assert "groups.0.lr" in differences({**mine, "groups": [{"lr": 0.2}]}, reference, gather)
    assert "keys differ" in differences({"w": mine["w"]}, reference, gather)


def test_a_temporary_is_never_loaded(tmp_path: Path) -> None:
    leftover = tmp_path / ".last.ckpt.tmp-0123abcd-0123456789ab"
    leftover.mkdir()
    (leftover / ".metadata").write_bytes(b"")
    assert is_temporary(leftover) and not is_temporary(tmp_path / "last.ckpt")
    with pytest.raises(CheckpointError, match="never committed"):
        ckpt.read_full(leftover)


# ---------------------------------------------------------------------------------------------------------- killed


def _killed_scenario(folder: Path, ready: Path) -> None:
    """In a new session: a 4-rank fit saving last.ckpt every step in the background; the second write stops after
    the shards are on disk (DCP's .metadata and meta.pt are not), until the test kills every rank."""
    os.setsid()
    real = FileSystemWriter.write_data
    saves = {"n": 0}

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        saves["n"] += 1
        future = real(self, plan, planner)
        if saves["n"] >= 2:
            future.wait()
            if torch.distributed.get_rank() == 0:
                ready.write_text(str(os.getpid()))
            time.sleep(600)
        return future

    FileSystemWriter.write_data = write_data
    callback = ModelCheckpoint(dirpath=folder / "ckpts", save_top_k=0, every_n_train_steps=1, save_last=True)
    run(folder, WORLD, DEGREE, tag="killed", max_steps=4, callbacks=(callback,),
        strategy_kwargs={"async_save": True})


@pytest.mark.timeout(240)
def test_killed_while_writing_in_the_background(tmp_path: Path) -> None:
    # every rank dies while the thread writes
    kill_when_ready(_killed_scenario, (tmp_path, tmp_path / "ready"), tmp_path / "ready", "the second background write")
    ckpts = tmp_path / "ckpts"
    leftovers = [p for p in ckpts.iterdir() if is_temporary(p)]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".last.ckpt.tmp-")
    last = ckpts / "last.ckpt"
    assert committed(last) and ckpt.read_full(last)["global_step"] == 1  # the previous checkpoint, whole
    with pytest.raises(CheckpointError, match="never committed"):
        ckpt.read_full(leftovers[0])
    saved = ckpt.read_full(last)

    # resume at another degree from "last" (the temporary is not a candidate), saving into the same folder again
    again = ModelCheckpoint(dirpath=ckpts, save_top_k=0, every_n_train_steps=1, save_last=True)
    torch.manual_seed(0)
    trainer = cpu_trainer(HybridShardFSDPStrategy(hybrid_shard_degree=4, async_save=True, start_method="fork"),
                          tmp_path / "resume", WORLD, max_steps=3, limit_val_batches=0, num_sanity_val_steps=0,
                          enable_checkpointing=True,
                          callbacks=[RankRecorder(tmp_path / "resumed", full_state=True), again])
    trainer.fit(CkptModel(), make_loader(), ckpt_path="last")
    start = probe(tmp_path, "resumed", "start")
    assert start["global_step"] == 1
    for key, value in saved["state_dict"].items():
        assert torch.equal(start["model"][key], value), key
    state = start["optimizers"][0]["state"]
    for idx, values in saved["optimizer_states"][0]["state"].items():
        for name, value in values.items():
            assert torch.equal(torch.as_tensor(state[idx][name]), torch.as_tensor(value)), (idx, name)
    # the resumed run continued the killed one, and its next save removed the leftover
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt"]
    assert ckpt.read_full(last)["global_step"] == 3
