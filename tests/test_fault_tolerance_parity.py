"""Fault-tolerant replica groups with no failure equal Lightning's DDP on the same ranks, at every step.

Every case forks its replica groups from this process (``run_replica_groups``: each group its own world, meeting
through a lighthouse that waits for all of them), 4 ranks in all: FSDP2 as 2 groups of 2 ranks, the DDP engine as 4
groups of 1, and compares every committed step with DDP on 4 ranks reading the same parts of the same data (group
``g``'s rank ``r`` reads part ``g x degree + r``, DDP's rank ``g x degree + r`` the same): the weights within the
parity bound of the synchronous tests (``tests/helpers.parity_bound``), the buffers within that bound times the
inputs' 1-norm, and the groups bit-equal to each other, buffers included. The patterns are the synchronous path's
(``tests/test_scenarios.py``): accumulation with a head that some micro-batches do not use, BatchNorm, clipping, two
optimizers stepped by hand, a penalty over the parameters in ``training_step``, ``bf16-mixed``, and a checkpoint saved
and resumed by a new job.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_smp import HybridShardFSDPStrategy, ShardedParameterError
from lightning_smp.fabric import HybridShardFSDPStrategy as FabricHybridShardFSDPStrategy
from tests.helpers import FRONT_ENDS, GLOO_TIMEOUT, QUIET_DEFAULTS, make_loader, parity_bound, run_distributed
from tests.modules import GAN, K

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

WORLD = 4
LR = 0.05
#: the engines as replica groups: (hybrid_shard_degree, groups); 4 ranks either way
ENGINES = [pytest.param(2, 2, id="fsdp2_2x2"), pytest.param(1, 4, id="ddp_4x1")]

Record = list[dict[str, torch.Tensor]]  # the full state after each committed step (group rank 0's)


class Combined(L.LightningModule):
    """A body with BatchNorm and two heads of one shape, ``even`` used in even micro-batches only and ``odd`` in odd
    ones (a unit some micro-batches of a window leave unused): trained with accumulation and clipping by norm."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.BatchNorm1d(33),
                                        torch.nn.Linear(33, 4))
        self.even, self.odd = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, micro: int) -> torch.Tensor:
        return self.body(x) + (self.even if micro % 2 == 0 else self.odd)(x)

    def loss(self, batch: Any, micro: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x, micro), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


class Heads(Combined):
    """Combined without BatchNorm (FSDP2's mixed precision casts a BatchNorm's weights, not its statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 4))


class PenaltyInTheStep(Heads):
    """An L2 term over ``self.parameters()`` in ``training_step``: refused where the parameters are shards. Without
    the heads (DDP's reducer takes a parameter that no forward used but the loss does for a second use)."""

    def __init__(self) -> None:
        super().__init__()
        del self.even, self.odd

    def forward(self, x: torch.Tensor, micro: int) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch, batch_idx) + 1e-2 * sum(p.pow(2).sum() for p in self.parameters())


class TwoNets(GAN):
    """``tests.modules.GAN`` (manual optimization, a generator and a discriminator, each its own optimizer), with a
    forward that runs either, for a Fabric loop (which calls the sharded root)."""

    def forward(self, part: str, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, part)(x)


def _seeded(kind: type[L.LightningModule], seed: int = 0) -> L.LightningModule:
    torch.manual_seed(seed)
    return kind()


def _loader(pattern: Pattern) -> DataLoader:
    """One epoch of the pattern's data: ``per_epoch`` windows of micro-batches for each of the 4 ranks."""
    return make_loader(samples=WORLD * pattern.micro_batches * pattern.per_epoch * pattern.batch,
                       batch_size=pattern.batch)


@dataclass(frozen=True)
class Pattern:
    """One training pattern: its module, the Trainer's arguments, the Fabric loop, its steps and precision."""

    name: str
    module: type[L.LightningModule]
    trainer: dict[str, Any]
    steps: int = 3
    precision: str = "32-true"
    #: refused where the parameters are sharded, with this error, before any step
    refused: type[Exception] | None = None
    #: optimizer steps per epoch (the data's length; default: all the steps in one epoch)
    epoch_steps: int | None = None

    @property
    def per_epoch(self) -> int:
        return self.epoch_steps or self.steps

    @property
    def batch(self) -> int:
        return 2 if self.module is TwoNets else 8  # (8 a batch: BatchNorm's statistics over 8 samples)

    @property
    def micro_batches(self) -> int:
        return int(self.trainer.get("accumulate_grad_batches", 1))


