"""Fault-tolerant replica groups (``fault_tolerance``, on torchft): the option from every source and its checks; the
step gate and what healing copies, in this process; and real runs on loopback, each replica group its own
``torchrun`` job of 2 ranks beside a lighthouse: groups that train bit-equal, a group SIGKILLed while the other
trains (the survivor commits its next step within the heartbeat timeout + 5 s, and none of its processes exits), the
group started again (it heals from the live peer and is bit-equal to it from its first committed step on, optimizer,
scheduler, counters and data position included), a group that finds no live peer (refused), and checkpoints."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import lightning_smp
from lightning_smp import HybridShardConfigError
from lightning_smp.config import resolve_config
from lightning_smp.config.fault_tolerance import ENV_GROUP, ENV_GROUPS, ENV_LIGHTHOUSE, FaultTolerance
from lightning_smp.errors import FaultToleranceError, UnsupportedOptionError
from lightning_smp.fault_tolerance.trainer_state import check_data_can_follow
from lightning_smp.testing import run_distributed

REPO = Path(__file__).resolve().parents[1]
FABRIC_SCRIPT = [str(REPO / "benchmarks" / "fault_run.py")]
TRAINER_SCRIPT = [str(REPO / "tests" / "scripts" / "ft_trainer.py")]
HEARTBEAT = 2.0
SETTINGS = {"lighthouse": "127.0.0.1:29510", "group": 0, "groups": 2}

torchft = pytest.importorskip("torchft")


# ---------------------------------------------------------------------------------------------- the option


@pytest.fixture
def torchft_env(monkeypatch):
    for name in (ENV_LIGHTHOUSE, ENV_GROUP, ENV_GROUPS):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_option_merges_from_every_source_key_by_key(torchft_env, tmp_path):
    # torchft's own variables name the lighthouse and the group; a config file adds the group count; the argument
    # (highest) a timeout
    torchft_env.setenv(ENV_LIGHTHOUSE, "10.0.0.1:29510")
    torchft_env.setenv(ENV_GROUP, "1")
    config = tmp_path / "smp.json"
    config.write_text('{"fault_tolerance": {"groups": 3, "min_groups": 2}}')
    torchft_env.setenv("LIGHTNING_SMP_CONFIG", str(config))
    merged = resolve_config({"fault_tolerance": {"timeout": 5.0}}).fault_tolerance
    assert FaultTolerance.from_mapping(merged) == FaultTolerance("10.0.0.1:29510", 1, 3, min_groups=2, timeout=5.0)
    torchft_env.setenv(ENV_GROUPS, "4")  # torchft's variable, below the config file
    assert resolve_config().fault_tolerance["groups"] == 3
    lightning_smp.init({"fault_tolerance": {"groups": 5}})  # init() above the environment
    assert resolve_config().fault_tolerance["groups"] == 5


@pytest.mark.parametrize(("value", "match"), [
    pytest.param({"lighthouse": "h:1", "group": 0}, "lacks groups", id="missing"),
    pytest.param({**SETTINGS, "group": 2}, "group=2 is not one of the 2 groups", id="group_out_of_range"),
    pytest.param({**SETTINGS, "min_groups": 3}, "min_groups=3 is more than groups=2", id="min_groups"),
    pytest.param({**SETTINGS, "timeout": -1}, "timeout=-1 is not a positive number", id="timeout"),
    pytest.param({**SETTINGS, "heartbeat": 1}, "unknown key 'heartbeat'", id="unknown_key"),
    pytest.param({**SETTINGS, "group": "0"}, "group='0' \\(str\\) is not int", id="type"),
    pytest.param("10.0.0.1:29510", "is not a mapping", id="not_a_mapping"),
])
def test_a_bad_fault_tolerance_names_the_key_and_the_fix(value, match):
    with pytest.raises(HybridShardConfigError, match=match):
        FaultTolerance.from_mapping(value) if isinstance(value, dict) else resolve_config({"fault_tolerance": value})


@pytest.mark.parametrize(("kwargs", "devices", "match"), [
    pytest.param({"hybrid_shard_degree": 2, "fsdp_version": 1}, 2,
                 "does not run on the fsdp1 engine.*Fix: pass fsdp_version=2", id="fsdp1"),
    pytest.param({"hybrid_shard_degree": 2, "fsdp_version": 2}, 4, "this job has 4 ranks and hybrid_shard_degree=2",
                 id="two_groups_in_one_job"),
    pytest.param({"hybrid_shard_degree": "auto", "fsdp_version": 2}, 2, "'auto' with fault_tolerance", id="auto"),
    pytest.param({"device_mesh": (1, 2), "fsdp_version": 2}, 2, "device_mesh with fault_tolerance", id="mesh"),
])
def test_layouts_fault_tolerance_cannot_run_are_refused_at_construction(kwargs, devices, match):
    import lightning as L

    strategy = lightning_smp.HybridShardFSDPStrategy(fault_tolerance=SETTINGS, **kwargs)
    with pytest.raises(HybridShardConfigError, match=match):
        L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False)


def test_one_group_of_the_job_runs_fsdp2_or_ddp_and_reads_its_part_of_the_data():
    import lightning as L

    for degree, engine in ((2, "fsdp2"), (1, "ddp")):
        strategy = lightning_smp.HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=2,
                                                         fault_tolerance={**SETTINGS, "group": 1, "groups": 3})
        L.Trainer(accelerator="cpu", devices=degree, strategy=strategy, logger=False)
        assert strategy.engine.name == engine and strategy.layout.replicate == 1
        assert strategy.core.fault_tolerance == FaultTolerance(SETTINGS["lighthouse"], 1, 3)
    # group 1 of 3, rank r of 2: part 2 + r of 6
    strategy = lightning_smp.fabric.HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=2,
                                                            fault_tolerance={**SETTINGS, "group": 1, "groups": 3})
    L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 6, "rank": 2}


def test_a_training_step_that_draws_its_own_batches_is_refused_before_the_first_step():
    """A healing group moves its data to a live peer's position, which a training_step taking the dataloader iterator
    does not have: refused when the Trainer sets the strategy up (every rank alike), not when a group heals."""
    import lightning as L

    class DrawsItsOwn(L.LightningModule):
        def training_step(self, dataloader_iter):
            return next(dataloader_iter)

    class TakesBatches(L.LightningModule):
        def training_step(self, batch, batch_idx):
            return batch

    strategy = lightning_smp.HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=2,
                                                     fault_tolerance=SETTINGS)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    strategy.connect(DrawsItsOwn())
    with pytest.raises(UnsupportedOptionError, match=r"fault_tolerance with a training_step that takes"
                                                     r" dataloader_iter.*Fix: training_step\(self, batch, batch_idx\)"):
        strategy._set_up_replica_groups(trainer)
    check_data_can_follow(TakesBatches())


# ---------------------------------------------------------------------------------------------- the step gate


def test_an_uncommitted_step_changes_nothing_the_optimizer_or_scheduler_holds():
    from lightning_smp.optimizers import skip_uncommitted_steps, step_when_committed

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # patches optimizer.step first
    votes = iter([True, False, True])
    committed = {"last": True}

    def vote(opt):
        committed["last"] = next(votes)
        return committed["last"]

    step_when_committed(optimizer, vote)
    skip_uncommitted_steps(scheduler, lambda: committed["last"])
    history = []
    for _ in range(3):
        model(torch.ones(1, 4)).sum().backward()
        loss = optimizer.step(lambda: torch.tensor(1.0))  # a closure runs before the vote, as Lightning's does
        assert loss == 1.0
        scheduler.step()
        history.append((model.weight.detach().clone(), optimizer.param_groups[0]["lr"],
                        [p.grad is None for p in model.parameters()]))
    (w1, lr1, _), (w2, lr2, dropped), (w3, lr3, _) = history
    assert torch.equal(w1, w2) and lr1 == lr2 == 0.05 and all(dropped)  # the uncommitted step: nothing moved
    assert not torch.equal(w2, w3) and lr3 == 0.025
    assert "_lightning_smp_commit" not in scheduler.state_dict()  # (its state stays plain values)
    with pytest.raises(UnsupportedOptionError, match="LBFGS"):
        step_when_committed(torch.optim.LBFGS(model.parameters()), vote)


def test_what_healing_copies_is_each_rank_s_shards_and_optimizer_state(tmp_path):
    """Out of one FSDP2 rank and into another model's, the shards and AdamW's state bit-equal; another layout is
    an error, never a partial copy."""

    results = run_distributed(_healing_round_trip, 2)
    assert results == [True, True]


def test_a_heal_is_taken_whole_by_the_group_and_only_from_a_peer_at_the_same_point_of_its_step():
    """A peer's state a rank received is taken only once every rank of its group received its own (a group half
    healed would train a mosaic of two states): where some rank lacks it, no rank takes it, and torchft's step and
    batch count go back to the group's own, so that it is still behind and heals at a later quorum. Under
    replica_sync, the state a group serves records the kind of round it was taken in; a group healing in a sync after
    an optimizer step takes a peer's state only from the same kind (one from a checkpoint's or the end's sync would
    count a step twice in the loop's counters and schedulers)."""
    from types import SimpleNamespace

    from lightning_smp.fault_tolerance.rounds import AFTER_STEP, BETWEEN_STEPS
    from lightning_smp.fault_tolerance.session import ROUND_KEY, ReplicaGroups

    loaded: list[dict] = []
    groups = object.__new__(ReplicaGroups)  # (the decision alone: torchft's Manager as far as it is read)
    manager = SimpleNamespace(_step=3, _batches_committed=6)
    manager.current_step = lambda: manager._step
    quorum = SimpleNamespace(heal=True, recover_src_replica_rank=0, replica_ids=["group0000:a", "group0001:b"])
    groups.manager, groups.settings, groups._vote = manager, SimpleNamespace(group=1), SimpleNamespace(quorum=quorum)
    groups._tracked = SimpleNamespace(load_state_dict=loaded.append, state_dict=lambda: {"tensors": {}})
    groups._healed_in_round, groups.healed_at, groups._healed_from = False, None, None

    def heal(state: dict | None, kind: str, missing_anywhere: bool) -> None:
        groups._round_kind = kind
        groups._ask_quorum(lambda: None)  # (before the quorum: step 3, 6 batches)
        manager._step, manager._batches_committed = 9, 18  # (torchft moved a rank that received to the peer's)
        if state is not None:
            groups._load_tracked(state)
        assert groups._heal_missing() is (state is None)
        groups._settle_heal(missing_anywhere, at=9)

    heal({"tensors": {}, ROUND_KEY: AFTER_STEP}, AFTER_STEP, missing_anywhere=True)  # (another rank lacks its own)
    assert loaded == [] and (manager._step, manager._batches_committed) == (3, 6) and groups.healed_at is None
    heal(None, AFTER_STEP, missing_anywhere=True)  # (this rank lacks it)
    assert loaded == [] and (manager._step, manager._batches_committed) == (3, 6)
    heal({"tensors": {}, ROUND_KEY: BETWEEN_STEPS}, AFTER_STEP, missing_anywhere=False)
    assert loaded == [] and manager._step == 3 and not groups.healed_in_round and groups.healed_at is None
    heal({"tensors": {}, ROUND_KEY: AFTER_STEP}, AFTER_STEP, missing_anywhere=False)
    assert len(loaded) == 1 and groups.healed_in_round and groups.healed_at == 9 and manager._step == 9
    assert groups._healed_from == 0 and groups._received is None and not groups._heal_missing()
    groups._round_kind = BETWEEN_STEPS
    assert groups._tracked_state() == {"tensors": {}, ROUND_KEY: BETWEEN_STEPS}


