"""``replica_sync`` (DiLoCo) through the front ends: the option from every source and its refusals, the replica groups
bit-equal right after each sync and apart between (nothing crossing them between syncs, exactly one averaging of this
rank's parameters at a sync), H = 1 with SGD equal to DDP, training that stops between syncs ending synced, and
checkpoints that resume mid-window exactly as the run that was not interrupted, on the Trainer and in Fabric."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_smp import HybridShardConfigError, HybridShardFSDPStrategy, UnsupportedOptionError
from lightning_smp.accounting import CommCounter
from lightning_smp.callbacks.memory import strategy_mesh
from lightning_smp.replicas import local_part
from tests.helpers import PARITY_BOUND, TinyModel, cpu_trainer, make_loader, run_distributed

WORLD = 4
#: (fsdp_version, hybrid_shard_degree) of each engine replica_sync runs on: FSDP2 shards inside groups of two, the
#: DDP engine runs groups of one rank
ENGINES = [pytest.param(2, 2, id="fsdp2"), pytest.param(2, 1, id="ddp_engine")]


def _digest(module: torch.nn.Module) -> str:
    parts = [local_part(p).detach().cpu().contiguous() for p in module.parameters()]
    return hashlib.sha1(b"".join(p.numpy().tobytes() for p in parts)).hexdigest()


class SyncProbe(Callback):
    """Per optimizer step, on every rank: the digest of this rank's parameters (each group's rank r holds the same
    part as rank r of the others) and the collectives the step issued per mesh axis; at the end of fit (after the
    strategy's final sync), the digest again. Rank 0 writes every rank's records to ``<folder>/probe.pt``."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.steps: list[dict[str, Any]] = []

    counter: CommCounter | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.counter is None:  # (from the first micro-batch of an optimizer step)
            self.counter = CommCounter(strategy_mesh(trainer.strategy)).__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        if self.counter is None or trainer.global_step == len(self.steps):
            return  # (a micro-batch before the last of an optimizer step)
        self.counter.__exit__(None, None, None)
        counts, self.counter = self.counter.counts(), None
        self.steps.append({"digest": _digest(trainer.strategy.model),
                           "crossing": {axis: dict(counts[axis]["all_reduce"]) for axis in ("replicate", "other")},
                           "broadcasts": counts["replicate"]["broadcast"]["count"]})

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = {"steps": self.steps, "end": _digest(trainer.strategy.model),
                  "local_bytes": sum(local_part(p).numel() * local_part(p).element_size()
                                     for p in trainer.strategy.model.parameters())}
        gathered: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(gathered, record)
        if trainer.global_rank == 0:
            torch.save(gathered, self.folder / "probe.pt")


def _fit(folder: Path, version: int, degree: int, every: int, max_steps: int, backup: str = "device",
         **trainer_kwargs: Any) -> tuple[list[dict[str, Any]], dict[str, list[dict]]]:
    """The probe's records of every rank, and the memory reports."""
    from lightning_smp.callbacks import MemorySavingsCallback

    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=version, start_method="fork",
                                       replica_sync={"every": every, "backup": backup})
    torch.manual_seed(0)
    memory = MemorySavingsCallback(print_table=False, log_metrics=False, filename=None)
    trainer = cpu_trainer(strategy, folder, WORLD, max_steps=max_steps, callbacks=[SyncProbe(folder), memory],
                          **trainer_kwargs)
    trainer.fit(TinyModel(), make_loader(samples=256))
    return torch.load(folder / "probe.pt", weights_only=False), memory.reports


@pytest.mark.parametrize(("version", "degree", "within"), [
    pytest.param(2, 2, {"backup": "cpu"}, id="fsdp2-plain-cpu_backup"),
    pytest.param(2, 2, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}, id="fsdp2-accumulation_and_clipping"),
    pytest.param(2, 1, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
                 id="ddp_engine-accumulation_and_clipping"),
])
def test_groups_are_equal_right_after_each_sync_and_nothing_crosses_them_between(tmp_path, version, degree, within):
    """Every ``every`` steps rank r of every group holds bit-equal parameters, different between syncs (each group
    trains on its own data); a step that does not sync sends nothing across the groups (no collective on the
    replicate axis, none over the world: gradient accumulation and clipping stay inside the group too), a step that
    syncs all-reduces this rank's parameters once (in bytes, exactly); fit stopping between syncs (max_steps 7,
    every 3) ends with the groups equal. The memory report counts the outer loop's copy of the rank's part, and
    says where they live (``backup``)."""
    every, steps = 3, 7
    ranks, reports = _fit(tmp_path, version, degree, every, steps, **within)
    for rank, record in zip(ranks, reports["fit_end"]):
        assert record["replica_sync_bytes"] == rank["local_bytes"]  # the synced copy (the default: no outer momentum)
        assert record["replica_sync_backup"] == within.get("backup", "device")
    groups = WORLD // degree
    for step in range(steps):
        for position in range(degree):  # rank `position` of each group holds the same part of the model
            digests = {ranks[group * degree + position]["steps"][step]["digest"] for group in range(groups)}
            synced = (step + 1) % every == 0
            assert (len(digests) == 1) == synced, (step, digests)
        for rank in ranks:
            crossing = rank["steps"][step]["crossing"]
            assert crossing["other"]["count"] == 0, (step, crossing)
            expected = rank["local_bytes"] if (step + 1) % every == 0 else 0
            assert crossing["replicate"]["bytes"] == expected, (step, crossing)
    for position in range(degree):
        assert len({ranks[group * degree + position]["end"] for group in range(groups)}) == 1


