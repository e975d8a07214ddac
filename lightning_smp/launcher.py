"""How the ranks of a run start: the rule both front ends follow (:func:`choose_launcher`), and the fork/spawn
launchers of hybrid sharding, for notebooks and fast in-process tests (the Trainer's
:class:`HybridShardMultiProcessingLauncher`, Fabric's :class:`FabricWaitingLauncher`).

Lightning's FSDP strategy re-runs the script once per rank, which cannot work in Jupyter. Here the notebook
process forks the ranks (as Lightning's ``ddp_notebook`` does), the ranks train, and what the notebook needs in
its next cell comes back to it: the trained weights (loaded into the notebook's module), ``trainer.global_step``
and ``trainer.current_epoch``, ``trainer.callback_metrics``/``logged_metrics``, callback state, every callback's
``report`` and ``reports`` attributes (e.g. :class:`lightning_smp.MemorySavingsCallback`), and the optimizer
state, so that ``trainer.save_checkpoint(...)`` in the notebook writes a checkpoint a new Trainer resumes from.

The checks before a fork or spawn and the retyping of a rank's error, which Fabric's launcher shares, are in
:mod:`lightning_smp.forking`.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from lightning.fabric.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher as _FabricMultiProcessingLauncher,
)
from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.call import _call_callbacks_load_state_dict, _call_callbacks_state_dict
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_smp.errors import HybridShardConfigError
from lightning_smp.forking import check_fork_safety, check_start_method, rank_errors_retyped
from lightning_smp.names import ProcessStartMethod, StartMethod

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.fabric.strategies import ParallelStrategy as FabricParallelStrategy
    from lightning.pytorch.strategies import ParallelStrategy

    from lightning_smp.checkpoint import CheckpointRun
    from lightning_smp.planner import Plan

#: Attributes a callback fills with results for the user (e.g. ``MemorySavingsCallback.report``, one plain dict
#: per rank, and ``.reports`` by stage): sent back from rank 0 and set on the main process's matching callback.
REPORT_ATTRIBUTES = ("report", "reports")


@dataclass
class MainProcessResults:
    """What the ranks of the last ``fit`` sent back to the process that launched them (the notebook).

    Owned by the strategy, which creates it with the launcher and reads it when the notebook saves a checkpoint;
    the launcher fills it in.
    """

    #: the process that created the Trainer; forked or spawned ranks see another pid
    main_pid: int = field(default_factory=os.getpid)
    #: the full optimizer state of rank 0 for every optimizer; None until a fit has finished
    optimizer_states: list[dict[str, Any]] | None = None
    #: ``scheduler.state_dict()`` for every learning-rate scheduler.
    lr_schedulers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def in_main_process(self) -> bool:
        """True in the process that created the Trainer (the notebook), False inside the launched ranks."""
        return os.getpid() == self.main_pid

    def complete_checkpoint(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Fill in what the main process cannot know in a checkpoint it dumped after a launched ``fit``.

        The main process holds the trained weights, loop counters and callback state, but not the optimizers,
        which lived in the ranks: their full state, sent back at the end of ``fit``, is added here.
        """
        if "optimizer_states" not in checkpoint:  # weights_only=True
            return checkpoint
        if self.optimizer_states is None:
            raise HybridShardConfigError(
                "trainer.save_checkpoint() in the notebook process has no optimizer state to save: this Trainer has"
                " not finished a fit(). Fix: call trainer.fit(...) first, or pass weights_only=True."
            )
        return {**checkpoint, "optimizer_states": self.optimizer_states, "lr_schedulers": self.lr_schedulers}