def _healing_round_trip(rank: int, world_size: int) -> bool:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_smp.fault_tolerance.state import TrackedState
    from lightning_smp.replicas import local_part

    mesh = init_device_mesh("cpu", (world_size,))

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        return model, optimizer

    source, source_opt = build(0)
    target, target_opt = build(1)
    sent = TrackedState.of(source, lambda: [source_opt], extra=lambda: {"counter": 7}).state_dict()
    got = {}
    TrackedState.of(target, lambda: [target_opt], load_extra=got.update).load_state_dict(sent)
    same = all(torch.equal(local_part(a), local_part(b)) for a, b in zip(source.parameters(), target.parameters()))
    for a, b in zip(source_opt.state.values(), target_opt.state.values()):
        same = same and all(torch.equal(local_part(a[k]), local_part(b[k])) for k in a)
    # the next step from the copied state is the source's next step
    batch = torch.randn(4, 6)
    for model, optimizer in ((source, source_opt), (target, target_opt)):
        model(batch).sum().backward()
        optimizer.step()
    same = same and all(torch.equal(local_part(a), local_part(b))
                        for a, b in zip(source.parameters(), target.parameters()))
    wrong = {**sent, "tensors": {k: v[:1] for k, v in sent["tensors"].items()}}
    try:
        TrackedState.of(target, lambda: [target_opt]).load_state_dict(wrong)
        refused = False
    except RuntimeError as err:
        refused = "same hybrid_shard_degree" in str(err)
    dist.barrier()
    return same and got == {"counter": 7} and refused