PATTERNS = {p.name: p for p in [
    Pattern("accumulation_buffers_clipping", Combined, {"accumulate_grad_batches": K, "gradient_clip_val": 0.05}),
    Pattern("two_optimizers_by_hand", TwoNets, {}, steps=2),
    Pattern("penalty_in_the_step", PenaltyInTheStep, {}, steps=2, refused=ShardedParameterError),
    Pattern("bf16_mixed", Heads, {"accumulate_grad_batches": K}, steps=1, precision="bf16-mixed"),
    # two epochs of two steps: a checkpoint at the end of the first, resumed by a new job
    Pattern("checkpoint", Combined, {"accumulate_grad_batches": K, "gradient_clip_val": 0.05}, steps=4,
            epoch_steps=2),
]}


@dataclass(frozen=True)
class Run:
    """One run of a pattern: by replica groups (``groups``), or by DDP; ``seeds``: the seed of each group's (DDP: each
    rank's) model, the last one for the rest; ``stop``, ``save``, ``resume``: a run cut at a checkpoint."""

    name: str
    folder: Path
    groups: int = 0
    seeds: tuple[int, ...] = (0,)
    stop: int | None = None
    save: Path | None = None
    resume: Path | None = None
    #: a group's rank 0 returns the error that ended it (its type's name and message) instead of raising it
    catch: bool = False
    #: the strategies' auto_wrap_policy (``None``: one unit, the root, owns every parameter)
    policy: frozenset[type] | None = frozenset({torch.nn.Linear})

    def seed_of(self, index: int) -> int:
        return self.seeds[min(index, len(self.seeds) - 1)]


# ------------------------------------------------------------------------------------------------ the Trainer


