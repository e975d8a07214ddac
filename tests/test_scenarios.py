"""The training patterns that once gave silent wrong results or crashes (issue 17), as one matrix: each pattern x both
engines x degrees 2 and 4 x the Trainer and Fabric, where the pattern exists there, and each at degree 1 (the DDP
engine, whatever the version). Every case runs 4 CPU ranks and is compared with DDP on the same seeds and data:
every weight within ``PARITY_BOUND`` (``tests/helpers.py`` derives it), and every weight that DDP moved moved. DDP
runs once per pattern and front end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch.strategies import DDPStrategy as TrainerDDP

from lightning_smp import HybridShardFSDPStrategy
from lightning_smp.fabric import HybridShardFSDPStrategy as FabricHybridShardFSDPStrategy
from tests.helpers import FRONT_ENDS, GLOO_TIMEOUT, TinyModel, assert_matches_ddp, fit_and_record, make_loader
from tests.test_fabric import _batches, _clipped_by_optimizer, _full, _window_dropped, make_net
from tests.test_manual_optimization import GAN
from tests.test_unused_parameters import BODY_ONLY, AuxiliaryHeads, DataDependentBranch, ZeroGradAfterTheFirstMicroBatch

pytestmark = pytest.mark.slow

WORLD = 4
K = 2
EACH_LINEAR = {torch.nn.Linear}

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Scenario:
    """One pattern. ``trainer``: a seeded LightningModule and the Trainer's arguments; ``fabric``: a loop for
    ``fabric.launch`` returning rank 0's full weights and a seeded copy of its module before training."""

    name: str
    trainer: Callable[[], tuple[L.LightningModule, dict[str, Any]]] | None = None
    fabric: Callable[..., dict[str, list]] | None = None
    fabric_start: Callable[[], torch.nn.Module] | None = None
    engines: tuple[int, ...] = (1, 2)
    policy: Any = None
    fabric_args: tuple = field(default_factory=tuple)


# ------------------------------------------------------------------------------------------- Trainer patterns


def _heads() -> tuple[L.LightningModule, dict[str, Any]]:
    torch.manual_seed(0)
    return AuxiliaryHeads(), {"accumulate_grad_batches": K, "max_steps": 3}


def _branch() -> tuple[L.LightningModule, dict[str, Any]]:
    torch.manual_seed(0)
    return DataDependentBranch(), {"max_steps": 4}


class HeadOptimizer(TinyModel):
    """One optimizer over the last layer while the first still requires grad; clipped by norm (item 3)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.net[2].parameters(), lr=self.lr)


def _clip_head() -> tuple[L.LightningModule, dict[str, Any]]:
    torch.manual_seed(0)
    return HeadOptimizer(), {"gradient_clip_val": 0.05, "max_steps": 3}


def _zero_grad_mid_window() -> tuple[L.LightningModule, dict[str, Any]]:
    torch.manual_seed(0)
    return ZeroGradAfterTheFirstMicroBatch(), {"accumulate_grad_batches": K, "max_steps": 3}


def _gan() -> tuple[L.LightningModule, dict[str, Any]]:
    torch.manual_seed(0)
    return GAN(), {"max_steps": 4}


# -------------------------------------------------------------------------------------------- Fabric patterns


def _fabric_heads(fabric: L.Fabric) -> dict[str, list]:
    """A head per micro-batch of each window (even, then odd) under no_backward_sync (items 1 and 6)."""
    model = fabric.setup_module(_heads()[0])  # the Trainer's seeded model; forward(x, micro) picks the head
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    batches = iter(_batches(fabric))
    for _ in range(3):
        for micro in range(K):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < K - 1):
                out, aux = model(x, micro)  # through the sharded root, as Fabric requires
                fabric.backward((torch.nn.functional.mse_loss(out, y) + torch.nn.functional.mse_loss(aux, y)) / K)
        optimizer.step()
        optimizer.zero_grad()
    return _full(fabric, model)


def _fabric_branch(fabric: L.Fabric) -> dict[str, list]:
    """An auxiliary loss where this rank's batch meets a condition (item 8), the branch's module in the root unit."""
    torch.manual_seed(0)
    model = fabric.setup_module(DataDependentBranch())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.05))
    for x, y in _batches(fabric)[:4]:
        fabric.backward(model.training_step((x, y), 0))  # its forward and branch, through the sharded root
        optimizer.step()
        optimizer.zero_grad()
    return _full(fabric, model)


def _fabric_meta_init(fabric: L.Fabric) -> dict[str, list]:
    """Seeded meta-device init (item 4), then training: the shards of an unsharded model's weights, trained alike."""
    fabric.seed_everything(7)
    # DDP's empty_init leaves the weights uninitialised (for a checkpoint to fill): its reference inits normally
    with fabric.init_module(empty_init=not isinstance(fabric.strategy, FabricDDP)):
        net = TinyModel().net
    model = fabric.setup_module(net)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    for x, y in _batches(fabric)[:3]:
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return _full(fabric, model)