class BuffersAndHeads(L.LightningModule):
    """BatchNorm in the body, and two heads of one shape, ``even`` used in even batches only and ``odd`` in odd ones
    (under accumulation of 2, each unused in one micro-batch of every window); inner SGD. ``manual``: the same step
    by manual optimization (``manual_backward``, one optimizer), both heads every time."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.BatchNorm1d(33),
                                        torch.nn.Linear(33, 4))
        self.even, self.odd = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)
        self.automatic_optimization = not manual

    def forward(self, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        if index is None:
            return self.body(x) + self.even(x) + self.odd(x)
        return self.body(x) + (self.even if index % 2 == 0 else self.odd)(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.automatic_optimization:
            return torch.nn.functional.mse_loss(self(x, batch_idx), y)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss)
        optimizer.step()
        return loss.detach()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _buffers_and_heads(manual: bool) -> BuffersAndHeads:
    torch.manual_seed(0)
    return BuffersAndHeads(manual)


class SeenStatistics(Callback):
    """Every rank's BatchNorm running mean as each training forward computes with it (after the strategy's own
    pre-forward broadcasts), written to ``<folder>/seen<rank>.pt``."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.seen = Path(folder), []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        norm = pl_module.body[2]
        norm.register_forward_pre_hook(lambda module, args: self.seen.append(module.running_mean.detach().clone()))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save(self.seen, self.folder / f"seen{trainer.global_rank}.pt")


@pytest.mark.parametrize(("version", "degree", "manual", "trainer_kwargs"), [
    pytest.param(2, 2, False, {"accumulate_grad_batches": 2}, id="fsdp2-accumulation"),
    pytest.param(2, 1, False, {"accumulate_grad_batches": 2}, id="ddp_engine-accumulation"),
    pytest.param(2, 2, True, {}, id="fsdp2-manual"),
])
def test_every_step_with_plain_sgd_is_ddp(tmp_path, version, degree, manual, trainer_kwargs):
    """H = 1, outer SGD lr 1 without momentum, an SGD inner optimizer without momentum: each sync sets the
    parameters to the mean of the groups' SGD steps from the same point, which is DDP's step (a head a group left
    unused in a window stays, and counts as DDP's zero), and every group starts each step from the first group's
    BatchNorm statistics, as every DDP rank from rank 0's: the final weights and statistics equal Lightning's DDP
    (``find_unused_parameters=True``) within the parity bound of the synchronous tests, under accumulation and
    manual optimization."""
    from lightning.pytorch.strategies import DDPStrategy

    from tests.helpers import fit_and_record, weights_of

    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=version, start_method="fork",
                                       replica_sync={"every": 1, "outer_lr": 1.0, "outer_momentum": 0.0,
                                                     "nesterov": False})
    loader = make_loader(samples=128, batch_size=8)
    _, ours, _ = fit_and_record(strategy, tmp_path / "ours", WORLD, model=_buffers_and_heads(manual),
                                train_loader=loader, callbacks=[SeenStatistics(tmp_path / "ours")], **trainer_kwargs)
    _, ddp, _ = fit_and_record(DDPStrategy(start_method="fork", find_unused_parameters=True), tmp_path / "ddp", WORLD,
                               model=_buffers_and_heads(manual), train_loader=loader,
                               callbacks=[SeenStatistics(tmp_path / "ddp")], **trainer_kwargs)
    # the statistics every rank computes with at the first forward of each optimizer step: global rank 0's, bit for
    # bit (the sync gives every group the first group's), and those equal DDP's rank 0's (the later micro-batches of
    # a window see their group's own: nothing crosses the groups inside a window)
    window = int(trainer_kwargs.get("accumulate_grad_batches", 1))
    seen = [torch.load(tmp_path / "ours" / f"seen{rank}.pt") for rank in range(WORLD)]
    theirs = torch.load(tmp_path / "ddp" / "seen0.pt")
    assert len(seen[0]) == len(theirs) == 6 * window
    for forward in range(0, len(theirs), window):
        assert all(torch.equal(seen[rank][forward], seen[0][forward]) for rank in range(WORLD)), forward
        assert (seen[0][forward].double() - theirs[forward].double()).abs().max().item() <= 64 * PARITY_BOUND
    weights, reference = weights_of(ours), weights_of(ddp)
    assert weights.keys() == reference.keys() and any("running_mean" in key for key in weights)
    for key, value in reference.items():
        # (a statistic moves by the inputs' 1-norm, < 64 here, times the largest weight difference; a count not)
        bound = 0 if "num_batches" in key else 64 * PARITY_BOUND if "running_" in key else PARITY_BOUND
        worst = (weights[key].double() - value.double()).abs().max().item()
        assert worst <= bound, (key, worst, bound)
    assert not torch.equal(weights["even.weight"], _buffers_and_heads(manual).even.weight.detach())  # (it trained)


