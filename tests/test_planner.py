"""The planner's model-state prediction (lightning_smp.planner) against what each rank really holds, byte for byte,
for both engines, several degrees and models (tied and frozen parameters, wrapped blocks)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_smp import HybridShardConfigError, HybridShardFSDPStrategy, MemorySavingsCallback
from lightning_smp.planner import model_state, optimizer_state_layout, plan
from tests.helpers import GLOO_TIMEOUT, TinyModel, cpu_trainer, make_loader
from tests.test_fsdp2 import FeatureModel, LoRABlock, token_loader

WORLD = 4
MODELS = {
    "tiny_adam": (TinyModel, make_loader, None, "adam"),
    "features_sgd_momentum": (FeatureModel, token_loader, {LoRABlock}, "sgd_momentum"),
}


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("model_key", sorted(MODELS))
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("degree", [1, 2, 4])
def test_predicted_model_state_equals_the_measured_one(tmp_path, model_key, version, degree):
    cls, loader, policy, optimizer = MODELS[model_key]
    with torch.device("meta"):  # planning builds nothing
        planned = model_state(cls(), world_size=WORLD, hybrid_shard_degree=degree, fsdp_version=version,
                              auto_wrap_policy=policy, optimizer=optimizer)
    callback = MemorySavingsCallback(print_table=False, filename=None)
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=version, start_method="fork",
                                       auto_wrap_policy=policy)
    torch.manual_seed(0)
    cpu_trainer(strategy, tmp_path, WORLD, max_steps=1, callbacks=[callback]).fit(cls(), loader())
    measured = callback.reports["first_step"]
    for state, record in zip(planned, measured, strict=True):
        assert (state.params_bytes, state.grads_bytes, state.optimizer_bytes) == (
            record["params_bytes"], record["grads_bytes"], record["optimizer_bytes"]), state.rank
        assert state.total_bytes == record["total_bytes"]
    if degree == 2:  # (an axis spanning the world also carries Lightning's own reductions: compare the hybrid case)
        from lightning_smp.names import REPLICATE_AXIS, SHARD_AXIS


        with torch.device("meta"):
            row = plan(cls(), world_size=WORLD, budget_bytes=10**12, fsdp_version=version,
                       auto_wrap_policy=policy, optimizer=optimizer).row(degree)
        for record in measured:
            assert row.shard_bytes == sum(e["bytes"] for e in record["comm"][SHARD_AXIS].values())
            assert row.replicate_bytes == sum(e["bytes"] for e in record["comm"][REPLICATE_AXIS].values())


def test_optimizer_state_layouts():
    net = torch.nn.Linear(2, 2)
    assert optimizer_state_layout(torch.optim.AdamW(net.parameters())) == (2, 4)
    assert optimizer_state_layout(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)) == (1, 0)
    assert optimizer_state_layout(torch.optim.SGD(net.parameters(), lr=0.1)) == (0, 0)
    with pytest.raises(HybridShardConfigError, match="optimizer='lion' is not one the planner knows"):
        optimizer_state_layout("lion")


def test_the_smallest_fitting_degree_is_recommended_on_both_sides_of_each_threshold():


    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    peaks = {r.degree: r.peak_bytes for r in plan(model, world_size=8, budget_bytes=10**12,
                                                  auto_wrap_policy={torch.nn.Linear}).rows}
    assert list(peaks) == [1, 2, 4, 8] and peaks[1] > peaks[2] > peaks[4] > peaks[8]
    for degree in (1, 2, 4, 8):
        # a budget just large enough for this degree (with 10% headroom) picks it; a byte less picks the next
        budget = math.ceil(peaks[degree] * 1.1)
        chosen = plan(model, world_size=8, budget_bytes=budget, auto_wrap_policy={torch.nn.Linear})
        assert chosen.degree == degree and chosen.reason.startswith(f"degree {degree} is the smallest that fits")
        if degree < 8:
            below = plan(model, world_size=8, budget_bytes=budget - 2, auto_wrap_policy={torch.nn.Linear})
            assert below.degree > degree
    with pytest.raises(HybridShardConfigError, match="no hybrid_shard_degree fits memory_budget=1000 bytes"):
        plan(model, world_size=8, budget_bytes=1000)


def test_accumulation_costs_in_the_plan():


    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    kwargs = {"world_size": 4, "budget_bytes": 10**12, "auto_wrap_policy": {torch.nn.Linear}, "micro_batches": 4}
    fsdp1 = {r.degree: r for r in plan(model, fsdp_version=1, **kwargs).rows}
    fsdp2 = {r.degree: r for r in plan(model, fsdp_version=2, **kwargs).rows}
    full = sum(p.numel() * 4 for p in model.parameters())
    # FSDP1 no_sync holds the unsharded gradient on top; FSDP2 a 1/degree partial buffer
    assert fsdp1[2].transient_bytes - fsdp2[2].transient_bytes == full - full // 2
    # both cross the replicas once per optimizer step
    assert fsdp1[2].replicate_bytes == fsdp2[2].replicate_bytes > 0
