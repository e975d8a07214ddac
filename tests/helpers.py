"""The test suite's distributed helpers: one way to start ranks, one Trainer factory, one small model, one per-rank
probe, and the process-group backends the distributed test bodies run on."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from tempfile import TemporaryDirectory
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
#: Every front end, as the parameter of the tests that run through each: Lightning's Trainer and Fabric
FRONT_ENDS = ["trainer", "fabric"]
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

    With ``full_state=True`` the ranks also gather the full model (and, around fit, optimizer) state at the start and
    end of fit and at the start of ``validate`` and ``predict``; rank 0 writes it to ``<folder>/full_<when>.pt``
    (``model``, ``optimizers``, ``global_step``, ``epoch``, ``losses`` so far, ``batch_idx``; :func:`full_state`).
    """

    def __init__(self, folder: Path, report: bool = False, full_state: bool = False) -> None:
        self.folder = Path(folder)
        self.gather_report = report
        self.full_state = full_state
        self.losses: list[float] = []
        self.local_losses: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._dump_full_state(trainer, "start", optimizers=True)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._dump_full_state(trainer, "validate")

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._dump_full_state(trainer, "predict")

    def _dump_full_state(self, trainer: L.Trainer, when: str, optimizers: bool = False) -> None:
        if not self.full_state:
            return
        strategy = trainer.strategy
        record = {  # the gathers are collectives: every rank takes part, rank 0 writes
            "model": strategy.full_state_dict(),
            "optimizers": [strategy.full_optimizer_state(o) for o in trainer.optimizers] if optimizers else [],
            "global_step": trainer.global_step, "epoch": trainer.current_epoch, "losses": list(self.losses),
            "batch_idx": trainer.fit_loop.epoch_loop.batch_idx if trainer.state.fn == "fit" else None,
        }
        if trainer.global_rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            torch.save(record, self.folder / f"full_{when}.pt")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"].detach()
        self.local_losses.append(float(loss))
        # the global-batch loss, as DDP's would be logged with sync_dist
        self.losses.append(float(trainer.strategy.reduce(loss.clone(), reduce_op="mean")))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._dump_full_state(trainer, "end", optimizers=True)
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


def full_state(folder: Path, when: str) -> dict[str, Any]:
    """What a ``RankRecorder(folder, full_state=True)`` wrote at ``when`` (start, end, validate, predict)."""
    return torch.load(Path(folder) / f"full_{when}.pt", weights_only=True)


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


