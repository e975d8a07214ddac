"""The DDP engine: which layouts and arguments run on it, what it is told, and a fourth engine registered like it
(the distributed behaviour of degree 1 is tested wherever the other degrees are: parity, clipping, accumulation,
replicas, the report, checkpoints between engines, manual optimization)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from lightning.pytorch import Callback
from torch.distributed.fsdp import CPUOffload, MixedPrecision

import lightning_smp.engines as engines
from lightning_smp import HybridShardConfigError, HybridShardFSDPStrategy
from lightning_smp.degree import resolve_layout
from lightning_smp.engines import DDP_ENGINE, engine_for, engine_for_layout, options_for
from lightning_smp.engines.ddp.prediction import DDPPrediction
from lightning_smp.engines.fsdp2.engine import FSDP2Engine
from lightning_smp.engines.fsdp2.prediction import FSDP2Prediction
from lightning_smp.planner.state import model_state
from lightning_smp.testing import run_distributed
from tests.helpers import (
    FSDP_VERSIONS,
    PARITY_BOUND,
    assert_matches_ddp,
    cpu_trainer,
    ddp_fit,
    fit_and_record,
    weights_of,
)

WORLD = 4


@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_nothing_sharded_runs_on_ddp_whatever_the_fsdp_version(version):
    fsdp = engine_for(version)
    for degree in (1, 2, 4):
        layout = resolve_layout(WORLD, degree)
        assert engine_for_layout(version, layout) is (DDP_ENGINE if degree == 1 else fsdp)
    # a shard group of one rank also shards nothing: degree 0 (native HYBRID_SHARD) with one device per node
    native = resolve_layout(WORLD, 0, devices_per_node=1)
    assert native.shard == 1 and engine_for_layout(version, native) is DDP_ENGINE
    assert engine_for_layout(version, None) is fsdp  # "auto" before the planner has chosen


def test_arguments_that_only_fsdp_honours_keep_fsdp_no_shard():
    layout = resolve_layout(WORLD, 1)
    sharding_only = {"auto_wrap_policy": {torch.nn.Linear}, "limit_all_gathers": True, "use_orig_params": True,
                     "find_unused_parameters": False}
    assert engine_for_layout(1, layout, options=sharding_only) is DDP_ENGINE
    fsdp1 = engine_for(1)
    assert engine_for_layout(1, layout, cpu_offload=CPUOffload(offload_params=True)) is fsdp1
    assert engine_for_layout(1, layout, cpu_offload=True) is fsdp1
    assert engine_for_layout(1, layout, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)) is fsdp1
    for meaningful in ({"use_orig_params": False}, {"ignored_modules": []}, {"process_group": None},
                       {"param_init_fn": lambda m: None}):
        assert engine_for_layout(1, layout, options=meaningful) is fsdp1, meaningful


def test_ddp_s_own_argument_reaches_ddp_only():
    options = {"find_unused_parameters": False, "limit_all_gathers": True}
    assert options_for(DDP_ENGINE, options) == options
    for version in (1, 2):
        assert options_for(engine_for(version), options) == {"limit_all_gathers": True}


@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_the_strategy_reports_the_engine_that_runs_and_the_version_configured(tmp_path, version):
    one = HybridShardFSDPStrategy(hybrid_shard_degree=1, fsdp_version=version, start_method="fork")
    cpu_trainer(one, tmp_path, WORLD)
    assert (one.engine.name, one.fsdp_version) == ("ddp", version)
    # the accumulation default stays the configured engine's (without shards, defer_all_reduce is DDP's no_sync)
    assert one.gradient_accumulation == engine_for(version).capabilities.accumulations[0]
    two = HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=version, start_method="fork")
    cpu_trainer(two, tmp_path, WORLD)
    assert (two.engine.name, two.fsdp_version) == (f"fsdp{version}", version)


def test_the_planner_predicts_degree_1_whole_and_never_gathered():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.Linear(7, 3))
    numels = [p.numel() for p in model.parameters()]
    for state in model_state(model, world_size=WORLD, hybrid_shard_degree=1):
        # Adam: two fp32 tensors per element and a 4-byte step per parameter; no FSDP padding
        assert (state.params_bytes, state.grads_bytes, state.optimizer_bytes) == (
            4 * sum(numels), 4 * sum(numels), 8 * sum(numels) + 4 * len(numels))
    # with the parameters on the CPU (FSDP's offload), degree 1 stays FSDP's NO_SHARD, whose flat parameter pads
    offloaded = model_state(model, world_size=WORLD, hybrid_shard_degree=1, cpu_offload=True)
    assert offloaded[0].params_bytes > 4 * sum(numels)
    prediction = DDPPrediction()
    assert prediction.gathered_bytes([100, 200], 50, zero2=False, unsharded=True) == 0
    layout = resolve_layout(WORLD, 1)
    figure = prediction.step_textbook([list(model.parameters())], layout, micro_batches=4, accumulation="no_sync",
                                      precision="32-true")
    # one bucket of every gradient and the 4-byte-per-parameter bitmap, once per optimizer step; nothing sharded
    assert figure["replicate"]["all_reduce"]["count"] == 2
    assert figure["replicate"]["all_reduce"]["bytes"] == 4 * sum(numels) + 4 * len(numels)
    assert all(entry["count"] == 0 for entry in figure["shard"].values())
    every = prediction.step_textbook([list(model.parameters())], layout, micro_batches=4,
                                     accumulation="every_micro_batch", precision="32-true")
    assert every["replicate"]["all_reduce"]["bytes"] == 4 * figure["replicate"]["all_reduce"]["bytes"]


class _GatheredPrediction(FSDP2Prediction):
    """FSDP2's layout rules, every unit held gathered from its forward to its backward (ZeRO-2's peak)."""

    asked = False

    def gathered_bytes(self, unit_bytes, root_bytes, zero2, unsharded):
        type(self).asked = True
        return super().gathered_bytes(unit_bytes, root_bytes, True, unsharded)


class _GatheredEngine(FSDP2Engine):
    """A fourth engine, added as docs/architecture.md's recipe says: a class implementing ``Engine`` (FSDP2 whose units
    keep their parameters gathered from forward to backward under every sharding strategy, as ZeRO-2 does), its own
    ``Capabilities`` (every micro-batch reduced; no fault tolerance) and ``Prediction``, and
    ``engines.register``. Nothing of the library is edited or patched: ``fsdp_version=3`` selects it."""

    name = "fsdp2_gathered"
    version = 3
    capabilities = dataclasses.replace(FSDP2Engine.capabilities, accumulations=("every_micro_batch",),
                                       fault_tolerance=False)
    prediction = _GatheredPrediction()

    def shard_kwargs(self, plan):
        return {**super().shard_kwargs(plan), "reshard_after_forward": False}

    def wrap(self, module, plan):
        module = super().wrap(module, plan)
        module.wrapped_by_gathered_engine = True  # what it wrapped, told apart from FSDP2's own models
        return module

    def has_wrapped(self, module):
        return super().has_wrapped(module) and any(getattr(m, "wrapped_by_gathered_engine", False)
                                                   for m in module.modules())


def _engine_of_a_plain_fully_shard_model(rank, world):
    from torch.distributed.fsdp import fully_shard

    from lightning_smp.engines import engine_of

    return engine_of(fully_shard(torch.nn.Linear(4, 4))).name


class _EngineProbe(Callback):
    """What each rank's strategy runs, and what its model's units do after a forward (gathered or resharded)."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx:
            return
        from lightning_smp.engines import engine_of

        (self.folder / f"probe{trainer.global_rank}.json").write_text(json.dumps({
            "engine": trainer.strategy.engine.name, "found": engine_of(trainer.strategy.model).name,
            "gathered_after_forward": self._gathered(trainer, pl_module)}))

    @staticmethod
    def _gathered(trainer, pl_module):
        # a forward without backward: a unit below the root whose reshard_after_forward is False keeps its
        # parameters gathered (plain tensors, not DTensor shards) until its next backward or reshard()
        with torch.no_grad():
            pl_module(torch.zeros(1, 16))
        gathered = not any(hasattr(p, "to_local") for p in pl_module.net[0].parameters())
        for unit in pl_module.modules():
            if hasattr(unit, "reshard"):
                unit.reshard()
        return gathered