class RecordSteps(L.Callback):
    """The full state after every committed optimizer step, on rank 0 of the group (of the job, under DDP); what the
    progress bar shows at the end, to ``progress_bar.json`` in the Trainer's folder."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            folder = Path(trainer.default_root_dir)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "progress_bar.json").write_text(json.dumps({k: float(v) for k, v in
                                                                   trainer.progress_bar_metrics.items()}))

    def __init__(self) -> None:
        self.steps: Record = []
        self.start: str | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.fit_loop._should_accumulate() or not getattr(trainer.strategy, "step_committed", True):
            return
        strategy = trainer.strategy
        replicas = getattr(strategy, "replica_groups", None)
        if replicas is not None and replicas.start is not None:
            self.start = replicas.start.value
        full = strategy.full_state_dict() if hasattr(strategy, "full_state_dict") else pl_module.state_dict()
        if trainer.global_rank == 0:
            self.steps.append({k: v.detach().cpu().clone() for k, v in full.items()})


def _fit(strategy: Any, pattern: Pattern, devices: int, folder: Path, *, seed: int = 0, stop: int | None = None,
         save: Path | None = None, resume: Path | None = None) -> tuple[Record, str | None]:
    """Fit the pattern to its last step (or ``stop``), saving a checkpoint there (``save``), or resuming from one."""
    recorder = RecordSteps()
    callbacks: list[L.Callback] = [recorder]
    if save is not None:
        callbacks.append(SaveAt(save, stop or pattern.steps))
    per_batch = 2 if pattern.module is TwoNets else 1  # (manual optimization: two optimizer steps a batch)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision=pattern.precision,
                        max_steps=per_batch * (stop or pattern.steps), callbacks=callbacks, default_root_dir=folder,
                        **{**QUIET_DEFAULTS, **pattern.trainer})
    trainer.fit(_seeded(pattern.module, seed), _loader(pattern), ckpt_path=str(resume) if resume else None)
    return recorder.steps, recorder.start


class SaveAt(L.Callback):
    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and not trainer.fit_loop._should_accumulate():
            trainer.save_checkpoint(self.path)  # every rank: a sharded save is a collective


def _fault_tolerance(lighthouse: str, group: int, groups: int) -> dict[str, Any]:
    return {"lighthouse": lighthouse, "group": group, "groups": groups, "min_groups": groups, "timeout": 30.0,
            "quorum_timeout": 60.0}


def _caught(run: Run, rank: int, body: Callable[[], tuple[Record, str | None]]) -> Any:
    """``body()``, or with ``run.catch`` on a group's rank 0 the error that ended it, as ``"Type: message"`` (its other
    ranks may end on the connection their rank 0 closed)."""
    if not run.catch:
        return body()
    try:
        return body()
    except Exception as err:  # noqa: BLE001  # (what the test asserts)
        return (f"{type(err).__name__}: {err}", None) if rank == 0 else (None, None)


def _trainer_group(group: int, rank: int, degree: int, lighthouse: str, run: Run) -> Any:
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=2, auto_wrap_policy=run.policy,
                                       fault_tolerance=_fault_tolerance(lighthouse, group, run.groups))
    return _caught(run, rank, lambda: _fit(strategy, PATTERNS[run.name], degree, run.folder / f"group{group}",
                                           seed=run.seed_of(group), stop=run.stop, save=run.save, resume=run.resume))


def _trainer_ddp(rank: int, world_size: int, run: Run) -> tuple[Record, str | None]:
    from lightning.pytorch.strategies import DDPStrategy

    return _fit(DDPStrategy(find_unused_parameters=True), PATTERNS[run.name], world_size, run.folder,
                seed=run.seed_of(rank))


# ------------------------------------------------------------------------------------------------ Fabric


def _fabric_loop(fabric: L.Fabric, pattern: Pattern, *, seed: int = 0, save: Path | None = None,
                 resume: Path | None = None, stop: int | None = None) -> tuple[Record, str | None]:
    """The pattern as a Fabric loop: the data through ``fabric.setup_dataloaders`` (each rank its part, as the
    strategy's sampler arguments say), accumulation under ``no_backward_sync``, clipping by ``fabric.clip_gradients``,
    a second optimizer stepped on its own (the GAN's generator and discriminator)."""
    module = _seeded(pattern.module, seed)
    two = pattern.module is TwoNets
    model = fabric.setup_module(module)
    parts = [model.module.generator, model.module.discriminator] if two else [model.module]
    optimizers = [fabric.setup_optimizers(torch.optim.AdamW(p.parameters(), lr=LR)) for p in parts]
    state: dict[str, Any] = {"model": model, **{f"optimizer{i}": o for i, o in enumerate(optimizers)}, "step": 0}
    strategy = fabric.strategy
    if hasattr(strategy, "fault_tolerant_state"):
        strategy.fault_tolerant_state(state)
    if resume is not None:
        fabric.load(resume, state)
    micro = pattern.micro_batches
    batches = list(fabric.setup_dataloaders(_loader(pattern)))
    steps: Record = []
    clip = pattern.trainer.get("gradient_clip_val")
    while state["step"] < (stop or pattern.steps):
        first = (state["step"] % pattern.per_epoch) * micro
        window = batches[first:first + micro]
        if two:
            _gan_step(fabric, model, optimizers, window[0])
        else:
            for index, batch in enumerate(window):
                with fabric.no_backward_sync(model, enabled=index < micro - 1):
                    x, y = batch
                    loss = torch.nn.functional.mse_loss(model(x, index), y)
                    if pattern.module is PenaltyInTheStep:  # (the term over the parameters, in the loop's loss)
                        loss = loss + 1e-2 * sum(p.pow(2).sum() for p in model.parameters())
                    fabric.backward(loss / micro)
            if clip is not None:
                fabric.clip_gradients(model, optimizers[0], max_norm=clip)
            optimizers[0].step()
            optimizers[0].zero_grad()
        if not getattr(strategy, "step_committed", True):
            continue
        state["step"] += 1
        full = strategy.full_state_dict(model) if hasattr(strategy, "full_state_dict") else model.state_dict()
        if fabric.global_rank == 0:
            steps.append({k: v.detach().cpu().clone() for k, v in full.items()})
        if save is not None and state["step"] == (stop or pattern.steps):
            fabric.save(save, state)
    replicas = getattr(strategy, "replica_groups", None)
    return steps, replicas.start.value if replicas is not None and replicas.start is not None else None


def _gan_step(fabric: L.Fabric, model: Any, optimizers: list[Any], batch: Any) -> None:
    """The GAN's step of ``tests.modules.GAN``, by hand: the generator's (clipped), then the discriminator's."""
    real, _ = batch
    noise = real[:, :8].flip(0)
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    opt_g, opt_d = optimizers
    fake = model("generator", noise)
    fabric.backward(bce(model("discriminator", fake), ones))
    fabric.clip_gradients(model, opt_g, max_norm=0.5)
    opt_g.step()
    opt_g.zero_grad()
    opt_d.zero_grad()  # (the generator's backward left gradients on the discriminator)
    loss = bce(model("discriminator", real), ones) + bce(model("discriminator", fake.detach()), zeros)
    fabric.backward(loss)
    opt_d.step()
    opt_d.zero_grad()


def _fabric_group(group: int, rank: int, degree: int, lighthouse: str, run: Run) -> Any:
    pattern = PATTERNS[run.name]
    strategy = FabricHybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=2, auto_wrap_policy=run.policy,
                                             fault_tolerance=_fault_tolerance(lighthouse, group, run.groups))
    fabric = L.Fabric(accelerator="cpu", devices=degree, strategy=strategy, precision=pattern.precision)
    fabric.launch()  # (the ranks exist already: this sets the strategy up)
    return _caught(run, rank, lambda: _fabric_loop(fabric, pattern, seed=run.seed_of(group), save=run.save,
                                                   resume=run.resume, stop=run.stop))


def _fabric_ddp(rank: int, world_size: int, run: Run) -> tuple[Record, str | None]:
    from lightning.fabric.strategies import DDPStrategy

    pattern = PATTERNS[run.name]
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=DDPStrategy(find_unused_parameters=True),
                      precision=pattern.precision)
    fabric.launch()
    return _fabric_loop(fabric, pattern, seed=run.seed_of(rank))