# ---------------------------------------------------------------------------------------------- real runs


def _jobs(tmp_path: Path, script: list[str], **kwargs):
    from lightning_smp.testing.replica_groups import ReplicaGroupJobs

    return ReplicaGroupJobs(script, tmp_path / "run", heartbeat_timeout=HEARTBEAT, **kwargs)


def _first_sample(samples: int, part: int, epoch: int, batch_idx: int, parts: int = 4, batch: int = 8) -> int:
    """The first sample of a batch of the Trainer script's data, as Lightning's DistributedSampler orders it."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(samples), num_replicas=parts, rank=part, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)[batch_idx * batch]


def _by_step(records: list[dict]) -> dict[int, dict]:
    return {record["step"]: record for record in records}


def _assert_bit_equal(jobs, groups: tuple[int, int], steps, keys=("model", "optimizer")) -> int:
    """Every rank's digests equal between the two groups at every given step; returns how many steps compared."""
    compared = 0
    for rank in range(jobs.degree):
        left, right = (_by_step(jobs.records(g, rank)) for g in groups)
        for step in steps:
            for key in keys:
                assert left[step][key] == right[step][key], (rank, step, key)
            compared += 1
    return compared


def _kill_group_1_and_start_it_again(jobs, *extra: str, killed_group: int = 1) -> int:
    """Both groups train 60 slow steps; group 1 (``killed_group``) is SIGKILLed after 4, and started again once the
    survivor committed its next step, which must come within the heartbeat timeout + 5 s with none of the
    survivor's processes gone. Returns the killed group's last committed step before the kill."""
    survivor = 1 - killed_group
    for group in (0, 1):
        jobs.start(group, "--steps", "60", "--pause", "0.3", *extra)
    jobs.wait_for(lambda: len(jobs.records(1)) >= 4 and len(jobs.records(0)) >= 4, 120, "4 committed steps")
    last_before = jobs.records(killed_group)[-1]["step"]
    killed = jobs.kill(killed_group)
    jobs.wait_for(lambda: any(r["time"] > killed for r in jobs.records(survivor)), HEARTBEAT + 5 + 10,
                  "the survivor's next committed step")
    assert min(r["time"] for r in jobs.records(survivor) if r["time"] > killed) - killed <= HEARTBEAT + 5
    assert jobs.jobs[survivor].poll() is None  # no process of the survivor exited
    jobs.start(killed_group, "--steps", "60", "--pause", "0.3", *extra)
    return last_before


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fabric_groups_survive_a_killed_group_and_heal_it(tmp_path):
    with _jobs(tmp_path, FABRIC_SCRIPT) as jobs:
        last_before = _kill_group_1_and_start_it_again(jobs)
        jobs.wait_for(lambda: any(r["healed_at"] is not None and r["step"] > last_before + 2
                                  for r in jobs.records(1)), 120, "the restarted group's first committed step")
        assert jobs.wait(240) == {0: 0, 1: 0}, jobs.logs()
        healed = [r for r in jobs.records(1) if r["step"] > last_before and r["healed_at"] is not None]
        first = min(r["step"] for r in healed)
        assert healed[0]["healed_at"] == first - 1  # it received the state of the step it then committed
        # bit-equal from its first committed step to the end: shards, AdamW's state, the scheduler, the loop's counter
        steps = range(first, 61)
        assert _assert_bit_equal(jobs, (0, 1), steps, keys=("model", "optimizer", "lr", "iteration")) == 2 * len(steps)
        # and the survivor trained on alone between the kill and the heal: every step committed once, none lost (from
        # its first: a group that started after the other heals at its first step)
        steps = [r["step"] for r in jobs.records(0)]
        assert steps == list(range(steps[0], 61))
        _assert_logged_the_heal(jobs, last_before, first)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_groups_survive_a_killed_group_and_heal_it_at_the_peer_s_step_and_data(tmp_path):
    samples = 256  # 8 batches per rank and epoch: the restarted group heals several epochs in
    with _jobs(tmp_path, TRAINER_SCRIPT) as jobs:
        last_before = _kill_group_1_and_start_it_again(jobs, "--samples", str(samples))
        assert jobs.wait(240) == {0: 0, 1: 0}, jobs.logs()
        healed = [r for r in jobs.records(1) if r["step"] > last_before and r["healed_at"] is not None]
        first = min(r["step"] for r in healed)
        steps = range(first, 61)
        # shards, optimizer state, the scheduler's rate, global_step and the batch index within the epoch
        assert _assert_bit_equal(jobs, (0, 1), steps,
                                 keys=("model", "optimizer", "lr", "global_step", "epoch", "batch_idx"))
        assert _by_step(jobs.records(1))[first]["epoch"] >= 1  # (the peer was in a later epoch than the restart's 0)
        # the data: at every step, every rank of both groups read the batch its own part holds at that epoch and
        # index of the shuffled order (after the heal too: the peer's epoch, not the rest of the restart's epoch 0)
        for group in (0, 1):
            for rank in range(2):
                for record in jobs.records(group, rank):
                    if record["healed_at"] == record["step"] - 1:
                        continue  # (a heal's step: its batch was drawn before the heal, and contributed nothing)
                    expected = _first_sample(samples, 2 * group + rank, record["epoch"], record["batch_idx"])
                    assert record["sample"] == expected, (group, rank, record)
        survivor = jobs.records(0)
        steps = [r["step"] for r in survivor]
        assert [r["global_step"] for r in survivor] == steps == list(range(steps[0], 61))
        _assert_logged_the_heal(jobs, last_before, first)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_semi_synchronous_groups_survive_a_killed_group_that_heals_at_a_sync_with_the_outer_state(tmp_path):
    """replica_sync on torchft: group 0 (the first group, whose buffers the syncs carry) is SIGKILLed and started
    again from nothing, while the survivor syncs alone; the restarted group joins its peer's next sync without its
    own part, and heals at its own next sync after an optimizer step (the shards, AdamW's state, the loop's counters
    and data position, and the outer loop's synced copies and momentum). From then on both groups' parameters and
    BatchNorm statistics are bit-equal right after every sync and the outer state at every step, global steps
    aligned, to the end (a sync)."""
    every = 4
    with _jobs(tmp_path, TRAINER_SCRIPT) as jobs:
        _kill_group_1_and_start_it_again(jobs, "--every", str(every), "--norm", killed_group=0)
        assert jobs.wait(240) == {0: 0, 1: 0}, jobs.logs()
        restarted = _since_last_start(jobs.records(0))
        healed = [r for r in restarted if r["healed_at"] is not None]
        assert healed and restarted[0]["global_step"] == 1, jobs.logs()  # (it started from nothing)
        first = healed[0]["global_step"]
        assert first % every == 0  # (healed inside a sync, at the end of the optimizer step, as its peer)
        compared = 0
        for rank in range(jobs.degree):
            by_step = [{r["global_step"]: r for r in jobs.records(group, rank) if r["global_step"] >= first}
                       for group in (0, 1)]
            assert sorted(by_step[0]) == sorted(by_step[1]) == list(range(first, 61))
            for step in range(first, 61):
                left, right = by_step[0][step], by_step[1][step]
                assert left["outer"] == right["outer"], (rank, step)
                synced = step % every == 0
                assert (left["model"] == right["model"]) == synced, (rank, step)
                assert (left["buffers"] == right["buffers"]) == synced, (rank, step)
                compared += 1
        assert compared == 2 * (61 - first)
        # the survivor took every inner step once, through the outage (from its own last heal: with min_groups=1 a
        # group that asks for its first quorum before the other has started trains alone, and the later heals)
        survivor = jobs.records(1)
        steps = [r["global_step"] for r in survivor if r["healed_at"] == survivor[-1]["healed_at"]]
        assert steps == list(range(steps[0], 61)) and steps[0] < first - every
        # and its BatchNorm counted every batch: no sync ever gave it another group's statistics from behind, or none
        tracked = [r["tracked"] for r in survivor if r["global_step"] >= steps[0]]
        assert tracked == list(range(tracked[0], tracked[0] + len(tracked))), tracked