# ------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"fsdp_version": 1, "hybrid_shard_degree": 2}, r"fsdp1 engine.*Fix: pass fsdp_version=2"),
    ({"fsdp_version": 2, "hybrid_shard_degree": 4}, r"one replica group: hybrid_shard_degree=4 on 4 rank\(s\) makes one"
     r" group of them all, so there is nothing to sync across. Fix: hybrid_shard_degree=1 or 2 "),
    ({"fsdp_version": 2, "hybrid_shard_degree": 2, "device_mesh": None, "sync": {"every": 3, "fragments": 2}},
     r"every=3 is not a multiple of fragments=2.*every=2"),
    ({"fsdp_version": 2, "hybrid_shard_degree": 2, "sync": {"every": 0}}, r"every=0 is not a count >= 1"),
    ({"fsdp_version": 2, "hybrid_shard_degree": 2, "sync": {"every": 5, "outer": "nesterov", "outer_momentum": 0.0}},
     r"nesterov=True with outer_momentum=0 \(nesterov from outer='nesterov'\).*Fix: nesterov=False \(or"
     r" outer='average'"),
    ({"fsdp_version": 2, "hybrid_shard_degree": 2, "sync": {"each": 5}}, r"unknown key 'each'.*every"),
    ({"fsdp_version": 2, "hybrid_shard_degree": 4,
      "fault_tolerance": {"lighthouse": "http://127.0.0.1:29510", "group": 0, "groups": 1}},
     r"fault_tolerance groups=1: there is nothing to sync across.*groups >= 2"),
    ({"fsdp_version": 2, "hybrid_shard_degree": 2, "sync": {"every": 4, "backup": "disk"}},
     r"backup='disk' is not one of 'device', 'cpu'. Fix: 'device' \(beside the parameters\) or 'cpu'"),
    ({"fsdp_version": 2, "hybrid_shard_degree": 4,
      "fault_tolerance": {"lighthouse": "http://127.0.0.1:29510", "group": 0, "groups": 2},
      "sync": {"every": 4, "delay": 1, "compress": "int8"}},
     r"replica_sync delay=1, compress='int8' with fault_tolerance.*Fix: under fault_tolerance leave delay=0,"
     r" compress='none'.*or drop fault_tolerance"),
    ({"fsdp_version": 2, "hybrid_shard_degree": 4,
      "fault_tolerance": {"lighthouse": "http://127.0.0.1:29510", "group": 0, "groups": 2}, "sync": {"every": "auto"}},
     r"replica_sync every='auto' with fault_tolerance.*lightning-smp plan prints the one 'auto' would choose"),
])
def test_what_replica_sync_cannot_run_is_refused_when_the_trainer_is_made(kwargs, message):
    """Refused at ``Trainer(...)``, before any process starts, naming the value and the fix."""
    kwargs = dict(kwargs)
    sync = kwargs.pop("sync", {"every": 4})
    with pytest.raises(HybridShardConfigError, match=message):
        strategy = HybridShardFSDPStrategy(start_method="fork", replica_sync=sync, **kwargs)
        cpu_trainer(strategy, None, WORLD)


@pytest.mark.parametrize(("sharding_strategy", "rule"), [
    ("HYBRID_SHARD", "0 with HYBRID_SHARD shards inside each node, and a node here has 4 rank(s)"),
    ("FULL_SHARD", "0 with FULL_SHARD shards over all 4 rank(s)"),
])
def test_one_replica_group_from_degree_0_names_the_degree_given_what_it_resolved_to_and_why(sharding_strategy, rule):
    """hybrid_shard_degree=0 (native FSDP's rules) on one node of 4 ranks makes one group of 4: the refusal names the
    0 the user gave, the 4 it resolved to and the rule, not a degree 4 the user never wrote."""
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=0, fsdp_version=2, sharding_strategy=sharding_strategy,
                                       replica_sync={"every": 4})
    with pytest.raises(HybridShardConfigError) as refused:
        cpu_trainer(strategy, None, WORLD)
    assert str(refused.value) == (
        f"replica_sync with one replica group: hybrid_shard_degree=0, which resolves to 4 (native FSDP rules: {rule})"
        " on 4 rank(s) makes one group of them all, so there is nothing to sync across. Fix: hybrid_shard_degree=1 or"
        " 2 (two replica groups or more), or drop replica_sync.")


def test_two_optimizers_are_refused(tmp_path):
    class TwoOptimizers(TinyModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            return None

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]

    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=2, start_method="fork",
                                       replica_sync={"every": 2})
    with pytest.raises(UnsupportedOptionError, match=r"replica_sync with 2 optimizers"):
        cpu_trainer(strategy, tmp_path, WORLD, max_steps=2).fit(TwoOptimizers(), make_loader())


# ------------------------------------------------------------------------------------------------- checkpoints