@pytest.fixture
def registered():
    """engines.register's effect undone after the test."""
    yield engines.register
    for engine in [e for e in engines.ENGINES if isinstance(e, _GatheredEngine)]:
        engines.unregister(engine)


def test_a_fourth_engine_needs_only_its_class_and_its_registration(tmp_path, registered):
    from lightning_smp.callbacks import MemorySavingsCallback
    from lightning_smp.planner import plan

    fourth = registered(_GatheredEngine())
    assert registered(_GatheredEngine()) is not fourth and engines.engine_for(3).name == "fsdp2_gathered"  # again
    fourth = engines.engine_for(3)
    # asked first, it claims only what it wrapped: a model sharded with fully_shard stays FSDP2's
    assert run_distributed(_engine_of_a_plain_fully_shard_model, 1) == ["fsdp2"]
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=3, start_method="fork",
                                       auto_wrap_policy={torch.nn.Linear})
    report = MemorySavingsCallback(print_table=False, filename=tmp_path / "report.json")
    _, model, records = fit_and_record(strategy, tmp_path, WORLD, callbacks=[report, _EngineProbe(tmp_path)])
    assert strategy.engine is fourth
    # every rank ran it, engine_of found it (before FSDP2, whose models it also wraps), and its own wrap ran
    probes = [json.loads((tmp_path / f"probe{rank}.json").read_text()) for rank in range(WORLD)]
    assert probes == [{"engine": "fsdp2_gathered", "found": "fsdp2_gathered", "gathered_after_forward": True}] * WORLD
    # the front end, the core, the precision plugin and the report reached it through the registry alone: every
    # rank trained as Lightning's DDP does, and the report read its accounting (FSDP2's: half the model per rank)
    ddp_losses, ddp_weights = ddp_fit()
    assert max(abs(a - b) for a, b in zip(records[0]["losses"], ddp_losses)) <= PARITY_BOUND
    assert_matches_ddp(weights_of(model), ddp_weights)
    ranks = json.loads((tmp_path / "report.json").read_text())["reports"]["first_step"]
    assert len(ranks) == WORLD and all(rank["params_bytes"] < rank["unsharded_total_bytes"] for rank in ranks)
    # the planner asked its own prediction
    with torch.device("meta"):
        planned = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.Linear(7, 3))
    _GatheredPrediction.asked = False
    plan(planned, world_size=WORLD, budget_bytes="1GB", degrees=[2], fsdp_version=3)
    assert _GatheredPrediction.asked
    # every message that names an fsdp_version reads its Capabilities, every configuration source takes its version
    with pytest.raises(HybridShardConfigError, match=r"no_sync.*Fix:.*fsdp_version=1 or fsdp_version=2"):
        HybridShardFSDPStrategy(fsdp_version=3, gradient_accumulation="no_sync")
    refused = HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=3, start_method="fork",
                                      fault_tolerance={"lighthouse": "localhost:1", "group": 0, "groups": 2})
    with pytest.raises(HybridShardConfigError, match=r"does not run on the fsdp2_gathered engine.*Fix: pass"
                                                     r" fsdp_version=2\.$"):
        cpu_trainer(refused, tmp_path, 2)
    with pytest.raises(HybridShardConfigError, match=r"fsdp_version=4 is not an FSDP version. Valid values: 1, 2, 3 "
                                                     r"\(.*3: the fsdp2_gathered engine\)"):
        HybridShardFSDPStrategy(fsdp_version=4)
    # a name or a version another engine has is refused, and the library's own engines stay
    with pytest.raises(HybridShardConfigError, match="engine 'fsdp2' has that name"):
        registered(type("Other", (_GatheredEngine,), {"name": "fsdp2", "version": 5})())
    clashing = _GatheredEngine()
    clashing.version = 1  # the same class again, with FSDP1's version
    with pytest.raises(HybridShardConfigError, match="engine 'fsdp1' has that version"):
        registered(clashing)
    assert engines.engine_for(3) is fourth  # a refused registration changes nothing
    with pytest.raises(HybridShardConfigError, match="the fsdp2 engine is the library's own"):
        engines.unregister(engines.engine_for(2))

