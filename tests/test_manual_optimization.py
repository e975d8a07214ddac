"""Manual optimization (``automatic_optimization = False``): one or several backward passes and optimizer steps inside
``training_step``, as in a GAN. FSDP2 equals DDP, and so does degree 1 (the DDP engine) under either version; FSDP1,
which runs the step inside its root's forward and cannot run
a backward there (Lightning's FSDPStrategy fails alike, pytorch-lightning#19685), refuses before any step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_smp import HybridShardFSDPStrategy, UnsupportedOptionError
from tests.helpers import FSDP_VERSIONS, GLOO_TIMEOUT, assert_matches_ddp, fit_and_record, make_loader
from tests.modules import GAN

WORLD = 4
STEPS = 3


def _fit(strategy: Any, folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GAN()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _, model, _ = fit_and_record(strategy, folder, WORLD, model=model, max_steps=2 * STEPS,
                                 train_loader=make_loader(samples=64, batch_size=2))
    return {"start": start, "end": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    return _fit(DDPStrategy(start_method="fork", find_unused_parameters=True), tmp_path_factory.mktemp("ddp"))


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("units", ["each_linear_a_unit", "one_root_unit"])
def test_a_gan_step_under_fsdp2_trains_as_under_ddp(tmp_path, ddp, degree, units):
    policy = {torch.nn.Linear} if units == "each_linear_a_unit" else None
    ours = _fit(HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=2, auto_wrap_policy=policy,
                                        start_method="fork"), tmp_path)
    for key in ddp["end"]:
        assert not torch.equal(ddp["end"][key], ddp["start"][key]), key
        assert not torch.equal(ours["end"][key], ours["start"][key]), f"{key} did not move"
    assert_matches_ddp(ours["end"], ddp["end"])


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_a_gan_step_at_degree_1_trains_as_under_ddp_whatever_the_version(tmp_path, ddp, version):
    """Nothing sharded runs on the DDP engine, under fsdp_version=1 too: several backward passes in one step, each
    prepared for DDP's reducer as Lightning's DDPStrategy prepares them."""
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=1, fsdp_version=version, start_method="fork")
    ours = _fit(strategy, tmp_path)
    assert strategy.engine.name == "ddp"
    for key in ddp["end"]:
        assert not torch.equal(ours["end"][key], ours["start"][key]), f"{key} did not move"
    assert_matches_ddp(ours["end"], ddp["end"])


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_manual_optimization_under_fsdp1_is_refused_before_any_step(tmp_path):
    with pytest.raises(UnsupportedOptionError, match="automatic_optimization=False.*fsdp_version=2"):
        _fit(HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=1, start_method="fork"), tmp_path)


class GANWithOwnParameter(GAN):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.ones(()))


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_a_parameter_held_by_the_lightning_module_itself_is_refused_under_manual_optimization(tmp_path):
    """It would sit in the root unit, which a backward inside the step does not reach: its gradient would stay None."""
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=2, start_method="fork")
    with pytest.raises(UnsupportedOptionError, match=r"automatic_optimization=False.*\(temperature\).*submodule"):
        fit_and_record(strategy, tmp_path, WORLD, model=GANWithOwnParameter(), max_steps=1,
                       train_loader=make_loader(samples=16, batch_size=2))