def _fit_with_checkpoints(folder: Path, version: int, degree: int, kind: str, async_save: bool, inner: str,
                          ckpt_path: Path | None = None, sync: dict[str, Any] | None = None,
                          **trainer_kwargs: Any) -> dict[str, torch.Tensor]:
    """A fit to step 10 syncing every 3 steps (and ``sync``'s other keys), a checkpoint every 4 steps (4 and 8:
    inside a window; step 4 ends epoch 0); returns the final weights (in the launching process)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=version, start_method="fork",
                                       state_dict_type=kind, async_save=async_save,
                                       replica_sync={"every": 3, "outer": "nesterov", **(sync or {})})
    torch.manual_seed(0)
    model = TinyModel(optimizer=inner)
    saving = ModelCheckpoint(dirpath=folder / "checkpoints", save_top_k=-1, every_n_train_steps=4)
    trainer = cpu_trainer(strategy, folder, WORLD, max_steps=10, callbacks=[saving], enable_checkpointing=True,
                          **trainer_kwargs)
    trainer.fit(model, make_loader(), ckpt_path=ckpt_path)
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


@pytest.mark.parametrize(("version", "degree", "kind", "async_save", "inner", "sync", "trainer_kwargs"), [
    pytest.param(2, 2, "sharded", False, "adam", None, {}, id="fsdp2-sharded"),
    pytest.param(2, 2, "sharded", True, "adam", None, {}, id="fsdp2-async"),
    pytest.param(2, 1, "sharded", False, "adam", None, {}, id="ddp_engine-sharded"),
    pytest.param(2, 2, "full", False, "adam", None, {}, id="fsdp2-full"),
    # the crossing of step 3's sync in flight at step 4's checkpoint (delay 2): landed, then the sync of a save
    pytest.param(2, 2, "sharded", False, "adam", {"delay": 2, "compress": "int8"}, {}, id="fsdp2-overlapped-int8"),
    pytest.param(2, 1, "full", False, "adam", {"delay": 1, "compress": "bf16"},
                 {"precision": "bf16-mixed", "accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
                 id="ddp_engine-overlapped-bf16-mixed_accumulation_clipping"),
])
def test_a_run_resumed_inside_a_window_continues_exactly(tmp_path, version, degree, kind, async_save, inner,
                                                         sync, trainer_kwargs):
    """Resumed from the checkpoint of step 4 (one step after a sync, two before the next), the run ends bit-equal to
    the one that was not interrupted: the outer momentum, the step count inside the window and every group's own
    inner optimizer state came back (a checkpoint is a sync point in both runs, a crossing in flight landed first)."""
    whole = _fit_with_checkpoints(tmp_path / "whole", version, degree, kind, async_save, inner, sync=sync,
                                  **trainer_kwargs)
    (saved,) = (tmp_path / "whole" / "checkpoints").glob("epoch=*-step=4.ckpt")
    resumed = _fit_with_checkpoints(tmp_path / "resumed", version, degree, kind, async_save, inner, ckpt_path=saved,
                                    sync=sync, **trainer_kwargs)
    assert whole.keys() == resumed.keys()
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key


class ScheduleProbe(Callback):
    """At the end of fit: what the outer loop's schedule is and why (rank 0 writes ``<folder>/schedule.pt``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        outer = trainer.strategy.outer_sync
        if trainer.global_rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            torch.save({"schedule": outer.schedule(), "why": outer.chosen.why}, self.folder / "schedule.pt")


def test_what_auto_chose_comes_back_with_a_checkpoint_and_is_not_chosen_again(tmp_path):
    """every='auto', delay='auto' on the DDP engine (4 groups of one rank): the calibration sync at step 10 chooses;
    the checkpoint of step 12 keeps the choice; the run resumed from it takes it (no second calibration: its reason
    says so) and ends bit-equal to the run that was not interrupted."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(folder: Path, ckpt_path: Path | None = None) -> dict[str, torch.Tensor]:
        strategy = HybridShardFSDPStrategy(hybrid_shard_degree=1, fsdp_version=2, start_method="fork",
                                           replica_sync={"every": "auto", "delay": "auto"})
        torch.manual_seed(0)
        model = TinyModel(optimizer="adam")
        saving = ModelCheckpoint(dirpath=folder / "checkpoints", save_top_k=-1, every_n_train_steps=12)
        trainer = cpu_trainer(strategy, folder, WORLD, max_steps=16, callbacks=[saving, ScheduleProbe(folder)],
                              enable_checkpointing=True)
        trainer.fit(model, make_loader(samples=192), ckpt_path=ckpt_path)  # (12 steps an epoch: step 12 ends one)
        return {key: value.detach().clone() for key, value in model.state_dict().items()}

    whole = fit(tmp_path / "whole")
    (saved,) = (tmp_path / "whole" / "checkpoints").glob("epoch=*-step=12.ckpt")
    chose = torch.load(tmp_path / "whole" / "schedule.pt", weights_only=False)
    assert chose["schedule"]["origin"] == 10 and chose["why"].startswith("a crossing of ")
    resumed = fit(tmp_path / "resumed", saved)
    kept = torch.load(tmp_path / "resumed" / "schedule.pt", weights_only=False)
    assert kept["schedule"] == chose["schedule"] and "kept by the checkpoint" in kept["why"]
    assert all(torch.equal(whole[key], resumed[key]) for key in whole)


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_run_resumed_with_another_outer_momentum_takes_the_new_one(tmp_path, kind):
    """A checkpoint saved with outer momentum resumes without it (outer_momentum=0: the saved momentum is not
    loaded), and one saved without resumes with it (from zero momentum), in either format."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(folder: Path, momentum: float, ckpt_path: Path | None = None) -> Path:
        sync = {"every": 3, "outer_momentum": momentum, "nesterov": bool(momentum)}
        strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=2, start_method="fork",
                                           state_dict_type=kind, replica_sync=sync)
        torch.manual_seed(0)
        saving = ModelCheckpoint(dirpath=folder / "checkpoints", save_top_k=-1, every_n_train_steps=4)
        trainer = cpu_trainer(strategy, folder, WORLD, max_steps=6, callbacks=[saving], enable_checkpointing=True)
        trainer.fit(TinyModel(), make_loader(), ckpt_path=ckpt_path)
        assert trainer.global_step == 6
        return folder / "checkpoints" / "epoch=0-step=4.ckpt"

    fit(tmp_path / "without", 0.0, fit(tmp_path / "with", 0.9))
    fit(tmp_path / "with_again", 0.9, fit(tmp_path / "without_first", 0.0))


