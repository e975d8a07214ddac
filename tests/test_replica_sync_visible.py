"""What the semi-synchronous replica groups do, as a user sees it (``replica_sync``): every sync in every logger of
the Trainer and in Fabric's ``replica_metrics``, with its count, fragment, bytes, time, the averaged
pseudo-gradient's norm and the groups' drift, read from a real ``CSVLogger`` file of a 2 x 2 run."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_smp import HybridShardFSDPStrategy
from lightning_smp.callbacks import ReplicaGroupMetrics
from lightning_smp.replicas import local_part
from tests.helpers import TinyModel, cpu_trainer, make_loader, run_distributed

EVERY, STEPS, DEGREE = 3, 7, 2
#: what a sync's report holds, in every logger
KEYS = ("syncs", "fragment", "sent_bytes", "seconds", "pseudo_gradient_norm", "drift")


class SyncedMoves(Callback):
    """This rank's squared movement of the outer loop's synced copies in each optimizer step (they move only at a
    sync: with outer lr 1 and no momentum, by exactly the averaged pseudo-gradient), and its parameter bytes."""

    def __init__(self) -> None:
        self.moves: dict[int, float] = {}
        self._before: list[torch.Tensor] = []

    def _synced(self, trainer: L.Trainer) -> list[torch.Tensor]:
        return [t.detach().clone() for f in trainer.strategy.outer_sync.fragments for t in f.synced]

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._before = self._synced(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        moved = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(self._synced(trainer),
                                                                                    self._before))
        if moved:
            self.moves[trainer.global_step] = moved


def _logged_syncs(folder: Path) -> dict[int, dict[str, float]]:
    path = next(folder.glob("**/metrics.csv"))
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return {int(row["step"]): {key: float(row[f"replica_sync/{key}"]) for key in KEYS}
            for row in rows if row.get("replica_sync/syncs")}


def _trainer_run(rank: int, world: int, folder: Path) -> dict[str, Any]:
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=DEGREE, fsdp_version=2,
                                       replica_sync={"every": EVERY, "outer_lr": 1.0, "outer_momentum": 0.0,
                                                                   "nesterov": False})
    probe = SyncedMoves()
    trainer = cpu_trainer(strategy, folder, world, max_steps=STEPS, callbacks=[probe],
                          logger=CSVLogger(folder, name="run"))
    trainer.fit(TinyModel(), make_loader(samples=256))
    # (the end of fit's sync comes after the last batch: the synced copies' last move, measured here)
    moves = dict(probe.moves)
    after = probe._synced(trainer)
    moves[STEPS] = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(after, probe._before))
    parts = sum(local_part(p).numel() * 4 for p in trainer.strategy.model.parameters())
    own: list[Any] = [None] * world
    dist.all_gather_object(own, (moves, parts))
    return {"own": own, "bar": sorted(trainer.progress_bar_metrics),
            "callbacks": sum(isinstance(c, ReplicaGroupMetrics) for c in trainer.callbacks)}


def test_every_sync_is_in_every_logger_with_its_bytes_time_norm_and_drift(tmp_path):
    """A 2 x 2 Trainer run syncing every 3 of 7 steps (outer lr 1, no momentum): its CSV logger holds a row at each
    sync's step (3, 6, and the end of fit's at 7) with the syncs so far, the fragment, the bytes rank 0 sent (its
    ring all-reduce across 2 groups: its parts' bytes), the crossing's seconds, the averaged pseudo-gradient's norm
    (equal to how far the synced weights moved, summed over group 0's ranks) and the groups' drift (positive: the
    groups trained on different data); the progress bar shows the syncs and the last crossing's seconds."""
    result = run_distributed(_trainer_run, 4, tmp_path)[0]
    assert result["callbacks"] == 1
    assert {"replica_sync/syncs", "replica_sync/seconds"} <= set(result["bar"])
    logged = _logged_syncs(tmp_path)
    assert sorted(logged) == [3, 6, 7], logged
    (moves0, parts0), (moves1, _) = result["own"][0], result["own"][1]  # (group 0: global ranks 0 and 1)
    for count, step in enumerate(sorted(logged), start=1):
        row = logged[step]
        assert row["syncs"] == count and row["fragment"] == 0
        assert row["sent_bytes"] == parts0  # (2 (2 - 1) / 2 x this rank's fp32 parts)
        assert row["seconds"] > 0 and row["drift"] > 0
        assert math.isclose(row["pseudo_gradient_norm"], math.sqrt(moves0[step] + moves1[step]), rel_tol=1e-5)


def _fabric_run(rank: int, world: int) -> list[dict[str, float]]:
    from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy
    from tests.fabric_loops import make_net, rank_batches

    fabric = L.Fabric(strategy=FabricStrategy(hybrid_shard_degree=DEGREE, fsdp_version=2,
                                              replica_sync={"every": EVERY}), accelerator="cpu", devices=world)
    fabric.launch()
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    seen = []
    for x, y in rank_batches(fabric)[:STEPS]:
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        seen.append(dict(fabric.strategy.replica_metrics))
    fabric.strategy.sync_replicas()
    seen.append(dict(fabric.strategy.replica_metrics))
    return seen


@pytest.mark.slow
def test_fabric_s_replica_metrics_hold_each_sync_at_its_step():
    """``fabric.strategy.replica_metrics`` after each step of a 2 x 2 Fabric loop: the sync's report at steps 3 and
    6 and after the loop's own ``sync_replicas()``, nothing between syncs."""
    seen = run_distributed(_fabric_run, 4)[0]
    synced = [index + 1 for index, metrics in enumerate(seen) if metrics]
    assert synced == [3, 6, 8], seen
    assert [seen[step - 1]["replica_sync/syncs"] for step in synced] == [1, 2, 3]
    assert all(set(seen[step - 1]) == {f"replica_sync/{key}" for key in KEYS} for step in synced)


class Validated(TinyModel):
    """TinyModel with a validation step; ``sync_train``: its training loss logged with ``sync_dist=True``."""

    def __init__(self, sync_train: bool) -> None:
        super().__init__()
        self.sync_train = sync_train

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=self.sync_train)
        self.log("train_plain", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)


def _warned_run(rank: int, world: int, folder: Path, sync_train: bool, val_every: int) -> list[str]:
    import warnings

    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=DEGREE, fsdp_version=2, replica_sync={"every": EVERY})
    trainer = cpu_trainer(strategy, folder, world, max_steps=STEPS, val_check_interval=val_every,
                          limit_val_batches=1, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Validated(sync_train), make_loader(samples=256), make_loader(samples=32))
    return [str(w.message) for w in caught if "replica_sync" in str(w.message)]