GROUP_RUNS: dict[str, Callable[..., tuple[Record, str | None]]] = {"trainer": _trainer_group, "fabric": _fabric_group}
DDP_RUNS: dict[str, Callable[..., tuple[Record, str | None]]] = {"trainer": _trainer_ddp, "fabric": _fabric_ddp}


# ------------------------------------------------------------------------------------------------ comparing


@lru_cache(maxsize=None)
def _ddp(front_end: str, name: str, seeds: tuple[int, ...] = (0,)) -> Record:
    with TemporaryDirectory() as folder:
        return run_distributed(DDP_RUNS[front_end], WORLD, Run(name, Path(folder), seeds=seeds))[0][0]


def _groups(front_end: str, degree: int, groups: int, run: Run) -> tuple[list[Record], set[str | None]]:
    """Each group's record (its rank 0 holds the full state) and how the groups' start went (every rank's)."""
    from lightning_smp.testing.replica_groups import run_replica_groups

    results = run_replica_groups(GROUP_RUNS[front_end], groups, degree, replace(run, groups=groups))
    return [ranks[0][0] for ranks in results], {start for ranks in results for _, start in ranks}


def _assert_equal_to_ddp(records: list[Record], reference: Record, first_step: int = 1) -> None:
    """The groups bit-equal to each other at every step, and every step within the parity bound of DDP's."""
    assert records[0] and len(reference) == first_step - 1 + len(records[0]), (len(records[0]), len(reference))
    for group, record in enumerate(records[1:], start=1):
        assert len(record) == len(records[0]), group
        for step, (ours, theirs) in enumerate(zip(records[0], record), start=first_step):
            for key in ours:
                assert torch.equal(ours[key], theirs[key]), f"group {group} differs from group 0 at step {step}: {key}"
    elements = sum(v.numel() for k, v in reference[0].items() if not _is_buffer(k))
    for step, ours in enumerate(records[0], start=first_step):
        ddp = reference[step - 1]
        assert list(ours) == list(ddp)
        bound = parity_bound(elements, step, LR)
        for key, value in ddp.items():
            # a statistic moves by the inputs' 1-norm (< 64 here) times the largest weight difference; a count not
            allowed = (0 if "num_batches" in key else 64 * bound) if _is_buffer(key) else bound
            worst = (ours[key].double() - value.double()).abs().max().item()
            assert worst <= allowed, f"step {step}, {key}: {worst:.2e} from DDP (bound {allowed:.1e})"


