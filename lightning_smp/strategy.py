"""``HybridShardFSDPStrategy``: Lightning glue around :mod:`lightning_smp.degree`, :mod:`lightning_smp.mesh` and
:mod:`lightning_smp.engines`.

Above 300 lines for a reason: it is the one module that knows Lightning's Trainer, one class whose methods are
overrides of ``FSDPStrategy``'s (each delegating to a pure helper), and about a quarter of it is the documentation of
the arguments users read in their IDE.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smp import buffers
from lightning_smp import checkpoint as checkpoint_lib
from lightning_smp.accounting.memory import no_sync_extra_bytes
from lightning_smp.accounting.render import fmt_bytes
from lightning_smp.accumulation import accumulation_mode
from lightning_smp.callbacks.fault_tolerance import ReplicaGroupMetrics
from lightning_smp.checkpoint import ShardedModel
from lightning_smp.checkpoint.after_commit import defer_until_commit
from lightning_smp.checkpoint.atomic import remove_atomically
from lightning_smp.checkpoint.format import OPTIMIZERS_KEY, REPLICA_GROUPS_KEY, REPLICA_SYNC_KEY
from lightning_smp.checkpoint.local import model_state_to_save, optimizer_state_to_save
from lightning_smp.collectives import Collectives
from lightning_smp.engines import ShardingPlan, own_offload_config, selected_by
from lightning_smp.errors import CheckpointError, HybridShardConfigError, UnsupportedOptionError
from lightning_smp.fault_tolerance.trainer_state import check_data_can_follow, load_loop_state, loop_state, uncount_step
from lightning_smp.frontend import HybridShardFrontEnd, with_options
from lightning_smp.launcher import HybridShardMultiProcessingLauncher, MainProcessResults, choose_launcher
from lightning_smp.names import (
    FULL,
    GradientAccumulation,
    ProcessStartMethod,
    ShardingStrategyName,
    StartMethod,
    StateDictType,
)
from lightning_smp.optimizers import discard_on_zero_grad, skip_uncommitted_steps, ungated
from lightning_smp.precision import HybridShardPrecision, PrecisionSlot

#: what ``auto_wrap_policy`` and ``activation_checkpointing_policy`` take, as Lightning's FSDP strategies type it
#: (importable, so that the constructor's hints resolve at run time: LightningCLI, ``typing.get_type_hints``)
_POLICY = set[type[Module]] | Any | ModuleWrapPolicy

log = logging.getLogger(__name__)


@with_options
class HybridShardFSDPStrategy(HybridShardFrontEnd, FSDPStrategy):
    r"""FSDP with SageMaker SMP v2's ``hybrid_shard_degree``: shard inside groups of any size, replicate across them.

    A drop-in replacement for :class:`lightning.pytorch.strategies.FSDPStrategy`: every argument it takes is
    accepted and passed through unchanged, except that the sharding strategy and the device mesh follow
    ``hybrid_shard_degree``. Parameters, gradients and optimizer state are sharded inside groups of
    ``hybrid_shard_degree`` consecutive ranks (a 2-D ``DeviceMesh`` with axes ``("replicate", "shard")``); the
    frequent all-gathers and reduce-scatters stay inside a group and only a ``1/degree``-sized all-reduce of the
    gradients crosses groups.

    Arguments:
        accelerator, parallel_devices, cluster_environment, checkpoint_io: as for every Lightning strategy;
            the Trainer normally fills them in.
        precision_plugin: an :class:`FSDPPrecision` (the Trainer's ``precision=`` builds one); it is upgraded to
            :class:`~lightning_smp.precision.HybridShardPrecision`, which autocasts on the root device's type and
            supports norm clipping.
        process_group_backend: ``None`` (``"nccl"`` on CUDA, ``"gloo"`` on CPU) or any backend string
            ``torch.distributed`` accepts, including mixed ones such as ``"cuda:nccl,cpu:gloo"``.
        timeout: timeout of collective operations (default 30 minutes).
        cpu_offload: ``True``/``False`` or a ``torch.distributed.fsdp.CPUOffload``.
        mixed_precision: a ``torch.distributed.fsdp.MixedPrecision``; by default taken from the Trainer's ``precision``.
        auto_wrap_policy: a set of layer classes, a callable policy or a ``ModuleWrapPolicy``; ``None`` wraps only
            the root module (one FSDP unit).
        activation_checkpointing: deprecated in Lightning, use ``activation_checkpointing_policy``.
        activation_checkpointing_policy: a set of layer classes or a policy, as for ``auto_wrap_policy``.
        (the options, written from their declarations by python -m lightning_smp.generate:)
        hybrid_shard_degree: ``0`` (native FSDP: ``HYBRID_SHARD`` shards inside a node, ``FULL_SHARD`` over
            all ranks), ``1`` (no sharding: full replicas kept in sync like DDP), any divisor ``d >= 2`` of
            the world size (shard groups of ``d`` consecutive ranks, ``world_size / d`` replicas), or
            ``"auto"``: the planner chooses, when the model is set up, the degree with the least predicted
            step time whose per-rank peak fits ``memory_budget`` (see ``docs/planner.md``; the strategy's
            ``degree_plan`` holds its table). ``None`` (default): from the configuration sources (the CLI's
            ``smp:`` section, ``lightning_smp.init``, ``LIGHTNING_SMP_CONFIG``, ``SM_HP_MP_PARAMETERS``),
            else ``0``.
        fsdp_version: this library's key (SMP has none): ``1`` (``FullyShardedDataParallel``, drop-in for
            ``FSDPStrategy``) or ``2`` (``fully_shard``: per-parameter DTensor shards, and gradient
            accumulation that keeps gradients sharded). A layout that shards nothing runs on the DDP engine
            whichever it is. See ``docs/engines.md``. ``None`` (default): from the configuration sources
            (the CLI's ``smp:`` section, ``lightning_smp.init``, ``LIGHTNING_SMP_CONFIG``,
            ``SM_HP_MP_PARAMETERS``), else ``1``.
        memory_budget: this library's key: with ``hybrid_shard_degree="auto"``, what one rank's training may
            use, in bytes or as a string (``"40GB"``, ``"400MB"``); unset: the device's free memory (on the
            CPU the available RAM divided by the ranks of the node). ``None`` (default): from the
            configuration sources (the CLI's ``smp:`` section, ``lightning_smp.init``,
            ``LIGHTNING_SMP_CONFIG``, ``SM_HP_MP_PARAMETERS``).
        links: this library's key: with ``hybrid_shard_degree="auto"``, what the planner times the step on:
            a link preset's name (``lightning_smp.planner.LINK_PRESETS``), a JSON file of ``Links``
            (``lightning_smp.planner.save_links``), or ``"calibrate"``: measured on this job's own process
            groups when the model is set up (a few seconds, every rank alike); unset: the default preset.
            ``None`` (default): from the configuration sources (the CLI's ``smp:`` section,
            ``lightning_smp.init``, ``LIGHTNING_SMP_CONFIG``, ``SM_HP_MP_PARAMETERS``).
        async_save: this library's key: ``True`` writes sharded checkpoints in the background: every
            ``save_checkpoint`` (``ModelCheckpoint``'s included) returns once the state is copied off the
            training tensors, the checkpoint is committed by rename once every rank has written,
            ``ModelCheckpoint``'s ``last`` link, its removals and the loggers wait for that commit, and a
            failed write raises on every rank at the next training step (see ``docs/checkpoints.md``). Needs
            ``state_dict_type="sharded"``. ``None`` (default): from the configuration sources (the CLI's
            ``smp:`` section, ``lightning_smp.init``, ``LIGHTNING_SMP_CONFIG``, ``SM_HP_MP_PARAMETERS``),
            else ``False``.
        fault_tolerance: this library's key: replica groups that survive a node (torchft): a mapping with
            ``lighthouse``, ``group`` and ``groups``, and optionally ``min_groups``, ``timeout``,
            ``quorum_timeout`` and ``host`` (:class:`lightning_smp.config.fault_tolerance.FaultTolerance`:
            ``lighthouse`` is ``host:port``, ``group`` this group's id, ``groups`` how many); each group of
            ``hybrid_shard_degree`` ranks is its own job. torchft's ``TORCHFT_LIGHTHOUSE``,
            ``REPLICA_GROUP_ID`` and ``NUM_REPLICA_GROUPS`` set it too. Needs the ``ft`` extra (``pip
            install lightning-smp[ft]``). See ``docs/fault-tolerance.md``. ``None`` (default): from the
            configuration sources (the CLI's ``smp:`` section, ``lightning_smp.init``,
            ``LIGHTNING_SMP_CONFIG``, ``SM_HP_MP_PARAMETERS``).
        replica_sync: this library's key: semi-synchronous replica groups (DiLoCo): each replica group
            trains on its own and the groups sync every ``every`` optimizer steps through an outer
            optimizer; nothing crosses the groups in between. A mapping with ``every`` and optionally
            ``outer``, ``outer_lr``, ``outer_momentum``, ``nesterov``, ``fragments``, ``backup``, ``delay``
            and ``compress`` (:class:`lightning_smp.config.replica_sync.ReplicaSync`). Runs on FSDP2 where
            the layout shards and on the DDP engine for groups of one rank, with at least two replica
            groups. See ``docs/replica-sync.md``. ``None`` (default): from the configuration sources (the
            CLI's ``smp:`` section, ``lightning_smp.init``, ``LIGHTNING_SMP_CONFIG``,
            ``SM_HP_MP_PARAMETERS``).
        sharding_strategy: ``"HYBRID_SHARD"`` (default), ``"_HYBRID_SHARD_ZERO2"``, ``"FULL_SHARD"``,
            ``"SHARD_GRAD_OP"`` or ``"NO_SHARD"`` (any case), or a ``ShardingStrategy``. With
            ``hybrid_shard_degree >= 2`` anything but ``"_HYBRID_SHARD_ZERO2"`` becomes ``"HYBRID_SHARD"``
            (a warning names both). A shard group that spans the whole world runs ``FULL_SHARD``
            (``SHARD_GRAD_OP`` for ZeRO-2), which costs no all-reduce over size-1 replica groups.
        state_dict_type: ``"sharded"`` (default) or ``"full"``. ``"sharded"``: a folder written by
            ``torch.distributed.checkpoint``, every rank writing its shard once (replica group 0 only),
            nothing gathered on one rank; the default because resuming is what checkpoints during training
            are for, and it resumes exactly at any degree and world size. ``"full"``: one file assembled
            once on rank 0, which also loads on a single device. Either loads whatever is configured;
            convert with ``python -m lightning_smp.checkpoint consolidate SRC DST`` (see
            :mod:`lightning_smp.checkpoint`).
        device_mesh: ``None`` (default: built from ``hybrid_shard_degree``), a tuple ``(replicas,
            shard_degree)`` (same as ``hybrid_shard_degree=shard_degree``), or a 2-D ``DeviceMesh`` you
            built yourself (used as is; its second dimension is the shard group). Contradicting
            ``hybrid_shard_degree`` is an error.
        start_method: how processes are started. ``None`` (default): ``"fork"`` in an interactive session
            (Jupyter, IPython), else ``"popen"`` (re-run the script per rank, like Lightning's FSDP). Also
            ``"fork"``, ``"spawn"`` or ``"forkserver"`` (Lightning's multiprocessing launcher). Processes
            started externally (``torchrun``, SLURM) are always used as they are. With fork/spawn, the
            process that calls ``fit`` gets the trained weights, loop counters, metrics and callback reports
            back, and its ``trainer.save_checkpoint`` writes one full checkpoint file; such a Trainer fits
            once (use a new one). See :mod:`lightning_smp.launcher`.
        gradient_accumulation: what the micro-batches before the last of an optimizer step communicate (each
            mode: :mod:`lightning_smp.accumulation`): ``None`` (default: the engine's own default),
            ``"no_sync"`` (FSDP1's default, Lightning's behaviour: nothing, but every rank holds the full
            unsharded gradient), ``"every_micro_batch"`` (full reduction each: sharded gradients, ``k``
            times the traffic) or ``"defer_all_reduce"`` (FSDP2's default: reduce-scatter inside the shard
            group each, the cross-replica all-reduce once on the last; sharded gradients and one crossing of
            the replicas per step).
        broadcast_buffers: ``True`` (default, DDP's): every rank gets global rank 0's buffers (BatchNorm's
            running statistics) before a forward that follows a training forward outside an accumulation
            window, as DDP's ranks do; ``False``: each rank keeps its own, as FSDP does. See
            ``docs/engines.md``.
        (end of the options)
        \**kwargs: passed to the engine: ``FullyShardedDataParallel`` for FSDP1 (e.g. ``process_group``,
            ``limit_all_gathers``, ``use_orig_params``, defaulting to ``True``), ``fully_shard`` for FSDP2
            (``shard_placement_fn``, ``ignored_params``; FSDP1-only arguments are refused naming their
            equivalent). A ``process_group`` you pass is used as is (no mesh is built); its size must match
            ``hybrid_shard_degree`` when both are given.

    Example::

        import lightning as L
        import lightning_smp  # registers "smp_hybrid", "smp_hybrid_zero2", "smp_hybrid_notebook"

        L.Trainer(strategy=lightning_smp.HybridShardFSDPStrategy(hybrid_shard_degree=2), devices=4)
    """

    strategy_name = "smp_hybrid"
    # Lightning refuses every name in FSDPStrategy's class-level list on CPU; ours must not share it.
    _registered_strategies: list[str] = []

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: bool | CPUOffload | None = None,
        mixed_precision: MixedPrecision | None = None,
        auto_wrap_policy: _POLICY | None = None,
        activation_checkpointing: type[Module] | list[type[Module]] | None = None,
        activation_checkpointing_policy: _POLICY | None = None,
        # the options: generated from lightning_smp.config.options (python -m lightning_smp.generate)
        sharding_strategy: ShardingStrategy | ShardingStrategyName = "HYBRID_SHARD",
        state_dict_type: StateDictType = "sharded",
        device_mesh: tuple[int, int] | DeviceMesh | None = None,
        *,
        hybrid_shard_degree: int | Literal["auto"] | None = None,
        fsdp_version: int | None = None,
        memory_budget: int | str | None = None,
        links: str | None = None,
        async_save: bool | None = None,
        fault_tolerance: dict[str, Any] | None = None,
        replica_sync: dict[str, Any] | None = None,
        start_method: StartMethod | None = None,
        gradient_accumulation: GradientAccumulation | None = None,
        broadcast_buffers: bool = True,
        # end of the generated options
        **kwargs: Any,
    ) -> None:
        # the options (the generated parameters, and a subclass's own in kwargs) checked, before anything is built
        kwargs = self._take_options(locals(), kwargs, auto_wrap_policy=auto_wrap_policy, mixed_precision=mixed_precision,
                                    cpu_offload=cpu_offload)
        # Lightning refuses hybrid strategies before a mesh exists, and a mesh needs the process group:
        # start as FULL_SHARD and set the real strategy in setup_environment().
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            cpu_offload=cpu_offload,
            mixed_precision=mixed_precision,
            auto_wrap_policy=auto_wrap_policy,
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_policy=activation_checkpointing_policy,
            sharding_strategy="FULL_SHARD",
            state_dict_type=self.options.state_dict_type,
            device_mesh=None,
            **kwargs,
        )
        if own_offload_config(cpu_offload):
            # FSDP2's own config, kept as given (FSDPStrategy would make it a CPUOffload and lose its settings)
            self.cpu_offload = cpu_offload  # type: ignore[assignment]  # FSDPStrategy annotates FSDP1's type only
        self._launch_results: MainProcessResults | None = None
        self._accumulating = False  # inside block_backward_sync: the micro-batches before a window's last
        self._undo_deferral: Callable[[], None] | None = None
        self._validating_synced: Any = None  # (replica_sync: the synced weights shown during a validation run)

    # ------------------------------------------------------------------ launch and process groups

    @override
    def _configure_launcher(self) -> None:
        # At Trainer(...), before any process is started: resolve the configuration once and check the world-size
        # facts, so that a bad degree fails here and not in the ranks.
        # the engine is known now (an argument, or any configuration source): the arguments are checked against it
        layout = self.core.configure(self.num_nodes, self.num_processes, "trainer")
        self.precision_plugin.set_device_type(self.root_device.type)
        self._warn_override_once(layout)
        self._launcher = choose_launcher(
            self._start_method, self.cluster_environment, owner="HybridShardFSDPStrategy", creator="a Trainer",
            script=lambda cluster: _SubprocessScriptLauncher(cluster, self.num_processes, self.num_nodes),
            in_process=self._in_process_launcher)

    def _in_process_launcher(self, start_method: ProcessStartMethod) -> HybridShardMultiProcessingLauncher:
        self._launch_results = MainProcessResults()
        return HybridShardMultiProcessingLauncher(
            self, start_method, results=self._launch_results, run=self.checkpoint_run,
            adopt_plan=lambda chosen: self.core.adopt(chosen, self.num_nodes, self.num_processes),
        )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # Same inputs on every rank, so every rank fails identically here, before the first collective.
        self._set_up_mesh(self.num_nodes, self.num_processes, self.root_device.type)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A collective that failed because a node stopped answering says which node that was, on every rank."""
        note = self._lost_peer_note(exception)
        if note is not None:
            log.error(note)
            if hasattr(exception, "add_note"):  # shown with the traceback (Python 3.11+)
                exception.add_note(note)
        super().on_exception(exception)

    def _plan(self) -> ShardingPlan:
        """What the engine builds: this layout on the root device, with the user's own FSDP arguments."""
        module = self.lightning_module
        return self.core.plan(self.root_device, mixed_precision=self.mixed_precision_config, cpu_offload=self.cpu_offload,
                              options=dict(self.kwargs), precision=str(self.precision_plugin.precision),
                              steps_inside_a_step=module is not None and not module.automatic_optimization)

    # ------------------------------------------------------------------ model wrapping

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # a ModelCheckpoint(save_top_k=0) without save_last never saves
        saving = [cb for cb in trainer.checkpoint_callbacks
                  if getattr(cb, "save_top_k", 1) != 0 or getattr(cb, "save_last", False)]
        if trainer.state.fn == TrainerFn.FITTING and saving:
            # fail now, not at the first save hours into training (the same check as checkpoint_lib.save)
            datamodule = getattr(trainer, "datamodule", None)
            problem = checkpoint_lib.hyperparameters_problem(trainer.lightning_module, datamodule)
            problem = self.broadcast(problem if self.global_rank == 0 else None)
            if problem is not None:
                raise CheckpointError(f"ModelCheckpoint could not save this run: {problem}")
        module = trainer.lightning_module
        if (trainer.state.fn == TrainerFn.FITTING and module is not None and not module.automatic_optimization
                and not self.engine.capabilities.steps_inside_a_step):
            raise UnsupportedOptionError(
                f"automatic_optimization=False with fsdp_version={self.fsdp_version}: a Lightning step runs inside"
                f" the sharded root's forward, and the {self.engine.name} engine cannot run manual_backward there"
                " (Lightning's FSDPStrategy fails alike). Fix:"
                f" {selected_by(lambda capabilities: capabilities.steps_inside_a_step)}, which runs manual"
                " optimization (several backward passes and optimizers per step included), or automatic optimization."
            )
        if module is not None and self.core.auto_pending:
            # hybrid_shard_degree="auto": chosen from the finished model, before sharding
            if is_overridden("configure_model", module) and not self.core.engine_options.get("auto_wrap_policy"):
                rank_zero_warn(
                    "hybrid_shard_degree='auto': wrap() calls in configure_model shard nothing (the degree is chosen"
                    " after configure_model, from the finished model), and without auto_wrap_policy the whole model"
                    " becomes one FSDP unit. Fix: pass auto_wrap_policy (e.g. {YourBlock}), or a number as"
                    " hybrid_shard_degree."
                )
            self._choose_degree(
                module, num_nodes=self.num_nodes, devices=self.num_processes, device=self.root_device,
                precision=str(self.precision_plugin.precision),
                micro_batches=trainer.accumulate_grad_batches if trainer.state.fn == TrainerFn.FITTING else 1,
                training=trainer.state.fn == TrainerFn.FITTING,
            )
        super().setup(trainer)
        self.precision_plugin.fsdp_module = self.model
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and (self._replicas is not None or self.core.replica_sync is not None):
            callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]  # (set by Lightning's connector)
            if not any(isinstance(callback, ReplicaGroupMetrics) for callback in callbacks):
                # (each fault-tolerant step's groups, commit and heal, each sync's report, to every logger)
                callbacks.append(ReplicaGroupMetrics())
        if self._replicas is not None and trainer.state.fn == TrainerFn.FITTING:
            self._set_up_replica_groups(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.model is not None:
            self._check_one_optimizer(len(self.optimizers))
            self._start_replica_sync(self.model)
        if self._background is not None and self._undo_deferral is None:
            self._undo_deferral = defer_until_commit(trainer, self._background)
        if trainer.state.fn == TrainerFn.FITTING and trainer.accumulate_grad_batches > 1:
            self._warn_no_sync(trainer.accumulate_grad_batches)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            self._gate_steps(discard_on_zero_grad(optimizer, self._discard_window))
        self.optimizers = self.optimizers  # Lightning's wrappers again, over the changed classes

    def _set_up_replica_groups(self, trainer: pl.Trainer) -> None:
        """``fault_tolerance``: the gradients averaged across groups before clipping and each step, step-interval
        schedulers that skip an uncommitted step, and what healing copies (the model's shards, the optimizers, the
        schedulers, the loop's counters and data position)."""
        if trainer.lightning_module is not None:
            check_data_can_follow(trainer.lightning_module)
        if self._crosses_each_step:
            self.precision_plugin.reduce_across_groups = self._reduce_across_groups
        configs = self.lr_scheduler_configs
        for config in configs:
            if config.interval == "step":
                skip_uncommitted_steps(config.scheduler, lambda: self.step_committed)
        if self.model is not None:
            self._track_for_healing(self.model, lambda: [_unwrap(o) for o in self.optimizers],
                                    extra=lambda: loop_state(trainer, configs),
                                    load_extra=lambda state: load_loop_state(trainer, configs, state))

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        module = self.lightning_module
        if not self.step_committed and module is not None:
            uncount_step(module.trainer)  # (global_step stays: the step did not happen)
        self._after_inner_step()  # replica_sync: the fragments whose turn it is sync
        return result

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        # replica_sync: every group validates the weights as last synced (nothing is sent, training is unchanged)
        self._validating_synced = self.synced_weights()
        self._validating_synced.__enter__()

    @override
    def on_validation_end(self) -> None:
        if self._validating_synced is not None:
            self._validating_synced.__exit__(None, None, None)  # each group's own weights back
            self._validating_synced = None
        super().on_validation_end()

    def _trained_module(self) -> Module | None:
        return self.model

    def _warn_no_sync(self, micro_batches: int) -> None:
        """Once per fit: what accumulating under ``no_sync`` costs each rank, when nobody chose it explicitly."""
        mode = accumulation_mode(self.gradient_accumulation)
        if not mode.holds_unsharded or self.options.gradient_accumulation == mode.name or self.model is None:
            return
        extra = no_sync_extra_bytes(self.model)
        if extra > 0:
            rank_zero_warn(
                f"accumulate_grad_batches={micro_batches} runs the {self.engine.name} engine's {mode.name}: between"
                f" micro-batches every rank holds the full unsharded gradient, {fmt_bytes(extra)} ({extra} bytes) more"
                " per rank than the sharded one. Fix:"
                f" {selected_by(lambda capabilities: not accumulation_mode(capabilities.default_accumulation).holds_unsharded)}"
                " (gradients stay sharded and cross the replicas once per optimizer step), or"
                " gradient_accumulation='every_micro_batch' (sharded, but"
                f" {micro_batches}x the gradient traffic). gradient_accumulation='no_sync' keeps this and silences"
                " the warning."
            )

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """The micro-batches of gradient accumulation before the last: :attr:`gradient_accumulation` decides what they
        communicate; on leaving, full synchronisation is back for the last one."""
        if self.model is None:
            yield
            return
        self._accumulating = True
        try:
            with self.engine.accumulation_context(self.model, self.gradient_accumulation), \
                    buffers.accumulation_window(self.model):
                yield
        finally:
            self._accumulating = False

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        self._refuse_shard_values(closure_loss)
        if self.model is not None:
            self.core.before_backward(self.model)
            module = self.lightning_module
            if module is not None and not module.automatic_optimization:
                self.engine.prepare_backward(self.model, closure_loss)
        self._begin_replica_step()
        loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self.model is not None:
            self.core.after_backward(self.model, reduced=not self._accumulating)
        return loss

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        self._refuse_shard_values(tensor)  # a metric logged with sync_dist=True
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def _setup_model(self, model: Module) -> Module:
        return self._shard(model, self.kwargs)

    # ------------------------------------------------------------------ steps

    def _run_step(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        """Run the LightningModule's ``name`` step through the sharded root's ``__call__`` when the engine shards in
        place (FSDP2: the root is the LightningModule itself, and its parameters are gathered by its forward hooks,
        which Lightning's direct call of ``training_step`` would skip)."""
        model, module = self.model, self.lightning_module
        if model is None or module is None:
            raise HybridShardConfigError("HybridShardFSDPStrategy has no model to run a step on.")
        with context:
            if model is not module:  # a wrapper (FSDP1): Lightning's redirection through its forward
                return self._forward_redirection(model, module, name, *args, **kwargs)
            return self.engine.call_through_root(model, getattr(module, name), *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("training_step", self.precision_plugin.train_step_context(), *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        with self._sharded_context():
            yield

    # ------------------------------------------------------------------ precision

    # (mypy reads a descriptor's setter type from its getter: the slot takes any Precision, or None)
    precision_plugin = PrecisionSlot(  # type: ignore[override]
        FSDPPrecision, HybridShardPrecision, lambda: HybridShardPrecision("32-true"), strategy="HybridShardFSDPStrategy",
        front_end="Trainer", upgrade=HybridShardPrecision.from_plugin)

    # ------------------------------------------------------------------ state dicts

    def _sharded_model(self) -> ShardedModel:
        return self.core.sharded_model(self.model, self.root_device, "HybridShardFSDPStrategy")

    def full_state_dict(self) -> dict[str, Any]:
        """The unsharded model weights on global rank 0 (an empty dict on the other ranks). Call it on every rank.

        Assembled once: only replica group 0 gathers, the other replicas skip the work. In the process that forked the
        ranks (a notebook), after they ended: the full weights they sent back.
        """
        module = self.lightning_module
        if self._in_launching_process() and module is not None:
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        return checkpoint_lib.full_model_state(self._sharded_model())

    def full_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The unsharded state of ``optimizer`` on global rank 0 (torch's standard layout), empty elsewhere. Collective."""
        return checkpoint_lib.full_optimizer_state(self._sharded_model(), _unwrap(optimizer))

    def _in_launching_process(self) -> bool:
        """True in the process (a notebook) that forked the ranks: its module is unwrapped and holds full weights."""
        return self._launch_results is not None and self._launch_results.in_main_process

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        kind, background, writes_data, run = self._state_dict_type, self._background, True, self.checkpoint_run
        if not self._writes_checkpoints():
            # fault_tolerance: every group holds the same state, one live group writes it; under replica_sync each
            # other group keeps its own inner optimizer state beside it
            own = self._own_inner_checkpoint(checkpoint.get(OPTIMIZERS_KEY, []), filepath)
            if own is None:
                return
            checkpoint, filepath, run = own
        elif self._launch_results is not None and self._launch_results.in_main_process:
            # the ranks that held the shards have ended: one full file, with the optimizer state they sent back
            checkpoint, kind, background = self._launch_results.complete_checkpoint(
                {**checkpoint, **self._replica_checkpoint_state()}), FULL, None
        else:
            # replica_sync: synced when the model's state was taken (lightning_module_state_dict)
            checkpoint = self._replica_sync_checkpoint({**checkpoint, **self._replica_checkpoint_state()},
                                                       self._sharded_model(),
                                                       [_unwrap(o) for o in self.optimizers], kind,
                                                       self._local_state_check)
            if background is not None:
                # (replica_sync: every group writes its own inner optimizer state)
                writes_data = self.outer_sync is not None or self._sharded_model().writes_data()
        # atomic, never over another run's checkpoint, tensors written once (see lightning_smp.checkpoint)
        checkpoint_lib.save(checkpoint, filepath, kind=kind, collectives=Collectives.current(self.root_device),
                            run=run, layout=self.core.layout, storage_options=storage_options,
                            background=background, writes_data=writes_data)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        # ModelCheckpoint removes the checkpoint a new one replaces: only once that one is committed, and renamed out
        # of the way first (Lightning's CheckpointIO deletes a sharded folder file by file under its name; saves do
        # not go through the CheckpointIO either)
        def remove() -> None:
            if self.is_global_zero and self._writes_checkpoints():  # one rank removes, as in Lightning
                remove_atomically(Path(filepath))
            if self.is_global_zero:
                self._remove_own_inner(filepath)  # (replica_sync: what this group kept beside it)

        if self._background is not None:
            self._background.after_commit(remove)
        else:
            remove()

    # ------------------------------------------------------------------ background saves (async_save)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._poll_checkpoint(Collectives.current(self.root_device))

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self.sync_replicas()  # replica_sync: fit ends on synced weights, whatever step it stopped at
        self.wait_for_checkpoint()  # after the callbacks' on_train_end, which may have saved

    @override
    def teardown(self) -> None:
        self.end_checkpoint_after_error()  # a save still in flight here: fit ended with an error
        if self._background is not None:
            self._background.buffers.clear()  # the staging memory, until the next save
        if self._undo_deferral is not None:
            self._undo_deferral()
            self._undo_deferral = None
        if self._replicas is not None:
            self._replicas.shutdown()
            self._replicas = None
        super().teardown()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.wait_for_checkpoint()  # it may be the checkpoint in flight
        # always weights_only: a sharded folder or full file, resharded to this degree and world size
        module = self.lightning_module
        if module is None:
            raise HybridShardConfigError("HybridShardFSDPStrategy.load_checkpoint needs the LightningModule set up.")
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        optimizers = [_unwrap(o) for o in self.optimizers] if fitting else []
        outer = self._outer_optimizer() if fitting else None
        with ungated(optimizers):  # (DCP creates a missing optimizer state with a step, which is no training step)
            checkpoint = checkpoint_lib.load(self._sharded_model(), checkpoint_path, optimizers=optimizers,
                                             strict=module.strict_loading, model_name=type(module).__name__,
                                             extra=self._replica_sync_load_entries(optimizers, outer))
        record = checkpoint.get(REPLICA_SYNC_KEY)
        self._resume_replica_sync(checkpoint, outer)
        if fitting:
            self._load_own_inner_state(checkpoint_path, self._sharded_model(), optimizers, record)
            # resuming continues the run that wrote the checkpoint: its own files may be overwritten again
            self.checkpoint_run.continue_from(checkpoint)
            # replica groups: torchft's step from the checkpoint (one without fault_tolerance: its global step)
            checkpoint.setdefault(REPLICA_GROUPS_KEY, {"step": checkpoint.get("global_step", 0), "batches_committed": 0})
            self._resume_replica_groups(checkpoint)
        return checkpoint

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # (Lightning takes the model's state first when it makes a checkpoint: replica_sync saves synced weights)
        self.sync_replicas()
        if self._in_launching_process():
            module = self.lightning_module
            return module.state_dict() if module is not None else {}
        return model_state_to_save(self._sharded_model(), self._state_dict_type, self._local_state_check)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        # its place among the run's optimizers names its part of a background save's check
        index = next((i for i, o in enumerate(self.optimizers) if _unwrap(o) is _unwrap(optimizer)), len(self.optimizers))
        return optimizer_state_to_save(self._sharded_model(), _unwrap(optimizer), index, self._state_dict_type,
                                       self._local_state_check)


def _unwrap(optimizer: Any) -> Optimizer:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` (its public ``optimizer`` property)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


__all__ = ["HybridShardFSDPStrategy"]