def _since_last_start(records: list[dict]) -> list[dict]:
    """A group's records from its job's last start (where its global step went back)."""
    starts = [i for i in range(1, len(records)) if records[i]["global_step"] <= records[i - 1]["global_step"]]
    return records[starts[-1] if starts else 0:]


def _logged(jobs, group: int) -> list[dict[str, float]]:
    """What group ``group``'s rank 0 logged of the replica groups (its CSV logger), a row per vote."""
    import csv

    versions = (jobs.out / "metrics" / f"group{group}").glob("version_*/metrics.csv")
    path = max(versions, key=lambda p: int(p.parent.name.split("_")[1]))  # (the last run of the group)
    with path.open() as f:
        return [{k.split("/")[-1]: float(v) for k, v in row.items() if k.startswith("fault_tolerance/") and v}
                for row in csv.DictReader(f) if row.get("fault_tolerance/committed")]


def _assert_logged_the_heal(jobs, last_before: int, healed_at: int) -> None:
    """The loggers show the outage and the heal: the survivor logged steps of one group while group 1 was gone and
    of two after the heal; the restarted group logged its heal (from group 0, at the step it then committed, with
    the transfer's seconds)."""
    survivor = {int(row["step"]): row for row in _logged(jobs, 0) if row["committed"] == 1}
    assert survivor[last_before + 2]["groups"] == 1 and survivor[60]["groups"] == 2, survivor
    heals = [row for row in _logged(jobs, 1) if "healed_from" in row]
    assert len(heals) >= 1 and heals[-1]["healed_from"] == 0 and heals[-1]["step"] == healed_at
    assert 0 < heals[-1]["heal_seconds"] < 10