class OuterProbe(Callback):
    """At the start of training (after a checkpoint was loaded): the outer loop's step count and its momentum, each
    parameter's gathered in full, written by rank 0 to ``<folder>/outer.pt``."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_smp.replica_sync.state import outer_optimizer

        outer = trainer.strategy.outer_sync
        shadow = outer_optimizer(outer)
        names = {id(p): n.removeprefix("module.") for n, p in trainer.strategy.model.named_parameters()}
        momentum = {}
        for param in outer.parameters:
            buffer = shadow.state[param]["momentum_buffer"]
            momentum[names[id(param)]] = (buffer.full_tensor() if hasattr(buffer, "full_tensor") else buffer).cpu()
        if trainer.global_rank == 0:
            torch.save({"steps": outer.steps, "momentum": momentum}, self.folder / "outer.pt")


def test_the_outer_state_moves_between_degrees_engines_and_formats(tmp_path):
    """A sharded checkpoint of FSDP2 at degree 2 (2 groups) resumes on the DDP engine at degree 1 (4 groups): the
    step count inside the window and the outer momentum come back resharded, equal to what consolidating the
    checkpoint into one file holds."""
    from lightning_smp.checkpoint import consolidate, read_full
    from lightning_smp.frontend.replica_sync import OUTER_ENTRY

    _fit_with_checkpoints(tmp_path / "first", 2, 2, "sharded", False, "adam")
    saved = tmp_path / "first" / "checkpoints" / "epoch=0-step=4.ckpt"
    full = read_full(consolidate(saved, tmp_path / "consolidated.ckpt"))
    names = list(full["state_dict"])  # the outer optimizer's state in torch's layout: by index, in parameter order
    saved_momentum = {names[index]: state["momentum_buffer"] for index, state in full[OUTER_ENTRY]["state"].items()}
    assert set(saved_momentum) == set(names) and all(v.abs().sum() > 0 for v in saved_momentum.values())

    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=1, fsdp_version=2, start_method="fork",
                                       replica_sync={"every": 3, "outer": "nesterov"})
    torch.manual_seed(0)
    trainer = cpu_trainer(strategy, tmp_path / "second", WORLD, max_steps=5, callbacks=[OuterProbe(tmp_path)])
    trainer.fit(TinyModel(), make_loader(), ckpt_path=saved)
    resumed = torch.load(tmp_path / "outer.pt", weights_only=True)
    assert resumed["steps"] == 4
    assert resumed["momentum"].keys() == saved_momentum.keys()
    for name, value in saved_momentum.items():
        assert torch.equal(resumed["momentum"][name], value), name


# ------------------------------------------------------------------------------------------------- Fabric


def _fabric_loop(fabric: L.Fabric, steps: int, save_at: int | None, folder: str, resume: bool) -> list[Any]:
    """A Fabric loop over this rank's batches (AdamW inside), syncing every 3 steps: per step, the digest of this
    rank's parameters; optionally ``fabric.save`` at step ``save_at`` (a sync point), or a start from that save;
    at the end ``sync_replicas()`` and the full weights on rank 0. Every rank's record, on every rank."""
    from tests.fabric_loops import make_net, rank_batches

    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if resume:
        fabric.load(f"{folder}/ckpt", state)
    start = state["step"]
    batches = (rank_batches(fabric) * 4)[start:]
    digests = []
    for step in range(start, steps):
        x, y = batches[step - start]
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        digests.append(_digest(model))
        if step + 1 == save_at:
            state["step"] = step + 1
            fabric.save(f"{folder}/ckpt", state)
    fabric.strategy.sync_replicas()
    weights = {k: v.tolist() for k, v in fabric.strategy.full_state_dict(model).items()}
    ranks: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(ranks, {"digests": digests, "end": _digest(model), "weights": weights})
    return ranks  # (the launcher hands back rank 0's)


@pytest.mark.parametrize(("kind", "sync"), [("sharded", {}), ("full", {}),
                                            ("sharded", {"delay": 2, "compress": "int4"})],
                         ids=["sharded", "full", "sharded-overlapped-int4"])