@lru_cache(maxsize=None)
def ddp_fit(model_factory: Callable[[], L.LightningModule] = TinyModel, devices: int = 4, *,
            loader_factory: Callable[[], DataLoader] = make_loader, accelerator: str = "cpu",
            **trainer_kwargs: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The suite's DDP reference for the Trainer: Lightning's ``DDPStrategy`` fits ``model_factory()`` (seeded 0) on
    ``loader_factory()`` with ``devices`` ranks, as :func:`fit_and_record` fits the strategies it is compared with;
    returns the global-batch loss curve and the final weights. Each configuration is fitted once per session."""
    from lightning.pytorch.strategies import DDPStrategy

    with TemporaryDirectory() as folder:
        torch.manual_seed(0)
        _, model, records = fit_and_record(DDPStrategy(start_method="fork"), Path(folder), devices,
                                           model=model_factory(), accelerator=accelerator,
                                           train_loader=loader_factory(), **trainer_kwargs)
    return records[0]["losses"], weights_of(model)


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


# ---------------------------------------------------------------------------------------- parity with DDP

#: fp32's unit roundoff: one rounding moves a value by at most this fraction of it
UNIT_ROUNDOFF = 2.0 ** -24


def parity_bound(elements: int, steps: int = 6, lr: float = 0.05, world: int = 4, momentum: float = 0.0) -> float:
    """How far a weight may end from DDP's after ``steps`` fp32 optimizer steps at learning rate ``lr`` on ``world``
    ranks, for a model of ``elements`` weights.

    Both runs compute the same per-rank gradients bit for bit (the same kernels on the same local values). They
    differ only in the order in which the ``world`` per-rank gradients are summed (a reduce-scatter and an all-reduce
    over groups, or DDP's buckets on a ring) and in where the division by the world size happens (by a power of two:
    exact). Reordering a sum of W terms moves it by at most (W - 1) u sum|g_r|, a relative change of (W - 1) u k,
    where k = sum|g_r| / |sum g_r| is that sum's condition number. Adam's step lr m / (sqrt(v) + eps) is a ratio of
    such sums (SGD's, lr g, a sum), so a step moves a weight by at most lr (W - 1) u k more or less than DDP's, and
    ``steps`` steps by ``steps`` times that (a step's difference changes the next gradients at second order only).
    k is unbounded for one sum, but per-rank gradients of either sign make the chance that it exceeds x about 1/x,
    so the largest k among ``elements`` sums is about ``elements``. SGD with ``momentum`` m carries each step's
    difference into the later steps: ``steps`` steps then count as sum over t of (1 - m^t) / (1 - m) steps.
    For plain SGD the bound is conservative (its step is lr times the sum itself, with no division by it).

    A real fault is far outside: a skipped all-reduce, a gradient left out or a replica that drifts moves weights
    by about the learning rate (1e-3 to 1e-1 in this suite). Parameters whose exact gradient is zero (k infinite)
    are compared with :func:`rounding_residue_bound` instead.
    """
    carried = sum((1 - momentum ** t) / (1 - momentum) for t in range(1, steps + 1)) if momentum else steps
    return carried * lr * (world - 1) * UNIT_ROUNDOFF * elements


#: The bound of the suite's small models (:class:`TinyModel`, 697 weights, and its kin up to 2,000) at the suite's
#: longest Adam runs (6 steps at 0.05 on 4 ranks); the loss curves of those runs are held to it too (a loss moves
#: by the 1-norm of its gradient times the largest weight difference, and these models' 1-norms stay below
#: 2,000 / their weights); other runs pass their own arguments to :func:`parity_bound`
PARITY_BOUND = parity_bound(2_000)

#: Where :func:`assert_matches_ddp` appends each comparison's largest difference and its bound, one line per check,
#: when this environment variable names a file (to report the margins of several whole-suite runs).
PARITY_LOG = "LIGHTNING_SMP_PARITY_LOG"


def weights_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict, detached, on the CPU and copied (what a rank returns to compare)."""
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(value)  # Fabric's launch returns lists


def weight_difference(ours: dict[str, Any], reference: dict[str, Any]) -> float:
    """The largest absolute difference between two state dicts of the same keys in the same order."""
    assert list(ours) == list(reference), "the runs hold different parameters"
    return max((_tensor(ours[k]) - _tensor(reference[k])).abs().max().item() for k in reference)


def rounding_residue_bound(steps: int, lr: float, eps: float = 1e-8, residue: float = 1e-9) -> float:
    """The bound for weights whose exact gradient is zero (the key bias of attention: a softmax does not change
    when the same number is added to a whole row of logits). Their fp32 gradient is rounding residue, of either sign
    and order-dependent, which Adam divides by ``eps``: each run moves such a weight by at most ``lr * residue /
    eps`` per step, so two runs differ by at most twice that over ``steps``. ``residue``: the size such a gradient
    can reach, a hundred times what the suite's runs show (1e-12 to 1e-11)."""
    return 2 * steps * lr * residue / eps


def assert_matches_ddp(ours: dict[str, Any], reference: dict[str, Any], *, steps: int = 6, lr: float = 0.05,
                       world: int = 4, momentum: float = 0.0, start: dict[str, Any] | None = None,
                       zero_gradient: dict[str, tuple[slice, float]] | None = None) -> float:
    """Every weight of ``ours`` within :func:`parity_bound` of DDP's ``reference`` (same keys, same order), for a run
    of at most ``steps`` steps at ``lr`` on ``world`` ranks; returns the largest difference. With ``start`` (the
    weights both runs began from), every weight DDP moved must have moved here too. ``zero_gradient`` maps a key to
    the elements of it whose exact gradient is zero and their bound (:func:`rounding_residue_bound`)."""
    assert list(ours) == list(reference), "the runs hold different parameters"
    bound = parity_bound(sum(_tensor(v).numel() for v in reference.values()), steps, lr, world, momentum)
    largest = 0.0
    for key in reference:
        difference = (_tensor(ours[key]) - _tensor(reference[key])).abs()
        if zero_gradient and key in zero_gradient:
            elements, residue_bound = zero_gradient[key]
            residue = difference[elements].max().item()
            assert residue <= residue_bound, f"{key}[{elements}]: {residue:.2e} from DDP (bound {residue_bound:.1e})"
            difference[elements] = 0
        worst = difference.max().item()
        assert worst <= bound, f"{key}: {worst:.2e} from DDP (bound {bound:.1e})"
        largest = max(largest, worst)
        if start is not None and not torch.equal(_tensor(reference[key]), _tensor(start[key])):
            assert not torch.equal(_tensor(ours[key]), _tensor(start[key])), f"{key} moved under DDP but not here"
    if os.environ.get(PARITY_LOG):
        with open(os.environ[PARITY_LOG], "a") as log:
            log.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}\t{largest:.3e}\t{bound:.3e}\n")
    return largest
