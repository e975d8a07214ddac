"""The test suite's distributed helpers: one way to start ranks, one small model, one per-rank probe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp.callbacks.memory import strategy_mesh

# the one way the suite starts ranks; it lives in the package so that the benchmarks use it too
from lightning_smp.testing import PROCESS_TIMEOUT, free_port, run_distributed  # noqa: F401


class TinyModel(L.LightningModule):
    """Two linear layers with odd sizes, so that FSDP has to pad: 16*33+33 + 33*4+4 = 697 parameters."""

    LAYER_NUMELS = ((16 * 33, 33), (33 * 4, 4))

    def __init__(self, lr: float = 0.05, optimizer: str = "adam") -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 4))
        self.lr = lr
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def make_loader(samples: int = 64, batch_size: int = 4, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=g)
    y = torch.sin(x[:, :4] * 3) + 0.1 * torch.randn(samples, 4, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def local_flat_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's FlatParameter shards (one per FSDP unit), or the plain parameters of an unwrapped model."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = FSDP.fsdp_modules(model)
    if not units:
        return [p.detach().clone() for p in model.parameters()]
    return [u._handle.flat_param.detach().clone() for u in units if u._handle is not None]


class RankRecorder(Callback):
    """Writes what each rank holds at the end of fit to ``<folder>/rank<k>.pt``: groups, shards, losses."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"].detach()
        # the global-batch loss, as DDP's would be logged with sync_dist
        self.losses.append(float(trainer.strategy.reduce(loss.clone(), reduce_op="mean")))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        record: dict[str, Any] = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "losses": self.losses,
            "shards": [s.cpu() for s in local_flat_params(strategy.model)],
        }
        mesh = strategy_mesh(strategy)
        if mesh is not None:
            record["shard_group"] = dist.get_process_group_ranks(mesh.get_group("shard"))
            record["replicate_group"] = dist.get_process_group_ranks(mesh.get_group("replicate"))
            record["fsdp_strategy"] = strategy.sharding_strategy.name
            record["backends"] = [dist.get_backend(mesh.get_group(axis)) for axis in ("replicate", "shard")]
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save(record, self.folder / f"rank{trainer.global_rank}.pt")


def fit_and_record(strategy: Any, folder: Path, devices: int, model: L.LightningModule | None = None,
                   max_steps: int = 6, accelerator: str = "cpu",
                   **trainer_kwargs: Any) -> tuple[L.Trainer, L.LightningModule, list[dict]]:
    """Fit ``model`` (seeded ``TinyModel`` by default) with ``strategy`` on ``devices`` ranks; return per-rank records."""
    if model is None:
        torch.manual_seed(0)
        model = TinyModel()
    trainer_kwargs.setdefault("enable_checkpointing", False)
    trainer_kwargs["callbacks"] = [RankRecorder(Path(folder) / "records"), *trainer_kwargs.get("callbacks", [])]
    trainer = L.Trainer(
        strategy=strategy, accelerator=accelerator, devices=devices, max_steps=max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=folder, **trainer_kwargs,
    )
    trainer.fit(model, make_loader())
    records = [torch.load(Path(folder) / "records" / f"rank{r}.pt", weights_only=False) for r in range(devices)]
    return trainer, model, records