@pytest.mark.parametrize(("sync_train", "val_every", "expected"), [
    pytest.param(True, 2, ["'train_loss' logged with sync_dist=True", "validation runs every 2 optimizer step(s)"],
                 id="both"),
    pytest.param(False, 3, [], id="neither"),
])
def test_a_user_who_loses_silently_under_replica_sync_is_told_once(tmp_path, sync_train, val_every, expected):
    """A training-step metric logged with ``sync_dist=True`` (named, once, whatever the steps; not the validation
    metric, which should sync, nor the one logged without it) and a validation interval shorter than ``every``
    (once, saying which weights are validated); neither when the run follows the docs."""
    said = run_distributed(_warned_run, 4, tmp_path, sync_train, val_every)[0]
    assert len(said) == len(expected), said
    for part in expected:
        assert sum(part in message for message in said) == 1, (part, said)
    assert not any("val_loss" in message or "train_plain" in message for message in said)


def _reported(rank: int, world: int, folder: Path, comm_step: int, sync: dict | None = None
              ) -> tuple[list[dict], str]:
    from lightning_smp.accounting.render import format_report
    from lightning_smp.callbacks import MemorySavingsCallback

    callback = MemorySavingsCallback(comm_step=comm_step, print_table=False)
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=DEGREE, fsdp_version=2,
                                       replica_sync={"every": EVERY, **(sync or {})})
    # (a sanity check's validation forward first: the strategy releases the root it left gathered)
    trainer = cpu_trainer(strategy, folder, world, max_steps=STEPS, callbacks=[callback], limit_val_batches=1,
                          num_sanity_val_steps=1)
    trainer.fit(Validated(False), make_loader(samples=256), make_loader(samples=32))
    return callback.reports["fit_end"], format_report(callback.reports["fit_end"])