class LaunchedStrategy(Protocol):
    """What the launcher needs of the strategy it launches for (the strategy is not imported here: it imports the
    launcher)."""

    root_device: torch.device
    global_rank: int

    def full_state_dict(self) -> dict[str, Any]:
        """The unsharded model state on rank 0 (collective)."""
        ...

    def full_optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The unsharded optimizer state on rank 0 (collective)."""
        ...


class HybridShardMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher for a sharded model: results come back complete to the main process.

    Lightning's launcher hands the main process rank 0's ``state_dict()``, which under FSDP is a shard that
    cannot be loaded into the unsharded module, and restores neither the loop counters nor callback state. Here
    every rank takes part in assembling full weights and optimizer state, rank 0 sends them with the loop and
    callback state, and the main process loads them (see the module docstring for the list).

    Arguments:
        strategy: the :class:`~lightning_smp.HybridShardFSDPStrategy` that uses this launcher; the ranks call its
            public ``full_state_dict()`` and ``full_optimizer_state(optimizer)`` (:class:`LaunchedStrategy`).
        start_method: ``"fork"`` (notebooks), ``"spawn"`` or ``"forkserver"``.
        results: where the main process keeps what the ranks sent back (owned by the strategy).
        run: the checkpoint run identity; the main process continues the ranks' run.
        adopt_plan: told, in the main process, the degree plan the ranks chose for ``hybrid_shard_degree="auto"``
            (the main process, which launched them, chose none).
    """

    _strategy: Any  # a ParallelStrategy (the base class's type) that is also a LaunchedStrategy

    def __init__(
        self,
        strategy: ParallelStrategy,
        start_method: ProcessStartMethod,
        results: MainProcessResults,
        run: CheckpointRun,
        adopt_plan: Callable[[Plan], None] | None = None,
    ) -> None:
        check_start_method(start_method)
        super().__init__(strategy, start_method=start_method)
        self.results = results
        self.run = run
        self.adopt_plan = adopt_plan

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        # every check before the first process starts: a failing rank would leave the others waiting
        check_fork_safety(self._strategy.root_device.type, self._start_method)
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise HybridShardConfigError(
                "Trainer.fit() already ran on this Trainer with HybridShardFSDPStrategy"
                f"(start_method={self._start_method!r}); a Trainer whose ranks were launched by"
                f" {self._start_method} can fit only once. Fix: create a new Trainer. The model already holds the"
                " trained weights, so `L.Trainer(...).fit(model)` continues from them; to resume the optimizer and"
                " step counters too, call `trainer.save_checkpoint('last.ckpt')` first and then"
                " `L.Trainer(...).fit(model, ckpt_path='last.ckpt')`."
            )
        with rank_errors_retyped():
            return super().launch(function, *args, trainer=trainer, **kwargs)

    # ------------------------------------------------------------------ inside the ranks

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None

        strategy: LaunchedStrategy = self._strategy
        fitting = trainer.state.fn == TrainerFn.FITTING
        payload: dict[str, Any] = {}
        if fitting:
            # collectives: every rank must take part
            payload["state_dict"] = strategy.full_state_dict()
            # full whatever state_dict_type says: the main process has no shards to pair a sharded state with
            payload["optimizer_states"] = [strategy.full_optimizer_state(opt) for opt in trainer.optimizers]
        if strategy.global_rank != 0:
            return None
        if fitting:
            payload["lr_schedulers"] = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
            payload["fit_loop"] = trainer.fit_loop.state_dict()
            payload["callbacks"] = _call_callbacks_state_dict(trainer)
            # checkpoints the main process writes belong to the same run (see lightning_smp.checkpoint)
            payload["checkpoint_run_id"] = self.run.run_id
        payload["reports"] = _callback_reports(trainer.callbacks)  # type: ignore[attr-defined]  # undeclared on Trainer

        # a private folder: the file system may be shared between nodes
        payload_path = os.path.join(tempfile.mkdtemp(prefix="lightning_smp_"), "results.pt")
        torch.save(payload, payload_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, payload_path, trainer.state, results, extra)

    @override
    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        # tensors travel as bytes, as Lightning does for callback_metrics, to avoid shared-memory handles
        for name in ("logged_metrics", "progress_bar_metrics"):
            buffer = io.BytesIO()
            torch.save({k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                        for k, v in getattr(trainer, name).items()}, buffer)
            extra[f"{name}_bytes"] = buffer.getvalue()
        core = getattr(trainer.strategy, "core", None)
        if core is not None and core.chosen is not None:
            # hybrid_shard_degree="auto": the main process learns the choice; as bytes, because Lightning's transfer
            # walks into dataclasses and cannot rebuild a frozen one
            extra["lightning_smp_plan"] = pickle.dumps(core.chosen)
        return extra

    # ------------------------------------------------------------------ back in the main process

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        callback = trainer.checkpoint_callback
        if worker_output.best_model_path is not None and callback is not None and hasattr(callback, "best_model_path"):
            callback.best_model_path = str(worker_output.best_model_path)
        payload: dict[str, Any] = {}
        if worker_output.weights_path is not None:
            path = str(worker_output.weights_path)
            try:
                payload = torch.load(path, map_location="cpu", weights_only=False)
            finally:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)

        if "state_dict" in payload:
            # non-strict, as Lightning's launcher: configure_model may have added layers in the ranks;
            # a model created on the meta device gets the trained tensors themselves
            module = trainer.lightning_module
            on_meta = _has_meta_device_parameters_or_buffers(module)
            module.load_state_dict(payload["state_dict"], strict=False, assign=on_meta)
        if "fit_loop" in payload:
            trainer.fit_loop.load_state_dict(payload["fit_loop"])
            # the counters are restored; nothing is being resumed in this process
            trainer.fit_loop.restarting = False
        if "callbacks" in payload:
            # ModelCheckpoint resolves its folder in the ranks only; give it the ranks' folder so that
            # best/last paths and top-k are restored here too, instead of being dropped with a warning
            for callback in trainer.checkpoint_callbacks:
                state = payload["callbacks"].get(callback.state_key, {})
                if getattr(callback, "dirpath", None) is None and state.get("dirpath") is not None:
                    callback.dirpath = state["dirpath"]  # type: ignore[attr-defined]  # not only ModelCheckpoint
            _call_callbacks_load_state_dict(trainer, {"callbacks": payload["callbacks"]})
        reports = payload.get("reports", {})
        _set_callback_reports(trainer.callbacks, reports)  # type: ignore[attr-defined]  # undeclared on Trainer
        if payload.get("checkpoint_run_id") is not None:
            self.run.run_id = payload["checkpoint_run_id"]
        if worker_output.trainer_state.fn == TrainerFn.FITTING:
            self.results.optimizer_states = payload.get("optimizer_states")
            self.results.lr_schedulers = payload.get("lr_schedulers", [])

        trainer.state = worker_output.trainer_state
        self.update_main_process_results(trainer, worker_output.extra)

    @override
    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if extra.get("lightning_smp_plan") is not None and self.adopt_plan is not None:
            self.adopt_plan(pickle.loads(extra["lightning_smp_plan"]))  # noqa: S301  # this run's own rank 0 wrote it
        for name in ("logged_metrics", "progress_bar_metrics"):
            if f"{name}_bytes" in extra:
                getattr(trainer, name).update(torch.load(io.BytesIO(extra[f"{name}_bytes"]), weights_only=True))


