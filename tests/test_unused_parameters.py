"""Parameters that take no part in some micro-batches of an accumulation window: the result equals DDP's.

FSDP2 keeps one pending sum per parameter group between the micro-batches of a window (``defer_all_reduce``); its
layout followed whichever parameters had gradients in each micro-batch, so a head used on even batches only never
moved (its sum was never all-reduced), or two heads of the same shape swapped gradients, silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_smp import HybridShardFSDPStrategy
from tests.helpers import GLOO_TIMEOUT, TinyModel, fit_and_record, make_loader

WORLD = 4
K = 2  # micro-batches per optimizer step


class AuxiliaryHeads(TinyModel):
    """TinyModel and two heads of one shape: ``aux_even`` takes part in even batches only, ``aux_odd`` in odd ones."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.aux_even = torch.nn.Linear(16, 4)
        self.aux_odd = torch.nn.Linear(16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        head = self.aux_even if batch_idx % 2 == 0 else self.aux_odd
        return torch.nn.functional.mse_loss(self(x), y) + torch.nn.functional.mse_loss(head(x), y)


def _fit(strategy: Any, folder: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = AuxiliaryHeads()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _, model, _ = fit_and_record(strategy, folder, WORLD, model=model, max_steps=3, accumulate_grad_batches=K,
                                 train_loader=make_loader(samples=64, batch_size=2))
    end = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"start": start, "end": end}  # type: ignore[dict-item]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    return _fit(DDPStrategy(start_method="fork", find_unused_parameters=True), tmp_path_factory.mktemp("ddp"))


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("units", ["each_linear_a_unit", "one_root_unit"])
def test_heads_used_in_some_micro_batches_train_as_under_ddp(tmp_path, ddp, degree, units):
    policy = {torch.nn.Linear} if units == "each_linear_a_unit" else None
    ours = _fit(HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=2, auto_wrap_policy=policy,
                                        start_method="fork"), tmp_path)
    moved_by_ddp = {k for k in ddp["end"] if not torch.equal(ddp["end"][k], ddp["start"][k])}
    assert {"aux_even.weight", "aux_odd.weight"} <= moved_by_ddp
    for key in ddp["end"]:
        assert torch.allclose(ours["end"][key], ddp["end"][key], atol=1e-5, rtol=0), key
        if key in moved_by_ddp:
            assert not torch.equal(ours["end"][key], ours["start"][key]), f"{key} did not move"
