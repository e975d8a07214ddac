"""The DDP engine: which layouts and arguments run on it, what it is told, and a fourth engine registered like it
(the distributed behaviour of degree 1 is tested wherever the other degrees are: parity, clipping, accumulation,
replicas, the report, checkpoints between engines, manual optimization)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.fsdp import CPUOffload, MixedPrecision

from lightning_smp import HybridShardFSDPStrategy
from lightning_smp.degree import resolve_layout
from lightning_smp.engines import DDP_ENGINE, engine_for, engine_for_layout, options_for
from lightning_smp.engines.ddp.engine import DDPEngine
from lightning_smp.engines.ddp.prediction import DDPPrediction
from lightning_smp.planner.state import model_state
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


class _ReplicaPrediction(DDPPrediction):
    asked = False

    def step_textbook(self, *args, **kwargs):
        type(self).asked = True
        return super().step_textbook(*args, **kwargs)


class _ReplicaEngine(DDPEngine):
    """A fourth engine as docs/architecture.md describes adding one: a class implementing ``Engine`` (DDP's, under
    another name, with its own ``Prediction``), its entry in ``engines.ENGINES`` and its rule in
    ``engines.engine_for_layout`` (here: the layouts that shard nothing). Nothing outside ``engines/`` is edited."""

    name = "replica"
    prediction = _ReplicaPrediction()


def test_a_fourth_engine_needs_only_its_class_and_its_registration(tmp_path, monkeypatch):
    import lightning_smp.engines as engines
    from lightning_smp.callbacks import MemorySavingsCallback
    from lightning_smp.planner import plan

    fourth = _ReplicaEngine()
    # the registration: engine_for_layout's rule returns engines.DDP_ENGINE for a layout that shards nothing
    monkeypatch.setattr(engines, "DDP_ENGINE", fourth)
    monkeypatch.setattr(engines, "ENGINES", (*engines.FSDP_ENGINES, fourth))
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=1, start_method="fork")
    report = MemorySavingsCallback(print_table=False, filename=tmp_path / "report.json")
    _, model, records = fit_and_record(strategy, tmp_path, WORLD, callbacks=[report])
    assert strategy.engine is fourth and strategy.engine.name == "replica"
    # the front end, the core, the precision plugin and the report reached it through the registry alone: every
    # rank trained as Lightning's DDP does, and the report read its accounting
    ddp_losses, ddp_weights = ddp_fit()
    assert max(abs(a - b) for a, b in zip(records[0]["losses"], ddp_losses)) <= PARITY_BOUND
    assert_matches_ddp(weights_of(model), ddp_weights)
    ranks = json.loads((tmp_path / "report.json").read_text())["reports"]["first_step"]
    assert len(ranks) == WORLD
    for rank in ranks:  # the whole model on every rank, its gradients read through the engine's accounting
        assert rank["total_bytes"] == rank["unsharded_total_bytes"] and rank["measured_over_floor"] == 1.0
        assert rank["grads_bytes"] == rank["params_bytes"] > 0
    # and the planner asked the fourth engine's own prediction for degree 1
    with torch.device("meta"):
        planned = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.Linear(7, 3))
    _ReplicaPrediction.asked = False
    plan(planned, world_size=WORLD, budget_bytes="1GB", degrees=[1])
    assert _ReplicaPrediction.asked