def _is_buffer(key: str) -> bool:
    return "running_" in key or "num_batches" in key


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize(("degree", "groups"), ENGINES)
def test_a_run_with_no_failure_equals_ddp_at_every_step(tmp_path, front_end, degree, groups):
    """Accumulation with a head some micro-batches leave unused, BatchNorm's statistics and clipping by norm: every
    committed step equals DDP's, from the first (the start compares the groups' states and heals nobody), and the
    groups are bit-equal, buffers included."""
    name = "accumulation_buffers_clipping"
    records, starts = _groups(front_end, degree, groups, Run(name, tmp_path))
    assert starts == {"same"}
    _assert_equal_to_ddp(records, _ddp(front_end, name))
    assert any("running_mean" in key for key in records[0][0])
    if front_end == "trainer":  # (every group's progress bar: the groups in the last step, and its commit)
        for group in range(groups):
            bar = json.loads((tmp_path / f"group{group}" / "progress_bar.json").read_text())
            assert bar["fault_tolerance/groups"] == groups and bar["fault_tolerance/committed"] == 1


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize(("name", "degree", "groups"), [
    pytest.param("two_optimizers_by_hand", 2, 2, id="two_optimizers_by_hand"),
    pytest.param("penalty_in_the_step", 2, 2, id="penalty_in_the_step-fsdp2"),
    pytest.param("penalty_in_the_step", 1, 4, id="penalty_in_the_step-ddp"),
    pytest.param("bf16_mixed", 2, 2, id="bf16_mixed"),
])
def test_each_training_pattern_equals_ddp_or_is_refused_before_any_step(tmp_path, front_end, name, degree, groups):
    pattern = PATTERNS[name]
    if pattern.refused is not None and degree > 1:
        # every group raises before any optimizer step (the same error as without fault tolerance)
        outcomes = _groups(front_end, degree, groups, Run(name, tmp_path, catch=True))[0]
        for outcome in outcomes:
            assert isinstance(outcome, str) and outcome.startswith(pattern.refused.__name__), outcome
            assert "outside the forward of their FSDP unit" in outcome
        return
    records, _ = _groups(front_end, degree, groups, Run(name, tmp_path))
    _assert_equal_to_ddp(records, _ddp(front_end, name))


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_checkpoint_saved_by_one_job_resumes_in_another_as_ddp(tmp_path, front_end):
    """The groups save at the end of the first epoch and stop (one group writes: every group holds the same state,
    and the checkpoint records torchft's step); a new job (new groups, a new lighthouse) resumes from that checkpoint
    and trains the second epoch: its steps equal DDP's uninterrupted run's, optimizer state included. A run without
    fault tolerance reads the same checkpoint as any of this library's."""
    from lightning_smp.checkpoint import read_full
    from lightning_smp.checkpoint.format import REPLICA_GROUPS_KEY

    name, path = "checkpoint", tmp_path / ("saved.ckpt" if front_end == "trainer" else "saved")
    first, _ = _groups(front_end, 2, 2, Run(name, tmp_path / "first", stop=2, save=path))
    saved = read_full(path)
    assert saved[REPLICA_GROUPS_KEY]["step"] == 2 and len(first[0]) == 2
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.startswith("first")) == [path.name]
    resumed, _ = _groups(front_end, 2, 2, Run(name, tmp_path / "resumed", resume=path))
    reference = _ddp(front_end, name)
    _assert_equal_to_ddp(first, reference[:2])
    _assert_equal_to_ddp(resumed, reference, first_step=3)
    plain = _seeded(Combined)
    plain.load_state_dict(saved["state_dict"])  # (a module of its own, outside any strategy)


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_replica_groups_resume_a_checkpoint_of_a_run_without_fault_tolerance_as_ddp(tmp_path):
    """A synchronous run (hybrid sharding over 4 ranks, one world) saves after the first epoch; replica groups resume
    from it (torchft's step from 0, the loop's own counter from the checkpoint) and train the second epoch as DDP
    does: its optimizer state loads (torch.distributed.checkpoint creates a missing state with a step on zero
    gradients, which is no step to vote on)."""
    name, path = "checkpoint", tmp_path / "synchronous"
    run_distributed(_synchronous_fabric, WORLD, Run(name, tmp_path, stop=2, save=path))
    resumed, starts = _groups("fabric", 2, 2, Run(name, tmp_path / "resumed", resume=path))
    assert starts == {"same"}  # (at torchft's step 0: compared, and equal)
    _assert_equal_to_ddp(resumed, _ddp("fabric", name), first_step=3)


def _synchronous_fabric(rank: int, world_size: int, run: Run) -> tuple[Record, str | None]:
    strategy = FabricHybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=2, auto_wrap_policy={torch.nn.Linear})
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    return _fabric_loop(fabric, PATTERNS[run.name], save=run.save, stop=run.stop)


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_groups_that_start_from_different_weights_all_take_the_first_group_s_whole(tmp_path, front_end):
    """Group 1 seeded otherwise than group 0 (an unseeded model): before the first forward every group holds group 0's
    weights, every shard whole, and the run equals DDP whose rank 0 (group 0's first rank) had group 0's seed (DDP
    broadcasts rank 0's weights). One FSDP2 unit, the root, owns every parameter: its forward gathers them after
    the copy."""
    name = "accumulation_buffers_clipping"
    records, starts = _groups(front_end, 2, 2, Run(name, tmp_path, seeds=(0, 1), policy=None))
    assert starts == {"made_same"}
    _assert_equal_to_ddp(records, _ddp(front_end, name, seeds=(0, 1)))
