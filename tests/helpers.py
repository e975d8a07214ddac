"""The test suite's distributed helpers: one way to start ranks, one Trainer factory, one small model, one per-rank
probe, and the process-group backends the distributed test bodies run on."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp.callbacks.memory import strategy_mesh
from lightning_smp.names import MESH_AXES, REPLICATE_AXIS, SHARD_AXIS

# the one way the suite starts ranks; it lives in the package so that the benchmarks use it too
from lightning_smp.testing import PROCESS_TIMEOUT, free_port, run_distributed  # noqa: F401

# ---------------------------------------------------------------------------------------- backends as data

#: CUDA devices on this machine (0 without CUDA); ``torch.cuda.device_count`` does not initialise CUDA, so the
#: fork launcher stays usable after the suite is collected
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
#: Every fsdp_version, as the parameter of the tests that run on each (a layout that shards nothing runs on the DDP
#: engine under either)
FSDP_VERSIONS = [pytest.param(1, id="fsdp1"), pytest.param(2, id="fsdp2")]
#: how long one distributed test body may run: gloo ranks on the CPU, and CUDA ranks, which start a CUDA context
#: and NCCL communicators first (a test parametrized over the backends takes its timeout from them)
GLOO_TIMEOUT, CUDA_TIMEOUT = 240, 600
_NEEDS_NCCL = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0 or not dist.is_nccl_available(), reason="needs a CUDA GPU and NCCL"),
    pytest.mark.timeout(CUDA_TIMEOUT),
]
#: the NCCL backends, alone and mixed with gloo for CPU tensors; skipped without a GPU
NCCL_BACKENDS = [
    pytest.param("nccl", id="nccl", marks=_NEEDS_NCCL),
    pytest.param("cuda:nccl,cpu:gloo", id="mixed_backend", marks=_NEEDS_NCCL),
]
#: what a distributed test body is parametrized over: gloo everywhere, NCCL where GPUs exist
BACKENDS = [pytest.param("gloo", id="gloo", marks=pytest.mark.timeout(GLOO_TIMEOUT)), NCCL_BACKENDS[0]]


def accelerator_for(backend: str) -> str:
    """The Trainer's accelerator for a backend of :data:`BACKENDS` or :data:`NCCL_BACKENDS`: gloo alone runs on CPU."""
    return "cpu" if backend == "gloo" else "cuda"


def process_group_backend_for(backend: str) -> str | None:
    """The strategy's ``process_group_backend``: ``None`` (the accelerator's default) unless the backend is mixed."""
    return None if backend in ("gloo", "nccl") else backend


def require_devices(backend: str, devices: int) -> None:
    """Skip the calling test when ``backend`` needs more CUDA GPUs than this machine has (gloo never skips)."""
    if accelerator_for(backend) == "cuda" and GPUS < devices:
        pytest.skip(f"needs {devices} CUDA GPUs, found {GPUS}")


# ---------------------------------------------------------------------------------------- the Trainer factory

#: the suite's Trainer defaults: nothing written or printed that a test did not ask for
QUIET_DEFAULTS: dict[str, Any] = {
    "logger": False, "enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False,
}
#: overrides that give back Lightning's own defaults (logger, checkpointing, progress bar, summary), as a user gets
LIGHTNING_DEFAULTS: dict[str, Any] = dict.fromkeys(QUIET_DEFAULTS)


def cpu_trainer(strategy: Any, folder: Path | str | None = None, devices: int = 4, *, accelerator: str = "cpu",
                **overrides: Any) -> L.Trainer:
    """The suite's one Trainer: ``strategy`` on ``devices`` ranks of ``accelerator`` with :data:`QUIET_DEFAULTS`.

    ``folder`` becomes ``default_root_dir`` (left to Lightning when ``None``, for Trainers that never fit);
    ``overrides`` replace any default (``logger=CSVLogger(...)``, ``enable_checkpointing=True``) or add any other
    Trainer argument (``max_steps``, ``precision``, ``callbacks``).
    """
    kwargs = {**QUIET_DEFAULTS, **overrides}
    if folder is not None:
        kwargs.setdefault("default_root_dir", folder)
    return L.Trainer(strategy=strategy, accelerator=accelerator, devices=devices, **kwargs)