def _callback_keys(callbacks: list[Any]) -> list[str]:
    """Stable keys for callbacks in the ranks and in the main process: class name and occurrence.

    Positions alone would not do: the ranks add the model's ``configure_callbacks()`` and reorder the list.
    """
    seen: Counter[str] = Counter()
    keys = []
    for callback in callbacks:
        name = f"{type(callback).__module__}.{type(callback).__qualname__}"
        keys.append(f"{name}#{seen[name]}")
        seen[name] += 1
    return keys


def _callback_reports(callbacks: list[Any]) -> dict[str, dict[str, Any]]:
    reports = {}
    for key, callback in zip(_callback_keys(callbacks), callbacks):
        found = {name: getattr(callback, name) for name in REPORT_ATTRIBUTES if hasattr(callback, name)}
        if found:
            reports[key] = found
    return reports


def _set_callback_reports(callbacks: list[Any], reports: dict[str, dict[str, Any]]) -> None:
    for key, callback in zip(_callback_keys(callbacks), callbacks):
        for name, value in reports.get(key, {}).items():
            setattr(callback, name, value)


_Launcher = TypeVar("_Launcher")


def choose_launcher(start_method: StartMethod, cluster_environment: ClusterEnvironment | None, *,
                    script: Callable[[ClusterEnvironment], _Launcher],
                    in_process: Callable[[ProcessStartMethod], _Launcher], owner: str, creator: str) -> _Launcher:
    """The launcher of a run, one rule for both front ends: the script launcher (``script``, the front end's
    ``_SubprocessScriptLauncher``) for ``start_method="popen"`` and for processes something else started (torchrun,
    SLURM: unlike Lightning's FSDP strategies, there too, because that launcher caps their threads), else
    ``in_process``, the front end's launcher of forked or spawned ranks. ``owner`` and ``creator`` name the strategy
    and what creates it, for the error without a cluster environment."""
    if cluster_environment is None:
        raise HybridShardConfigError(f"{owner} has no cluster environment: create it through {creator}.")
    if start_method == "popen" or cluster_environment.creates_processes_externally:
        return script(cluster_environment)
    return in_process(start_method)


class WaitingStrategy(Protocol):
    """What Fabric's launcher needs of the strategy it launches for (the strategy is not imported here: it imports
    the launcher)."""

    @property
    def root_device(self) -> torch.device:
        ...

    def end_checkpoint_after_error(self) -> None:
        """After the rank's function failed: wait for a background save in flight, log its own failure."""
        ...

    def wait_for_checkpoint(self) -> None:
        """Take the outcome of the background save in flight; raise its failure."""
        ...


class FabricWaitingLauncher(_FabricMultiProcessingLauncher):
    """Fabric's fork/spawn launcher, whose ranks take the outcome of a background checkpoint save before they end: a
    failed last save raises there, on every rank, and ``fabric.launch`` raises it (the process would wait for the
    writing thread anyway, but a rank that ends through ``os._exit`` runs no exit handler that could report it)."""

    _strategy: Any  # a Fabric ParallelStrategy (the base class's type) that is also a WaitingStrategy

    def __init__(self, strategy: FabricParallelStrategy, start_method: ProcessStartMethod) -> None:
        check_start_method(start_method)  # the Trainer's launcher's checks and error types, before any process starts
        super().__init__(strategy, start_method=start_method)

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        check_fork_safety(self._strategy.root_device.type, self._start_method)
        with rank_errors_retyped():
            return super().launch(function, *args, **kwargs)

    def _wrapping_function(self, process_idx: int, function: Callable, args: Any, kwargs: Any, return_queue: Any,
                           global_states: Any = None) -> None:
        strategy = self._strategy

        def run(*run_args: Any, **run_kwargs: Any) -> Any:
            try:
                results = function(*run_args, **run_kwargs)
            except BaseException:
                strategy.end_checkpoint_after_error()
                raise
            strategy.wait_for_checkpoint()
            return results

        super()._wrapping_function(process_idx, run, args, kwargs, return_queue, global_states)


__all__ = [
    "FabricWaitingLauncher",
    "HybridShardMultiProcessingLauncher",
    "LaunchedStrategy",
    "MainProcessResults",
    "WaitingStrategy",
    "choose_launcher",
]