def test_fabric_syncs_every_h_steps_ends_synced_and_resumes_exactly(tmp_path, kind, sync):
    """In a Fabric loop the groups are bit-equal after every third ``optimizer.step()`` and apart between (with an
    overlapped crossing, apart until the end: each group keeps its own steps of the delay); ``sync_replicas()`` ends
    the loop synced; a loop started from ``fabric.save`` at step 4 (inside a window; with a delay of 2, step 3's
    crossing still in flight: the save lands it, then syncs) ends bit-equal to the loop that saved it."""
    from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy

    def launch(save_at: int | None, resume: bool, folder: Path) -> list[dict[str, Any]]:
        strategy = FabricStrategy(hybrid_shard_degree=2, fsdp_version=2, start_method="fork", state_dict_type=kind,
                                  replica_sync={"every": 3, "outer": "nesterov", **sync})
        return L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD).launch(
            _fabric_loop, 8, save_at, str(folder), resume)

    whole = launch(4, False, tmp_path)
    for step in range(8 if sync else 0):  # (overlapped: each group keeps its own steps of the delay, apart always)
        for position in range(2):
            assert whole[position]["digests"][step] != whole[2 + position]["digests"][step], step
    for step in range(8 if not sync else 0):
        for position in range(2):
            digests = {whole[group * 2 + position]["digests"][step] for group in range(2)}
            assert (len(digests) == 1) == ((step + 1) % 3 == 0), step  # (the save at 4 syncs after the digest)
    for position in range(2):
        assert whole[position]["end"] == whole[2 + position]["end"]
    resumed = launch(None, True, tmp_path)
    assert resumed[0]["weights"] == whole[0]["weights"]


class ValidationProbe(Callback):
    """The digest of this rank's parameters during each validation run of fit, every rank's, on rank 0."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.digests = Path(folder), []

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx == 0 and not trainer.sanity_checking:
            self.digests.append(_digest(trainer.strategy.model))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        gathered: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(gathered, self.digests)
        if trainer.global_rank == 0:
            torch.save(gathered, self.folder / "validation.pt")


class Validated(TinyModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)


@pytest.mark.parametrize("saving", [False, True], ids=["validating", "validating_and_saving"])
def test_validation_sees_the_synced_weights_and_changes_nothing(tmp_path, saving):
    """Validating every 2 steps while syncing every 3: every group validates the weights as last synced (rank r of
    each group the same), and the run ends bit-equal to one without validation: nothing was synced for it. With a
    checkpoint after each validation (a sync right after a forward without backward, which FSDP2's root leaves
    gathered), it ends bit-equal to a run that saves at the same steps without validating."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    weights = {}
    for validate in (False, True):
        strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=2, start_method="fork",
                                           replica_sync={"every": 3, "outer": "nesterov"})
        torch.manual_seed(0)
        model = Validated()
        probe = ValidationProbe(tmp_path)
        callbacks: list[Callback] = [probe]
        if saving:  # after each validation, or at the same steps' ends
            callbacks.append(ModelCheckpoint(dirpath=tmp_path / f"ckpt{validate}", save_top_k=-1,
                                             every_n_train_steps=None if validate else 2))
        trainer = cpu_trainer(strategy, tmp_path / str(validate), WORLD, max_steps=7, callbacks=callbacks,
                              val_check_interval=2 if validate else None, limit_val_batches=2 if validate else 0,
                              num_sanity_val_steps=0, enable_checkpointing=saving)
        trainer.fit(model, make_loader(samples=256), make_loader(samples=32) if validate else None)
        weights[validate] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key, value in weights[False].items():
        assert torch.equal(weights[True][key], value), key
    ranks = torch.load(tmp_path / "validation.pt", weights_only=False)
    assert len(ranks[0]) == 3  # at steps 2, 4 and 6
    for position in range(2):
        for run in range(3):
            assert ranks[position][run] == ranks[2 + position][run], (position, run)


def test_auto_plans_with_the_outer_copies_and_leaves_two_groups(tmp_path):
    """``hybrid_shard_degree="auto"`` with ``replica_sync``: the planner weighs only degrees that leave two groups
    or more, counting the outer loop's copies, and the run trains on the degree it chose."""
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree="auto", memory_budget="1GB", fsdp_version=2,
                                       start_method="fork", replica_sync={"every": 2})
    torch.manual_seed(0)
    trainer = cpu_trainer(strategy, tmp_path, WORLD, max_steps=3)
    trainer.fit(TinyModel(), make_loader())
    chosen = strategy.degree_plan
    assert chosen is not None and [r.degree for r in chosen.rows] == [1, 2]
    assert all(r.outer_bytes > 0 for r in chosen.rows) and strategy.hybrid_shard_degree in (1, 2)
    assert trainer.global_step == 3


# ------------------------------------------------------------------------------------- on torchft (fault_tolerance)


