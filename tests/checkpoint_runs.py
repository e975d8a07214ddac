"""The Trainer runs the checkpoint tests share: a seeded fit on fork-launched CPU ranks that records what every rank
holds (:func:`run`, read back with :func:`probe`), and bitwise comparisons of the states."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_smp import HybridShardFSDPStrategy
from lightning_smp.names import SHARDED, STRATEGY_NAMES
from tests.helpers import RankRecorder, TinyModel, cpu_trainer, full_state, make_loader

#: every registered strategy name but the notebook one (the same as smp_hybrid, launched by fork): its init args
STRATEGIES = {name: {k: v for k, v in args.items() if k != "start_method"}
              for name, _, args in STRATEGY_NAMES if name != "smp_hybrid_notebook"}
# 64 samples, batch 4: 4 steps per epoch on 4 ranks, 8 on 2 ranks
K, N = 4, 10  # save after K steps (the last batch of epoch 0 on 4 ranks), train to N (into epoch 2)


class CkptModel(TinyModel):
    """TinyModel with validation, test and predict steps (for ckpt_path= on every entry point)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


def strategy(degree: int, kind: str = SHARDED, name: str = "smp_hybrid", **kwargs: Any) -> HybridShardFSDPStrategy:
    return HybridShardFSDPStrategy(hybrid_shard_degree=degree, state_dict_type=kind, start_method="fork",
                                   **{**STRATEGIES[name], **kwargs})


def run(folder: Path, devices: int, degree: int, *, tag: str, kind: str = SHARDED, name: str = "smp_hybrid",
        max_steps: int = N, fn: str = "fit", ckpt_path: Optional[Path] = None, callbacks: tuple = (),
        model: Optional[L.LightningModule] = None, strategy_kwargs: Optional[dict] = None,
        **trainer_kwargs: Any) -> L.Trainer:
    """One fork-launched run on ``devices`` CPU ranks with a seeded model; a :class:`~tests.helpers.RankRecorder`
    records what the ranks hold in ``<folder>/<tag>`` (read back with :func:`probe`)."""
    folder.mkdir(parents=True, exist_ok=True)
    if model is None:
        torch.manual_seed(0)
        model = CkptModel()
    trainer_kwargs.setdefault("enable_checkpointing", any(isinstance(c, ModelCheckpoint) for c in callbacks))
    # checkpointing on, as a user has it: without a ModelCheckpoint of the test's, Lightning adds its default one
    trainer_kwargs.setdefault("enable_checkpointing", True)
    trainer = cpu_trainer(
        strategy(degree, kind, name, **(strategy_kwargs or {})), folder, devices, max_steps=max_steps,
        limit_val_batches=2, num_sanity_val_steps=0,
        callbacks=[RankRecorder(folder / tag, full_state=True), *callbacks], **trainer_kwargs,
    )
    loader = make_loader()
    if fn == "fit":
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    elif fn == "predict":
        trainer.predict(model, loader, ckpt_path=ckpt_path)
    else:
        getattr(trainer, fn)(model, make_loader(samples=16), ckpt_path=ckpt_path)
    return trainer


def probe(folder: Path, tag: str, when: str) -> dict[str, Any]:
    """The full state the ranks of :func:`run`'s ``tag`` run held at ``when`` (start, end, validate, predict)."""
    return full_state(folder / tag, when)


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def assert_same_optimizer(actual: dict, expected: dict) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert sorted(actual["state"]) == sorted(expected["state"])
    for idx, state in expected["state"].items():
        assert sorted(actual["state"][idx]) == sorted(state), idx
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(actual["state"][idx][name]), torch.as_tensor(value)), (idx, name)


def assert_same_state(actual: dict, expected: dict, optimizers: bool = True) -> None:
    assert_same_tensors(actual["model"], expected["model"])
    if optimizers:
        assert len(actual["optimizers"]) == len(expected["optimizers"]) == 1
        assert_same_optimizer(actual["optimizers"][0], expected["optimizers"][0])