def _seven() -> torch.nn.Module:
    torch.manual_seed(7)
    return TinyModel().net


def _seeded(factory: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return factory()
    return build


SCENARIOS = [
    Scenario("heads_in_some_micro_batches", trainer=_heads, fabric=_fabric_heads, fabric_start=lambda: _heads()[0],
             policy=EACH_LINEAR),
    Scenario("branch_on_some_ranks", trainer=_branch, fabric=_fabric_branch,
             fabric_start=_seeded(DataDependentBranch), policy=BODY_ONLY),
    Scenario("zero_grad_mid_window", trainer=_zero_grad_mid_window, fabric=_window_dropped, fabric_start=make_net),
    Scenario("clip_by_optimizer", trainer=_clip_head, fabric=_clipped_by_optimizer, fabric_start=make_net,
             fabric_args=(True,)),
    Scenario("manual_gan", trainer=_gan, engines=(2,), policy=EACH_LINEAR),
    Scenario("seeded_meta_init", fabric=_fabric_meta_init, fabric_start=_seven),
]
BY_NAME = {s.name: s for s in SCENARIOS}


def _run(scenario: Scenario, front_end: str, strategy: Any, folder: Path) -> tuple[Weights, Weights]:
    """(weights before, weights after) of one run of ``scenario``."""
    if front_end == "trainer":
        assert scenario.trainer is not None
        model, kwargs = scenario.trainer()
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        _, model, _ = fit_and_record(strategy, folder, WORLD, model=model,
                                     train_loader=make_loader(samples=64, batch_size=2), **kwargs)
        return start, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    assert scenario.fabric is not None and scenario.fabric_start is not None
    end = L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD).launch(scenario.fabric, *scenario.fabric_args)
    start = {k: v.detach().clone() for k, v in scenario.fabric_start().state_dict().items()}
    return start, {k: torch.tensor(v) for k, v in end.items()}


@lru_cache(maxsize=None)
def _ddp(name: str, front_end: str) -> tuple[Weights, Weights]:
    # find_unused_parameters: what DDP itself needs for these patterns (a branch, heads, a GAN's toggled halves)
    strategy = (TrainerDDP if front_end == "trainer" else FabricDDP)(start_method="fork", find_unused_parameters=True)
    with TemporaryDirectory() as folder:
        return _run(BY_NAME[name], front_end, strategy, Path(folder))


CASES = [
    pytest.param(scenario.name, front_end, version, degree,
                 id=f"{scenario.name}-{front_end}-" + (f"fsdp{version}-d{degree}" if degree > 1 else "d1"))
    for scenario in SCENARIOS
    for front_end in FRONT_ENDS
    if (scenario.trainer if front_end == "trainer" else scenario.fabric) is not None
    for version, degree in [(scenario.engines[0], 1), *((v, d) for v in scenario.engines for d in (2, 4))]
]


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize(("name", "front_end", "version", "degree"), CASES)
def test_pattern_equals_ddp(tmp_path, name, front_end, version, degree):
    scenario = BY_NAME[name]
    ddp_start, ddp_end = _ddp(name, front_end)
    cls = HybridShardFSDPStrategy if front_end == "trainer" else FabricHybridShardFSDPStrategy
    strategy = cls(hybrid_shard_degree=degree, fsdp_version=version, auto_wrap_policy=scenario.policy,
                   start_method="fork")
    start, end = _run(scenario, front_end, strategy, tmp_path)
    assert any(not torch.equal(ddp_end[k], ddp_start[k]) for k in ddp_end), "DDP moved nothing: it tests nothing"
    assert all(torch.equal(start[k], ddp_start[k]) for k in ddp_start), "the runs did not start alike"
    assert_matches_ddp(end, ddp_end, start=ddp_start)
