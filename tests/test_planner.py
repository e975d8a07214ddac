"""The planner's model-state prediction (lightning_smp.planner) against what each rank really holds, byte for byte,
for both engines, several degrees and models (tied and frozen parameters, wrapped blocks)."""

from __future__ import annotations

import pytest
import torch

from lightning_smp import HybridShardConfigError, HybridShardFSDPStrategy, MemorySavingsCallback
from lightning_smp.planner import model_state, optimizer_state_layout
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
    for plan, record in zip(planned, measured, strict=True):
        assert (plan.params_bytes, plan.grads_bytes, plan.optimizer_bytes) == (
            record["params_bytes"], record["grads_bytes"], record["optimizer_bytes"]), plan.rank
        assert plan.total_bytes == record["total_bytes"]


def test_optimizer_state_layouts():
    net = torch.nn.Linear(2, 2)
    assert optimizer_state_layout(torch.optim.AdamW(net.parameters())) == (2, 4)
    assert optimizer_state_layout(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)) == (1, 0)
    assert optimizer_state_layout(torch.optim.SGD(net.parameters(), lr=0.1)) == (0, 0)
    with pytest.raises(HybridShardConfigError, match="optimizer='lion' is not one the planner knows"):
        optimizer_state_layout("lion")