class StepProbe(Callback):
    """This rank's parts of the parameters after every optimizer step, and at the end of fit (after its sync)."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []
        self.end: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append([local_part(p).detach().clone() for p in trainer.strategy.model.parameters()])

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.end = [local_part(p).detach().clone() for p in trainer.strategy.model.parameters()]


def _run_front_end(front_end: str, strategy_kwargs: dict[str, Any], devices: int, folder: Path,
                   seed: int = 0) -> tuple[list, list]:
    """7 optimizer steps syncing every 3 (the Trainer on TinyModel, or a Fabric loop), in ranks that exist already,
    the model initialised from ``seed``: this rank's parameter parts after each step, and at the end (synced)."""
    from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy
    from tests.fabric_loops import make_net, rank_batches

    torch.manual_seed(seed)
    if front_end == "trainer":
        probe = StepProbe()
        trainer = cpu_trainer(HybridShardFSDPStrategy(**strategy_kwargs), folder, devices, max_steps=7,
                              callbacks=[probe])
        trainer.fit(TinyModel(), make_loader(samples=256))
        return probe.steps, probe.end
    fabric = L.Fabric(strategy=FabricStrategy(**strategy_kwargs), accelerator="cpu", devices=devices)
    fabric.launch()  # (the ranks exist already)
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    steps = []
    for x, y in rank_batches(fabric)[:7]:
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        steps.append([local_part(p).detach().clone() for p in model.parameters()])
    fabric.strategy.sync_replicas()
    return steps, [local_part(p).detach().clone() for p in model.parameters()]


def _torchft_group(group: int, rank: int, degree: int, lighthouse: str, front_end: str, version: int,
                   seeded_apart: bool, folder: Path) -> tuple[list, list]:
    fault_tolerance = {"lighthouse": lighthouse, "group": group, "groups": WORLD // degree, "min_groups": WORLD // degree,
                       "timeout": 30.0, "quorum_timeout": 60.0}
    kwargs = {"hybrid_shard_degree": degree, "fsdp_version": version, "replica_sync": {"every": 3},
              "fault_tolerance": fault_tolerance}
    return _run_front_end(front_end, kwargs, degree, folder / f"group{group}", seed=group if seeded_apart else 0)


def _one_job(rank: int, world_size: int, front_end: str, degree: int, version: int, folder: Path) -> tuple[list, list]:
    kwargs = {"hybrid_shard_degree": degree, "fsdp_version": version, "replica_sync": {"every": 3}}
    return _run_front_end(front_end, kwargs, world_size, folder)


@pytest.mark.slow
@pytest.mark.parametrize(("front_end", "version", "degree", "seeded_apart"), [
    pytest.param("trainer", 2, 2, False, id="trainer-fsdp2"),
    pytest.param("trainer", 2, 1, False, id="trainer-ddp_engine"),
    pytest.param("fabric", 2, 2, False, id="fabric-fsdp2"),
    pytest.param("trainer", 2, 2, True, id="trainer-fsdp2-seeded_apart"),
])
def test_groups_on_torchft_equal_the_groups_of_one_job_at_every_step(tmp_path, front_end, version, degree,
                                                                     seeded_apart):
    """The same algorithm across fault-tolerant replica groups (each its own world, a sync a round of torchft's
    Manager) as across the replicate axis of one job: every rank's parameters bit-equal at every step (two syncs,
    then the end's), with no failure. The sum of two groups is the same in either order, and the inner steps run the
    same collectives inside each group. Groups initialised from different seeds start from the first group's whole
    weights (compared at the start round, before the first forward), as one job starts from rank 0's: never a
    mosaic of shards from different groups (torchft's init_sync)."""
    from lightning_smp.testing.replica_groups import run_replica_groups

    groups = WORLD // degree
    ours = run_replica_groups(_torchft_group, groups, degree, front_end, version, seeded_apart, tmp_path)
    job = run_distributed(_one_job, WORLD, front_end, degree, version, tmp_path / "job")
    for group in range(groups):
        for rank in range(degree):
            (steps, end), (job_steps, job_end) = ours[group][rank], job[group * degree + rank]
            assert len(steps) == len(job_steps) == 7
            for step, (mine, theirs) in enumerate(zip([*steps, end], [*job_steps, job_end]), start=1):
                assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), (group, rank, step)
    for step in range(7):  # (and the groups apart between syncs, equal right after: the test can fail)
        apart = [not torch.equal(a, b) for a, b in zip(ours[0][0][0][step], ours[1][0][0][step])]
        assert any(apart) == ((step + 1) % 3 != 0), step


def _torchft_checkpoints(group: int, rank: int, degree: int, lighthouse: str, kind: str, folder: Path,
                         resume: Path | None) -> tuple[list[torch.Tensor], list[str]]:
    """A fit of 2 fault-tolerant groups to step 10 syncing every 3 steps (inner AdamW: its moments differ between the
    groups inside a window), a checkpoint every 4 steps (written by one group, each other group's own inner state
    beside it); this rank's parameter parts at the end, and the warnings it gave about the inner state."""
    import warnings

    from lightning.pytorch.callbacks import ModelCheckpoint

    fault_tolerance = {"lighthouse": lighthouse, "group": group, "groups": 2, "min_groups": 2, "timeout": 30.0,
                       "quorum_timeout": 60.0}
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=2, state_dict_type=kind,
                                       replica_sync={"every": 3, "outer": "nesterov"}, fault_tolerance=fault_tolerance)
    torch.manual_seed(0)
    saving = ModelCheckpoint(dirpath=folder / "checkpoints", save_top_k=-1, every_n_train_steps=4)
    trainer = cpu_trainer(strategy, folder / f"group{group}", degree, max_steps=10, callbacks=[saving],
                          enable_checkpointing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModel(), make_loader(), ckpt_path=resume)
    said = [str(w.message) for w in caught if "inner optimizer state" in str(w.message)]
    return [local_part(p).detach().clone() for p in trainer.strategy.model.parameters()], said