@pytest.mark.parametrize("comm_step", [1, EVERY], ids=["between_syncs", "a_sync"])
def test_the_report_names_the_groups_the_engine_and_a_sync_and_counts_what_runs(tmp_path, comm_step):
    """MemorySavingsCallback under replica_sync on 2 x 2 ranks: the title names the engine, the replica groups and
    replica_sync's settings; the replicate axis has the sync's row (one all-reduce of each rank's parts every 3
    steps, its ring bytes amortised per step); every count of the counted step equals the textbook's (the first
    step, after a sanity check's validation; and a step that syncs, whose all-reduce the sync's row shows)."""
    from lightning_smp.accounting.render import report_tables

    records, text = run_distributed(_reported, 4, tmp_path, comm_step)[0]
    assert report_tables(records)[0][0].endswith(
        "HybridShardFSDPStrategy (fsdp2), 2 replica group(s) x 2 shard(s), FULL_SHARD inside each; replica_sync"
        " every 3 steps, 1 fragment(s), outer SGD lr 1 no momentum, copies on the device")
    assert "measured differs" not in text
    for record in records:
        assert record["comm_mismatch"] == [], record
        sync = record["replica_sync"]
        assert sync["groups"] == 2 and sync["every"] == EVERY and sync["all_reduces_in_step"] == (comm_step == EVERY)
        assert sync["bytes"] == record["replica_sync_bytes"]  # (the parts once; the outer state: their synced copy)
        assert sync["ring_bytes"] == sync["bytes"]  # (2 (2 - 1) / 2)
        measured = (record["comm"].get("replicate", {}).get("all_reduce") or {"count": 0})["count"]
        assert measured == (1 if comm_step == EVERY else 0)
    assert text.count("all_reduce (a sync, every 3 steps)") == 4


def test_the_start_line_names_the_engine_and_replica_sync():
    from lightning_smp.config.replica_sync import ReplicaSync
    from lightning_smp.degree import resolve_layout
    from lightning_smp.frontend.shared import start_line

    layout = resolve_layout(8, 2)
    assert start_line("S", layout, "fsdp2", None) == f"S: {layout.describe()}, engine fsdp2"
    assert start_line("S", layout, "fsdp2", ReplicaSync(every=20, fragments=4, outer_lr=1.0, outer_momentum=0.0,
                                                        nesterov=False, backup="cpu")) == (
        "S: hybrid_shard_degree=2: 4 replica group(s) x 2 shard(s) over 8 rank(s), FULL_SHARD inside each, engine"
        " fsdp2; replica_sync every 20 steps, 4 fragment(s), outer SGD lr 1 no momentum, copies on the cpu")
    assert "nothing sharded, engine ddp" in start_line("S", resolve_layout(4, 1), "ddp", ReplicaSync(every=5))


@pytest.mark.parametrize("comm_step", [EVERY, EVERY + 1], ids=["the_start", "the_landing"])
def test_an_overlapped_compressed_sync_is_counted_where_it_starts(tmp_path, comm_step):
    """Under ``delay=1`` and ``compress`` the counted step that starts a sync ran the compressed exchange's first
    stage across the groups (one all-to-all, counted as "other"; no all-reduce), the step it lands in the second (one
    all-gather, started as the first was found done) and its norms' all-reduce inside the group: the report's
    expectation says the same, nothing is marked as differing."""
    records, text = run_distributed(_reported, 4, tmp_path, comm_step, {"delay": 1, "compress": "int8"})[0]
    assert "measured differs" not in text
    for record in records:
        assert record["comm_mismatch"] == [], record
        across = record["comm"].get("replicate", {})
        started = comm_step == EVERY
        assert (across.get("all_gather", {"count": 0})["count"], across.get("other", {"count": 0})["count"],
                across.get("all_reduce", {"count": 0})["count"]) == ((0, 1, 0) if started else (1, 0, 0))
        assert record["replica_sync"]["compress"] == "int8"