@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_step_that_fails_in_one_group_is_committed_nowhere_and_changes_nothing(tmp_path):
    """Group 0's step 5 fails (an error reported to torchft, as a failed collective would): group 0 does not take part
    in the reduction across groups, so group 1's times out and neither commits. In both, global_step, the scheduler
    and the weights stay where they were, both run step 5 again, and they are bit-equal at every step."""
    with _jobs(tmp_path, TRAINER_SCRIPT, min_groups=2) as jobs:
        jobs.start(0, "--steps", "8", "--fail_at", "5")
        jobs.start(1, "--steps", "8")
        assert jobs.wait(200) == {0: 0, 1: 0}, jobs.logs()
        for group in (0, 1):
            for rank in range(2):
                lines = (jobs.out / f"group{group}_rank{rank}_uncommitted.jsonl").read_text().splitlines()
                assert [(u["global_step"], u["step"]) for u in map(json.loads, lines)] == [(4, 4)]
                records = jobs.records(group, rank)
                assert [r["global_step"] for r in records] == [r["step"] for r in records] == list(range(1, 9))
        assert _assert_bit_equal(jobs, (0, 1), range(1, 9), keys=("model", "optimizer", "lr", "global_step")) == 16


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_group_that_finds_no_live_peer_refuses_to_start_from_scratch(tmp_path):
    """(The Trainer's job; the check is the replica groups' session's, the same under Fabric.)"""
    with _jobs(tmp_path, TRAINER_SCRIPT) as jobs:
        jobs.start(0, "--steps", "3")
        assert jobs.wait(120) == {0: 0}, jobs.logs()
        jobs.start(1, "--steps", "3")  # the peer is gone: it would train from its own initialisation at step 0
        assert jobs.wait(120)[1] != 0
        assert not jobs.records(1)
        assert "found no live peer to heal from" in jobs.logs(60) and FaultToleranceError.__name__ in jobs.logs(60)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_parameter_one_rank_used_moves_in_every_group_and_one_nobody_used_never_moves(tmp_path):
    """DDP's rule across replica groups, with the unused-parameter notes reduced inside the gradients' all-reduce and
    the commit vote (not by a collective of their own): a head only group 0's rank 0 uses gets a gradient in both
    groups (they stay bit-equal, and it moves), a head no rank uses keeps ``.grad`` ``None`` (AdamW's weight decay
    would otherwise move it)."""
    with _jobs(tmp_path, FABRIC_SCRIPT, min_groups=2) as jobs:
        for group in (0, 1):
            jobs.start(group, "--steps", "5", "--unused")
        assert jobs.wait(200) == {0: 0, 1: 0}, jobs.logs()
        assert _assert_bit_equal(jobs, (0, 1), range(1, 6), keys=("model", "optimizer", "only_first")) == 10
        for group in (0, 1):
            for rank in range(2):
                records = jobs.records(group, rank)
                assert [r["step"] for r in records] == list(range(1, 6))
                assert all(r["never"] == r["never_before"] for r in records), (group, rank)
                assert len({r["only_first"] for r in records}) == 5, (group, rank)  # (it moved at every step)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_background_checkpoints_are_written_once_by_one_group(tmp_path):
    """async_save=True under fault tolerance: each checkpoint is written once, by one group, though both reached each
    save, with torchft's step recorded (whole-job restarts, and resumes with or without fault tolerance, are
    tests/test_fault_tolerance_parity.py's, against DDP)."""
    from lightning_smp.checkpoint import read_full
    from lightning_smp.checkpoint.format import REPLICA_GROUPS_KEY

    folder = tmp_path / "checkpoints"
    with _jobs(tmp_path, FABRIC_SCRIPT, min_groups=2) as jobs:
        for group in (0, 1):
            jobs.start(group, "--steps", "6", "--checkpoint", str(folder), "--async_save")
        assert jobs.wait(200) == {0: 0, 1: 0}, jobs.logs()
    assert sorted(p.name for p in folder.iterdir()) == ["step3", "step6"]
    full = read_full(folder / "step6")
    assert full[REPLICA_GROUPS_KEY]["step"] == 6 and full["iteration"] == 6


# ---------------------------------------------------------------------------------------------- the command line


def test_the_cli_lists_every_subcommand_and_takes_fault_tolerance_in_its_smp_section(capsys):
    from lightning_smp.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage == "usage: lightning-smp {fit,validate,test,predict,plan,lighthouse} ..."
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "examples" / "configs" / "hybrid_cpu.yaml"),
              '--smp.fault_tolerance={"lighthouse": "10.0.0.1:29510", "group": 1, "groups": 2}', "--print_config"])
    assert exit_info.value.code in (0, None)
    import yaml

    printed = yaml.safe_load(capsys.readouterr().out)["smp"]["fault_tolerance"]
    assert printed == {"lighthouse": "10.0.0.1:29510", "group": 1, "groups": 2}