# ---------------------------------------------------------------------------------------- model, data, probe


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
    """This rank's FlatParameter shards (one per FSDP1 unit), its local DTensor shards (FSDP2, one per parameter),
    or the plain parameters of an unwrapped model."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    units = FSDP.fsdp_modules(model)
    if not units:
        return [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]
    return [u._handle.flat_param.detach().clone() for u in units if u._handle is not None]


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """A SHA-256 of a state dict's keys and values: equal digests, bit-identical weights."""
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class RankRecorder(Callback):
    """The suite's one per-rank probe: writes what each rank holds at the end of fit to ``<folder>/rank<k>.pt``.

    A record holds ``rank``, ``world_size``, ``pid``, ``counters`` (global step, epoch), ``losses`` (the global-batch
    mean of every step), ``local_losses`` (this rank's), ``shards`` (this rank's FlatParameter shards) and, under a
    device mesh, ``shard_group``, ``replicate_group``, ``fsdp_strategy`` and ``backends`` (replicate, shard).

    With ``report=True`` the ranks also gather their records into rank 0's ``report`` attribute (``None`` on the
    other ranks), which the fork launcher hands back to the launching process's callback, and each record gains
    ``weights_sha256``: :func:`state_digest` of the strategy's ``full_state_dict()`` (a collective) on rank 0,
    ``None`` elsewhere.
    """

    def __init__(self, folder: Path, report: bool = False) -> None:
        self.folder = Path(folder)
        self.gather_report = report
        self.losses: list[float] = []
        self.local_losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"].detach()
        self.local_losses.append(float(loss))
        # the global-batch loss, as DDP's would be logged with sync_dist
        self.losses.append(float(trainer.strategy.reduce(loss.clone(), reduce_op="mean")))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        record: dict[str, Any] = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "pid": os.getpid(),
            "counters": (trainer.global_step, trainer.current_epoch),
            "losses": self.losses,
            "local_losses": self.local_losses,
            "shards": [s.cpu() for s in local_flat_params(strategy.model)],
        }
        mesh = strategy_mesh(strategy)
        if mesh is not None:
            record["shard_group"] = dist.get_process_group_ranks(mesh.get_group(SHARD_AXIS))
            record["replicate_group"] = dist.get_process_group_ranks(mesh.get_group(REPLICATE_AXIS))
            record["fsdp_strategy"] = strategy.sharding_strategy.name
            record["backends"] = [dist.get_backend(mesh.get_group(axis)) for axis in MESH_AXES]
        if self.gather_report:
            full = strategy.full_state_dict()  # a collective; the full weights arrive on rank 0
            record["weights_sha256"] = state_digest(full) if full else None
            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, record)
            self.report = gathered if trainer.global_rank == 0 else None
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save(record, self.folder / f"rank{trainer.global_rank}.pt")


def fit_and_record(strategy: Any, folder: Path, devices: int, model: L.LightningModule | None = None,
                   max_steps: int = 6, accelerator: str = "cpu", train_loader: DataLoader | None = None,
                   **trainer_kwargs: Any) -> tuple[L.Trainer, L.LightningModule, list[dict]]:
    """Fit ``model`` (seeded ``TinyModel`` by default) on ``train_loader`` (:func:`make_loader` by default) with
    ``strategy`` on ``devices`` ranks; return per-rank records."""
    if model is None:
        torch.manual_seed(0)
        model = TinyModel()
    trainer_kwargs["callbacks"] = [RankRecorder(Path(folder) / "records"), *trainer_kwargs.get("callbacks", [])]
    trainer = cpu_trainer(strategy, folder, devices, accelerator=accelerator, max_steps=max_steps, **trainer_kwargs)
    trainer.fit(model, train_loader if train_loader is not None else make_loader())
    records = [torch.load(Path(folder) / "records" / f"rank{r}.pt", weights_only=False) for r in range(devices)]
    return trainer, model, records


def kill_when_ready(target: Callable[..., None], args: tuple, ready: Path, what: str) -> None:
    """Run ``target(*args)`` in a forked child (``target`` calls ``os.setsid()`` first, so that the ranks it starts
    share its process group); once the file ``ready`` exists, SIGKILL the child and every rank it started (a save
    interrupted half way). Fails naming ``what`` if ``ready`` never appears."""
    import multiprocessing as mp
    import signal
    import time

    child = mp.get_context("fork").Process(target=target, args=args)
    child.start()
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and child.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), f"{what} never started"
        os.killpg(child.pid, signal.SIGKILL)
        child.join(30)
    finally:
        if child.is_alive():
            os.killpg(child.pid, signal.SIGKILL)
            child.join(10)
    assert child.exitcode == -signal.SIGKILL