def _torchft_fabric_checkpoints(group: int, rank: int, degree: int, lighthouse: str, kind: str, folder: Path,
                                resume: Path | None) -> tuple[list[torch.Tensor], list[str]]:
    """:func:`_torchft_checkpoints` as a Fabric loop: ``fabric.save`` after step 4 in every group, resumed from it."""
    import warnings

    from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy
    from tests.fabric_loops import make_net, rank_batches

    fault_tolerance = {"lighthouse": lighthouse, "group": group, "groups": 2, "min_groups": 2, "timeout": 30.0,
                       "quorum_timeout": 60.0}
    strategy = FabricStrategy(hybrid_shard_degree=degree, fsdp_version=2, state_dict_type=kind,
                              replica_sync={"every": 3, "outer": "nesterov"}, fault_tolerance=fault_tolerance)
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=degree)
    fabric.launch()
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if resume is not None:
            fabric.load(resume, state)
        for x, y in rank_batches(fabric)[state["step"]:10]:
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1
            if state["step"] == 4:
                fabric.save(folder / "checkpoints" / "epoch=0-step=4.ckpt", state)
        strategy.sync_replicas()
    said = [str(w.message) for w in caught if "inner optimizer state" in str(w.message)]
    return [local_part(p).detach().clone() for p in model.parameters()], said


@pytest.mark.slow
@pytest.mark.parametrize(("front_end", "kind"), [("trainer", "sharded"), ("trainer", "full"), ("fabric", "sharded"),
                                               ("fabric", "full")])
def test_groups_on_torchft_resume_inside_a_window_exactly(tmp_path, front_end, kind):
    """Fault-tolerant groups resumed from the checkpoint of step 4 (a sync point inside a window, written by one
    group, the other group's own AdamW state kept beside it) end bit-equal to the run that was not interrupted, on
    every rank of both groups: the outer momentum, the step count inside the window and each group's own inner
    optimizer state came back. Without what the other group kept, it resumes with the writer's moments (and says
    so), and its run is no longer the same: the test can fail."""
    from lightning_smp.frontend.replica_sync import own_inner_path
    from lightning_smp.testing.replica_groups import run_replica_groups

    run = _torchft_checkpoints if front_end == "trainer" else _torchft_fabric_checkpoints
    whole = run_replica_groups(run, 2, 2, kind, tmp_path / "whole", None)
    folder = tmp_path / "whole" / "checkpoints"
    saved = folder / "epoch=0-step=4.ckpt"
    kept = [own_inner_path(saved, group) for group in range(2)]
    assert saved.exists() and sum(path.exists() for path in kept) == 1, sorted(p.name for p in folder.iterdir())
    # (every group removed what it kept beside the checkpoints ModelCheckpoint removed: none here, save_top_k=-1)
    resumed = run_replica_groups(run, 2, 2, kind, tmp_path / "resumed", saved)
    for group in range(2):
        for rank in range(2):
            (mine, said), (theirs, _) = whole[group][rank], resumed[group][rank]
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), (group, rank)
            assert not said and not resumed[group][rank][1]
        # (and fit ended on a sync: both groups hold the same parts)
        assert all(torch.equal(a, b) for a, b in zip(whole[0][rank][0], whole[1][rank][0])), rank
    for path in kept:
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    alone = run_replica_groups(run, 2, 2, kind, tmp_path / "alone", saved)
    assert any(not torch.equal(a, b) for a, b in zip(whole[0][0][0], alone[0][0][0])), "the moments changed nothing"
    said = [message for ranks in alone for _, messages in ranks for message in messages]
    assert len(said) == 1 and "with group 0's inner optimizer state: it kept none beside the checkpoint" in said[0]


def _meta_init_loop(fabric: L.Fabric) -> list[Any]:
    from tests.fabric_loops import make_net

    torch.manual_seed(fabric.global_rank)  # (every rank its own initialisation)
    with fabric.init_module(empty_init=True):
        net = make_net()
    model = fabric.setup_module(net)
    outer = fabric.strategy.outer_sync
    record = {"model": _digest(model),
              "synced": hashlib.sha1(b"".join(t.detach().contiguous().numpy().tobytes()
                                              for f in outer.fragments for t in f.synced)).hexdigest()}
    ranks: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(ranks, record)
    return ranks


def test_a_model_initialised_on_the_meta_device_starts_alike_in_every_group():
    """``fabric.init_module(empty_init=True)`` with every rank seeded apart: after ``setup_module`` rank r of every
    group holds the same part, and the outer loop's synced copies are those weights (the anchor of the first sync)."""
    from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy

    strategy = FabricStrategy(hybrid_shard_degree=2, fsdp_version=2, start_method="fork",
                              replica_sync={"every": 3, "outer": "nesterov"})
    ranks = L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD).launch(_meta_init_loop)
    for position in range(2):
        assert ranks[position] == ranks[2 + position]
        assert ranks[position]["model"] == ranks[position]["synced"]