@pytest.mark.timeout(60)
def test_lightning_smp_lighthouse_runs_until_stopped(tmp_path):
    import signal
    import subprocess
    import sys
    import urllib.request

    process = subprocess.Popen([sys.executable, "-m", "lightning_smp", "lighthouse", "--bind", "127.0.0.1:0",
                                "--heartbeat_timeout", "2"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("lightning-smp lighthouse: http://127.0.0.1:"), line
        address = line.split(": ", 1)[1].strip()
        with urllib.request.urlopen(f"{address}/status", timeout=10) as page:
            assert b"quorum" in page.read().lower()
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
    finally:
        process.kill()


# ---------------------------------------------------------------------------------------------- on the cluster harness

from lightning_smp.testing import cluster as harness  # noqa: E402

PROBLEM = harness.netadmin_problem()
needs_netadmin = pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")


@needs_netadmin
@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_accumulating_groups_cross_the_link_once_per_optimizer_step(tmp_path):
    """2 nodes, each node one replica group (FSDP2 at degree 2 on 2 ranks): what node 1 sends over the link per
    committed step, counted by the kernel, is one all-reduce of its ranks' gradients (their shards) across the groups
    (2 participants: each sends its buffer once), whether the step accumulates 1 or 4 micro-batches (the micro-batches
    before the last reduce inside the node only: FSDP2's deferred all-reduce). (The crossing is the session's, once
    per optimizer step on every engine; the DDP engine's accumulation under fault tolerance is held equal to DDP at
    every step by tests/test_fault_tolerance_parity.py.)"""
    from lightning_smp.testing.replica_groups import on_cluster

    degree = 2

    per_step = {}
    for accumulate in (1, 4):
        with harness.Cluster(2, harness.LinkShape(rate="1gbit")) as made:
            with on_cluster(made, FABRIC_SCRIPT, tmp_path / f"k{accumulate}", degree=degree, min_groups=2) as jobs:
                for group in (0, 1):
                    jobs.start(group, "--steps", "10", "--accumulate", str(accumulate), "--width", "2048")
                assert jobs.wait(400) == {0: 0, 1: 0}, jobs.logs()
                rows = jobs.records(1, 0)
                ranks = [jobs.records(1, r) for r in range(degree)]
                first, last = rows[2], rows[-1]  # (after the first steps: connections made, step-0 sync done)
                per_step[accumulate] = (last["tx"] - first["tx"]) / (last["step"] - first["step"])
                # each rank's flat buffer: its gradient shards and, per parameter (4 bytes each), one flag and (FSDP2)
                # the unused-parameter notes, one indicator per level above "unused"
                expected = sum(r[0]["grad_bytes"] + 4 * 4 * (1 + (3 if degree > 1 else 0)) for r in ranks)
                assert expected <= per_step[accumulate] <= 1.15 * expected, (accumulate, per_step, expected)
                assert _assert_bit_equal(jobs, (0, 1), range(1, 11)) == 10 * degree
    assert abs(per_step[4] / per_step[1] - 1) <= 0.05, per_step


@needs_netadmin
@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_a_group_cut_off_by_its_link_stops_committing_and_never_diverges(tmp_path):
    """The link between the nodes goes down (a pulled cable) while both groups train; the lighthouse sits on node 0.
    Node 0's group commits on alone once the cut-off group misses its heartbeats; node 1's group, which reaches
    neither the lighthouse nor its peer, commits no step from then on, and every step it did commit is node 0's."""
    from lightning_smp.testing.replica_groups import on_cluster

    with harness.Cluster(2, harness.LinkShape(rate="1gbit")) as made:
        with on_cluster(made, FABRIC_SCRIPT, tmp_path / "run", min_groups=1) as jobs:
            for group in (0, 1):
                jobs.start(group, "--steps", "400", "--pause", "0.2")
            jobs.wait_for(lambda: len(jobs.records(0)) >= 4 and len(jobs.records(1)) >= 4, 180, "4 steps each")
            made.cut("down")
            cut = time.time()
            jobs.wait_for(lambda: sum(r["time"] > cut for r in jobs.records(0)) >= 5, 60,
                          "node 0's group committing alone")
            time.sleep(3)  # (node 1's group would have committed by now, had it been able to)
            survivor = _by_step(jobs.records(0))
            for rank in range(2):
                ours = _by_step(jobs.records(0, rank))
                for record in jobs.records(1, rank):
                    if record["step"] not in ours:
                        # (min_groups=1: a group whose first quorum held it alone committed steps before the other
                        # joined, which then healed from it)
                        assert record["step"] < min(ours), record
                        continue
                    assert record["model"] == ours[record["step"]]["model"], record
            cut_off = jobs.records(1)
            assert all(r["step"] <= max(survivor) for r in cut_off)
            late = [r for r in cut_off if r["time"] > cut]
            assert len(late) <= 1  # at most the step whose vote was under way when the cable went


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_when_the_lighthouse_dies_every_group_stops_within_the_quorum_timeout_naming_it(tmp_path):
    """The job survives a group's death, not the lighthouse's: every group's next step finds no quorum, and every
    rank raises FaultToleranceError naming the lighthouse within quorum_timeout (+ a margin for the step in flight);
    no step is committed after it died."""
    import subprocess
    import sys

    from lightning_smp.fault_tolerance.lighthouse import Lighthouse
    from lightning_smp.testing.cluster import _ProcessServer

    process = subprocess.Popen([sys.executable, "-m", "lightning_smp", "lighthouse", "--bind", "127.0.0.1:0",
                                "--min_groups", "2", "--heartbeat_timeout", str(HEARTBEAT), "--quorum_tick", "0.05"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lighthouse = Lighthouse(_ProcessServer(process), process.stdout.readline().split(": ", 1)[1].strip())
    with _jobs(tmp_path, FABRIC_SCRIPT, lighthouse=lighthouse) as jobs:
        for group in (0, 1):
            jobs.start(group, "--steps", "400", "--pause", "0.2", "--quorum_timeout", "4")
        jobs.wait_for(lambda: len(jobs.records(0)) >= 4 and len(jobs.records(1)) >= 4, 120, "4 steps each")
        process.kill()
        died = time.time()
        last = {group: jobs.records(group)[-1]["step"] for group in (0, 1)}
        codes = jobs.wait(60)
        assert all(code not in (0, None) for code in codes.values()), codes
        assert time.time() - died <= 4 + 15
        assert {group: jobs.records(group)[-1]["step"] for group in (0, 1)} == last
        assert "FaultToleranceError" in jobs.logs(80) and "does not answer" in jobs.logs(80)


def test_the_average_across_groups_follows_ddp_for_parameters_some_group_did_not_use():
    """One group's flat buffer summed with another group's: a parameter both used gets the average; one only the
    other group used gets half of its gradient (this group counts as zeros, as a DDP rank that did not use it); one no
    group used keeps ``.grad`` ``None`` (FSDP2's DTensor parameters, so a gradient made here is laid out as one); the
    buffers are the sending group's, bit for bit, an integer buffer too."""
    from lightning_smp.testing import run_distributed

    assert run_distributed(_average_with_a_peer, 1) == [True]


def _average_with_a_peer(rank: int, world_size: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lightning_smp.fault_tolerance.flat import pack, unpack
    from lightning_smp.replicas import local_part

    model = torch.nn.Sequential(*(torch.nn.Linear(3, 3, bias=False) for _ in range(3)))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    both, peer, nobody = (layer.weight for layer in model)
    both.grad = DTensor.from_local(torch.full((3, 3), 2.0), both.device_mesh, both.placements)
    running, count = torch.zeros(4), torch.tensor(0)  # this group's buffers; the other group sends its own
    theirs_running, theirs_count = torch.tensor([0.1, -2.5, 3e-8, 7.0]), torch.tensor(2**40 + 3)
    mine = pack([both, peer, nobody], None, [running, count], sends_buffers=False, device=torch.device("cpu"))
    theirs = torch.cat([torch.full((9,), 4.0), torch.full((9,), 6.0), torch.zeros(9), torch.tensor([1.0, 1.0, 0.0]),
                        theirs_running, theirs_count.reshape(1).view(torch.uint8).float()])
    assert len(mine) == 1 and mine[0].flat.shape == theirs.shape
    mine[0].flat.add_(theirs)  # the sum across the two groups
    values = dict((id(b), v) for b, v in unpack(mine[0], 2, None))
    return (torch.equal(local_part(both.grad), torch.full((3, 3), 3.0)) and isinstance(peer.grad, DTensor)
            and torch.equal(local_part(peer.grad), torch.full((3, 3), 3.0)) and nobody.grad is None
            and torch.equal(values[id(running)], theirs_running) and torch.equal(values[id(count)], theirs_count))


def test_the_commit_vote_is_one_all_reduce_over_the_group_that_carries_the_unused_parameter_notes():
    """The vote inside a replica group (2 ranks): a step commits only if every rank votes to; the notes come back as
    every rank's maximum; a note that some rank's gradient is missing refuses the step on every rank alike."""
    from lightning_smp.testing import run_distributed

    assert run_distributed(_votes, 2) == [[(True, [1, 1, 0]), (False, [1, 1, 0]), (False, [2, 1, 0])]] * 2


def _votes(rank: int, world_size: int) -> list:
    from datetime import timedelta

    from lightning_smp.engines.unused import UNUSED, USED, USED_WITHOUT_GRAD, Unreduced
    from lightning_smp.fault_tolerance.vote import GroupVote

    vote = GroupVote(client=None, device=torch.device("cpu"))
    mine = {0: [USED, UNUSED, UNUSED], 1: [UNUSED, USED, UNUSED]}[rank]
    outcomes = []
    for commit, missing in ((True, False), (rank == 0, False), (True, rank == 1)):
        levels = [USED_WITHOUT_GRAD, *mine[1:]] if missing else mine
        vote.notes = Unreduced([], torch.tensor(levels, dtype=torch.uint8))
        decided = vote.should_commit(rank, 0, commit, timedelta(seconds=30))
        assert vote.levels is not None
        outcomes.append((decided, vote.levels.tolist()))
    return outcomes


@pytest.mark.parametrize(("installed", "match"), [
    (None, "torchft is not installed"),
    ("0.3.0", "torchft 0.3.0 is installed"),
])
def test_a_torchft_other_than_the_pinned_one_is_refused_naming_both(installed, match):
    """The library reaches into torchft's Manager (its commit vote's client, the quorum's id): another release is
    refused when the strategy is set up, naming the one it needs and the extra that installs it; the pin in
    pyproject.toml's ``ft`` extra is the same."""
    import tomllib

    from lightning_smp.config.fault_tolerance import TORCHFT_VERSION, check_torchft

    with pytest.raises(HybridShardConfigError, match=match) as info:
        check_torchft(installed)
    assert f"torchft=={TORCHFT_VERSION}" in str(info.value) and "lightning-smp[ft]" in str(info.value)
    check_torchft(TORCHFT_VERSION)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["ft"] == [f"torchft=={TORCHFT_VERSION}"]


def _documented_launch() -> dict[str, str]:
    """docs/fault-tolerance.md's launch lines, by their ``<!-- launch: NAME -->`` marker: the bash block below each."""
    lines = (REPO / "docs" / "fault-tolerance.md").read_text().splitlines()
    found = {}
    for index, line in enumerate(lines):
        if line.strip().startswith("<!-- launch:"):
            name = line.strip()[len("<!-- launch:"):-len("-->")].strip()
            assert lines[index + 1].strip() == "```bash", name
            end = next(i for i in range(index + 2, len(lines)) if lines[i].strip() == "```")
            found[name] = "\n".join(lines[index + 2:end])
    return found


@needs_netadmin
@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_the_documented_launch_trains_across_two_hosts(tmp_path):
    """docs/fault-tolerance.md's command lines as written (torchrun without --master-addr, torchft's variables, the CLI
    with the example config), only the lighthouse's address replaced by node 0's and its ``--min_groups 1`` by 2, on
    two nodes of the cluster harness: the lighthouse in node 0, group g in node g. (With 1, a group whose start on a
    loaded machine comes later than the other's 8 steps only heals at the last one, which is fault tolerance working,
    not the crossing this test holds.) Both groups train every step together: each logs, through the example config's
    CSV logger, 2 groups in every committed step, and the last step committed everywhere."""
    import csv
    import os
    import subprocess
    import sys

    launch = _documented_launch()
    assert sorted(launch) == ["group 0", "group 1", "lighthouse"]
    with harness.Cluster(2, harness.LinkShape(rate="1gbit")) as made:
        address = made.nodes[0].address
        env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        assert "--min_groups 1" in launch["lighthouse"]
        line = launch["lighthouse"].replace("10.0.0.1", address).replace("--min_groups 1", "--min_groups 2")
        lighthouse = made.popen(0, ["bash", "-c", line], env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert lighthouse.stdout is not None and lighthouse.stdout.readline().startswith("lightning-smp lighthouse:")
        jobs = []
        for group in (0, 1):
            where = tmp_path / f"node{group}"
            where.mkdir()
            (where / "examples").symlink_to(REPO / "examples")  # (the lines name the config relative to the checkout)
            log = (where / "log.txt").open("w")
            jobs.append(made.popen(group, ["bash", "-c", launch[f"group {group}"].replace("10.0.0.1", address)], env,
                                   cwd=where, stdout=log, stderr=subprocess.STDOUT))
        codes = [job.wait(300) for job in jobs]
        logs = "\n".join(f"--- group {g} ---\n" + "\n".join(
            line for line in (tmp_path / f"node{g}" / "log.txt").read_text().splitlines()[-30:] if "[INFO]" not in line)
            for g in (0, 1))
        assert codes == [0, 0], logs
    for group in (0, 1):
        with (tmp_path / f"node{group}" / "lightning_logs" / "version_0" / "metrics.csv").open() as f:
            rows = [row for row in csv.DictReader(f) if row.get("fault_tolerance/committed")]
        committed = [row for row in rows if float(row["fault_tolerance/committed"]) == 1]
        assert [int(float(row["fault_tolerance/step"])) for row in committed][-1] == 8, (group, rows)
        groups = [int(float(row["fault_tolerance/groups"])) for row in committed]
        assert groups == [2] * len(committed), (group, groups)


# ---------------------------------------------------------------------------------------------- addresses and give-up


@pytest.mark.parametrize(("host", "lighthouse", "match"), [
    pytest.param("node-a", "10.0.0.1:29510", "host='node-a' is not an IP address", id="not_an_address"),
    pytest.param("192.0.2.77", "10.0.0.1:29510", "192.0.2.77 is not one of this machine's", id="not_this_machine"),
    pytest.param("127.0.0.1", "10.0.0.1:29510", "host=127.0.0.1 is a loopback address, but the lighthouse", id="loopback"),
])
def test_an_address_the_other_groups_cannot_reach_is_refused_at_setup_naming_it(host, lighthouse, match):
    from lightning_smp.fault_tolerance.transport import check_host

    with pytest.raises(FaultToleranceError, match=match) as info:
        check_host(host, 1, f"http://{lighthouse}")
    assert "replica group 1" in str(info.value) and "Fix:" in str(info.value)
    check_host("127.0.0.1", 1, "http://127.0.0.1:29510")  # (every group on this machine: loopback is right)


def test_a_store_that_does_not_answer_at_the_group_s_address_is_refused_naming_it():
    from lightning_smp.fault_tolerance.transport import check_store
    from lightning_smp.testing import free_port

    port = free_port()
    with pytest.raises(FaultToleranceError, match=f"does not answer at 127.0.0.1:{port}.*--master-addr 127.0.0.1"):
        check_store("127.0.0.1", port, 0, timeout=1.0)


def _watch_the_status_page(rank: int, world: int) -> None:
    from datetime import timedelta

    from torchft._torchft import LighthouseClient

    from lightning_smp.fault_tolerance.crossing import LighthouseWatch
    from lightning_smp.fault_tolerance.lighthouse import start_lighthouse

    lighthouse = start_lighthouse("127.0.0.1:0", heartbeat_timeout=1.0)
    try:
        client = LighthouseClient(lighthouse.address, timedelta(seconds=5))
        client.heartbeat("group0:a")
        client.heartbeat("group1:b")
        watch = LighthouseWatch(lighthouse.address)
        assert watch.silent(["group0:a", "group1:b"]) == []
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            client.heartbeat("group1:b")
            time.sleep(0.1)
        assert watch.silent(["group0:a", "group1:b", "group2:c"]) == ["group0:a", "group2:c"]
    finally:
        lighthouse.shutdown()
    assert LighthouseWatch("http://127.0.0.1:9", timeout=0.5).silent(["group0:a"]) == []


@pytest.mark.timeout(60)
def test_the_watch_reads_which_groups_the_lighthouse_stopped_hearing_from():
    """The lighthouse's own status page (torchft 0.2.0's): a group whose heartbeats stopped for the heartbeat timeout
    is silent, one that heartbeats is not, one the lighthouse never heard of is silent; no lighthouse, no verdict.
    (In a forked process: torchft's runtime threads must not run in the one the other tests fork their ranks from.)"""
    run_distributed(_watch_the_status_page, 1)


def _failing_group(group: int, rank: int, degree: int, lighthouse: str) -> str:
    """A Fabric loop that reports an error to torchft in every step from the third on (a collective that keeps
    failing, in every group): returns the error that ended this rank."""
    import lightning as L

    from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy

    strategy = FabricStrategy(hybrid_shard_degree=degree, fsdp_version=2, fault_tolerance={
        "lighthouse": lighthouse, "group": group, "groups": 2, "min_groups": 2, "timeout": 2.0, "quorum_timeout": 4.0})
    fabric = L.Fabric(accelerator="cpu", devices=degree, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(torch.nn.Linear(4, 2))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    replicas = strategy.replica_groups
    try:
        for _ in range(40):
            fabric.backward(model(torch.ones(2, 4)).sum())
            if replicas.step >= 2:
                replicas.manager.report_error(RuntimeError("injected: the collective failed"))
            optimizer.step()
            optimizer.zero_grad()
    except Exception as err:  # noqa: BLE001  # (what the test asserts)
        return str(err) if isinstance(err, FaultToleranceError) else f"{type(err).__name__}: {err}"
    return f"no error after {replicas.step} steps"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_steps_that_keep_failing_end_every_rank_naming_the_group_the_address_and_the_operation():
    """Every group's steps fail from the third on (as when the groups cannot reach each other): none commits again,
    and after quorum_timeout (4 s, two failed steps or more) every rank raises FaultToleranceError instead of warning
    forever: naming its group, its address and store, where the groups meet and what failed last; or, in a group that
    was a vote behind when the other gave up, that the lighthouse answers but too few groups are left (min_groups=2)."""
    from lightning_smp.testing.replica_groups import run_replica_groups

    messages = run_replica_groups(_failing_group, 2, 2)
    gave_up = 0
    for group, ranks in enumerate(messages):
        kinds = {"no quorum" in message for message in ranks}
        assert len(kinds) == 1, ranks  # (every rank of a group alike)
        for message in ranks:
            if "no quorum" in message:
                assert f"answers and hears from group{1 - group:04d}" not in message and "min_groups=2" in message
                continue
            gave_up += 1
            assert message.startswith(f"replica group {group}: no step committed for more than quorum_timeout=4 s")
            assert "This rank is reached at 127.0.0.1 (its group's store at 127.0.0.1:" in message
            assert "its groups meet at 127.0.0.1:" in message and "The last failure: " in message
    assert gave_up >= 2, messages


def test_the_start_s_fingerprint_sees_values_that_moved_and_constants_an_xor_would_cancel():
    from lightning_smp.fault_tolerance.start import fingerprints

    base = torch.arange(12.0).reshape(3, 4)
    same = fingerprints([("w", base.clone())])
    assert fingerprints([("w", base)]) == same
    assert fingerprints([("w", base.flip(0))])[0] != same[0]  # (the same values, rows swapped)
    assert fingerprints([("b", torch.full((4,), 1.0))])[0] != fingerprints([("b", torch.full((4,), 2.0))])[0]
    assert fingerprints([("w", base.reshape(4, 3))])[1] != same[1]  # (another shape: another structure)


def test_a_wrapped_accelerator_work_is_asked_whether_it_ended_through_the_one_it_wraps():
    """torchft wraps an NCCL/XCCL work in a Python Work whose own ``is_completed()`` is always False: the crossing
    asks the work it wraps, and does not spin until its timeout."""
    from lightning_smp.fault_tolerance.crossing import wait_for_crossing

    class Ended:
        def is_completed(self) -> bool:
            return True

    class Wrapper:
        _work = Ended()

        def is_completed(self) -> bool:
            return False

        def wait(self, timeout=None) -> bool:
            return True

    started = time.monotonic()
    assert wait_for_crossing(Wrapper(), object(), verdict=lambda: None, timeout=5.0).completed
    assert time.monotonic() - started < 1.0
