"""``lightning_smp.fabric.HybridShardFSDPStrategy``: hybrid sharding for hand-written loops with Lightning Fabric.

Lightning's own naming: the same class name as the Trainer strategy, under a ``fabric`` module, subclassing
``lightning.fabric.strategies.FSDPStrategy``. ``import lightning_smp`` registers ``smp_hybrid``,
``smp_hybrid_zero2``, ``smp_hybrid_fsdp2`` and ``smp_hybrid_notebook`` in Fabric's registry too::

    fabric = L.Fabric(strategy="smp_hybrid", accelerator="cpu", devices=4)   # or HybridShardFSDPStrategy(...)
    fabric.launch()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))

It is thin glue around :class:`lightning_smp.core.HybridShardCore`, the same core as the Trainer strategy's: the
same arguments and checks (before any process starts), every configuration source, every engine, replicas from rank
0's weights, and the same checkpoint formats (a checkpoint of either front end loads in the other).
``fabric.no_backward_sync(model)`` follows ``gradient_accumulation`` (FSDP2: only the cross-replica all-reduce is
deferred, gradients stay sharded); an optimizer step after a backward that never reduced its gradients is refused
(:class:`~lightning_smp.errors.GradientSyncError`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision.fsdp import FSDPPrecision
from lightning.fabric.strategies import FSDPStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.load import _move_state_into
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smp import buffers
from lightning_smp import checkpoint as checkpoint_lib
from lightning_smp.checkpoint.fabric_state import (
    fabric_checkpoint,
    load_raw,
    restore_fabric_state,
    split_state,
    state_of,
)
from lightning_smp.checkpoint.format import OPTIMIZERS_KEY, REPLICA_SYNC_KEY
from lightning_smp.checkpoint.saving import check_storage_options
from lightning_smp.collectives import Collectives
from lightning_smp.engines import ShardingPlan, engine_of, own_offload_config
from lightning_smp.engines.base import Training
from lightning_smp.engines.unused import Unreduced
from lightning_smp.errors import GradientSyncError, HybridShardConfigError, UnsupportedOptionError
from lightning_smp.frontend import HybridShardFrontEnd, with_options
from lightning_smp.launcher import FabricWaitingLauncher, choose_launcher
from lightning_smp.names import (
    FULL,
    GradientAccumulation,
    ShardingStrategyName,
    StartMethod,
    StateDictType,
)
from lightning_smp.optimizers import discard_on_zero_grad, ungated
from lightning_smp.precision import HybridShardFabricPrecision, PrecisionSlot

#: what ``auto_wrap_policy`` and ``activation_checkpointing_policy`` take, as Lightning's FSDP strategies type it
#: (importable, so that the constructor's hints resolve at run time: LightningCLI, ``typing.get_type_hints``)
_POLICY = set[type[Module]] | Any | ModuleWrapPolicy


class _HybridBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: what the strategy's ``gradient_accumulation`` says, and a record of
    whether the latest backward ran without reducing its gradients."""

    def __init__(self, strategy: HybridShardFSDPStrategy) -> None:
        self.strategy = strategy
        self.active = False

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, Module) or not self.strategy.engine.has_wrapped(module):
            # as Lightning's FSDPStrategy: a module that is not sharded would silently reduce on every backward
            raise UnsupportedOptionError(
                "Blocking backward sync is only possible if the module passed to `no_backward_sync` is the model that"
                f" fabric.setup_module() returned (sharded by {type(self.strategy).__name__}). Got:"
                f" {type(module).__name__}."
            )
        return self._blocked(module)

    @contextmanager
    def _blocked(self, module: Module) -> Generator[None, None, None]:
        self.active = True
        try:
            with self.strategy.engine.accumulation_context(module, self.strategy.gradient_accumulation), \
                    buffers.accumulation_window(module):
                yield
        finally:
            self.active = False


@with_options
class HybridShardFSDPStrategy(HybridShardFrontEnd, FSDPStrategy):
    r"""Hybrid sharding (SMP's ``hybrid_shard_degree``) for Lightning Fabric: the options of
    :class:`lightning_smp.HybridShardFSDPStrategy`, declared once for both (:mod:`lightning_smp.config.options`).

    With ``async_save=True``, ``fabric.save`` returns once the state is copied off the training tensors; a failed
    background write raises on every rank at the next ``optimizer.step()``, the next save or load, or at
    :meth:`wait_for_checkpoint` (call it before the end of the program to see a failure of the last save; the
    process waits for the write in any case).

    Arguments:
        accelerator, parallel_devices, cluster_environment: as for every Fabric strategy; Fabric normally fills
            them in.
        precision: an :class:`FSDPPrecision` (``Fabric(precision=...)`` builds one); it is upgraded to
            :class:`~lightning_smp.precision.HybridShardFabricPrecision`, which autocasts on the root device's type.
        process_group_backend, timeout, cpu_offload, mixed_precision, auto_wrap_policy, activation_checkpointing,
            activation_checkpointing_policy: as for :class:`lightning_smp.HybridShardFSDPStrategy`.
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
        \**kwargs: passed to the engine, as for :class:`lightning_smp.HybridShardFSDPStrategy`.
    """

    _created_by = "Fabric"
    _mesh_built_in = "inside fabric.launch()"
    _registered_strategies: list[str] = []

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
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
        # the options (the generated parameters, and a subclass's own in kwargs) checked, before anything is built:
        # the Trainer strategy's one call
        kwargs = self._take_options(locals(), kwargs, auto_wrap_policy=auto_wrap_policy, mixed_precision=mixed_precision,
                                    cpu_offload=cpu_offload)
        # FULL_SHARD until the mesh exists (Lightning refuses hybrid strategies without one); see setup_environment
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            precision=precision, process_group_backend=process_group_backend, timeout=timeout,
            cpu_offload=True if own_offload_config(cpu_offload) else cpu_offload,
            mixed_precision=mixed_precision, auto_wrap_policy=auto_wrap_policy,
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_policy=activation_checkpointing_policy, sharding_strategy="FULL_SHARD",
            state_dict_type=self.options.state_dict_type, device_mesh=None, **kwargs,
        )
        self._backward_sync_control: _HybridBackwardSyncControl = _HybridBackwardSyncControl(self)
        # whether the latest backward ran inside no_backward_sync (its gradients are not reduced yet)
        self._unreduced = False
        self._module: Module | None = None  # the sharded root set up last, for the check before each step
        self._module_engine: Training | None = None  # its engine, found once
        self._optimizers: list[Optimizer] = []  # those set up here (healing copies their state)
        self._healing_state: dict[str, Any] = {}  # the loop's own state healing copies (fault_tolerant_state)
        self._settled = False  # (fault_tolerance) whether the group's gradients were settled since the last backward

    # ------------------------------------------------------------------ precision

    # (mypy reads a descriptor's setter type from its getter: the slot takes any Precision, or None)
    precision = PrecisionSlot(  # type: ignore[override]
        FSDPPrecision, FSDPPrecision, lambda: HybridShardFabricPrecision("32-true"),
        strategy="lightning_smp.fabric.HybridShardFSDPStrategy", front_end="Fabric")

    # ------------------------------------------------------------------ launch and process groups

    @override
    def _configure_launcher(self) -> None:
        # At Fabric(...), before any process starts: the configuration once, the engine, the world-size facts
        layout = self.core.configure(self.num_nodes, self.num_processes, "fabric")
        device_type = self.root_device.type
        if isinstance(self._precision, FSDPPrecision) and not isinstance(self._precision, HybridShardFabricPrecision):
            self._precision = HybridShardFabricPrecision.from_plugin(self._precision, device_type)
        elif isinstance(self._precision, HybridShardFabricPrecision):
            self._precision.device_type = device_type
        self._warn_override_once(layout)
        self._launcher = choose_launcher(
            self._start_method, self.cluster_environment, owner="lightning_smp.fabric.HybridShardFSDPStrategy",
            creator="Fabric",
            script=lambda cluster: _SubprocessScriptLauncher(cluster, self.num_processes, self.num_nodes),
            in_process=lambda start_method: FabricWaitingLauncher(self, start_method=start_method))

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_up_mesh(self.num_nodes, self.num_processes, self.root_device.type)

    def _plan(self) -> ShardingPlan:
        return self.core.plan(self.root_device, mixed_precision=self.mixed_precision_config,
                              cpu_offload=self.cpu_offload, options=dict(self._fsdp_kwargs),
                              precision=str(self.precision.precision))

    # ------------------------------------------------------------------ modules and optimizers

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler: Any = None,
                                    ) -> tuple[Module, list[Optimizer], Any]:
        if self.engine.capabilities.replaces_parameters:
            raise HybridShardConfigError(
                f"fabric.setup(model, optimizer) with fsdp_version={self.fsdp_version}: sharding replaces the"
                " model's parameters, so an optimizer created before would update nothing. Fix: model ="
                " fabric.setup_module(model), then create the optimizer from model.parameters() and call"
                " fabric.setup_optimizers(optimizer)."
            )
        self._choose(module, optimizers)
        module, optimizers, scheduler = super().setup_module_and_optimizers(module, optimizers, scheduler)
        for optimizer in optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]:
            self._own_optimizer(optimizer)
        return module, optimizers, scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return self._own_optimizer(super().setup_optimizer(optimizer))

    def _own_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """An optimizer set up here: ``zero_grad`` discards a window; with ``fault_tolerance`` it steps only when every
        group commits, and healing copies its state."""
        self._optimizers.append(optimizer)
        self._check_one_optimizer(len(self._optimizers))
        return self._gate_steps(discard_on_zero_grad(optimizer, self._discard_window))

    def fault_tolerant_state(self, state: dict[str, Any]) -> None:
        """With ``fault_tolerance``: what else a healing group copies from a live peer, beside the module and the
        optimizers set up here: the loop's own state, as for ``fabric.save`` (schedulers and stateful data loaders by
        their ``state_dict()``, plain values such as the iteration counter). A peer's values are put into ``state``
        in place (objects with ``load_state_dict()`` restored, other entries replaced) at the healing group's first
        step, before ``optimizer.step()`` returns. Call it once, after ``fabric.setup_module``."""
        self._healing_state = state

    def _trained_module(self) -> Module | None:
        return self._module

    def _discard_window(self) -> None:
        super()._discard_window()
        self._unreduced = False  # (nothing left unreduced: the next step is no longer refused)

    def _choose(self, module: Module, optimizers: list[Optimizer]) -> None:
        """hybrid_shard_degree="auto": chosen from the module handed to Fabric, before it is sharded."""
        if self.core.auto_pending:
            self._choose_degree(module, num_nodes=self.num_nodes, devices=self.num_processes, device=self.root_device,
                                precision=str(self.precision.precision), micro_batches=1, optimizers=optimizers)

    @override
    def setup_module(self, module: Module) -> Module:
        self._choose(module, [])
        module = self._shard(module, self._fsdp_kwargs)
        self._module, self._module_engine = module, engine_of(module)
        self._start_replica_sync(module)
        self._track_for_healing(module, lambda: list(self._optimizers), extra=self._loop_state,
                                load_extra=self._load_loop_state)
        return module

    def _loop_state(self) -> dict[str, Any]:
        return {key: state_of(value) for key, value in self._healing_state.items()
                if not isinstance(value, (Module, Optimizer))}

    def _load_loop_state(self, state: dict[str, Any]) -> None:
        _move_state_into(source=dict(state), destination=self._healing_state, keys=set(state))

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        return self._sharded_context()

    # ------------------------------------------------------------------ backward, clipping and steps

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        # fabric.backward(loss) passes no module unless given model=...: the sharded root set up last is the one
        self._refuse_shard_values(tensor)
        sharded = module if module is not None else self._module
        if sharded is not None and self._engine_of(sharded) is not None:
            self.core.before_backward(sharded)
        self._begin_replica_step()
        self._settled = False
        super().backward(tensor, module, *args, **kwargs)
        self._unreduced = self._backward_sync_control.active
        if sharded is not None and self._engine_of(sharded) is not None:
            self.core.after_backward(sharded, reduced=not self._unreduced)

    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        self._refuse_shard_values(tensor)  # fabric.all_reduce of a value computed from shards
        return super().all_reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self._unreduced:
            raise GradientSyncError(
                "optimizer.step() right after a backward inside fabric.no_backward_sync(model): that backward's"
                " gradients were never reduced across ranks (under FSDP2 they are not even assigned), so the step"
                " would silently do nothing or let the replicas drift apart. Fix: run the last micro-batch's backward"
                " outside no_backward_sync, e.g. `with fabric.no_backward_sync(model, enabled=is_accumulating):`."
            )
        self._settle(optimizer)
        self._poll_checkpoint(Collectives.current(self.root_device))  # a background save's failure surfaces here
        result = super().optimizer_step(optimizer, **kwargs)
        self._after_inner_step()  # replica_sync: the fragments whose turn it is sync
        return result

    def _settle(self, optimizer: Any) -> None:
        """Before a step: the engine's check and DDP's ``.grad`` rule inside the group, then (``fault_tolerance``)
        the average across groups. With ``fault_tolerance`` also before clipping, and then the group's part once per
        backward (the average is once per optimizer step: :meth:`ReplicaGroups.reduce`)."""
        notes = None
        if self._module is not None and not (self._crosses_each_step and self._settled):
            notes = self._check_synced(self._module)
            self._settled = True
        self._reduce_across_groups(optimizer, notes)

    def _check_synced(self, module: Module) -> Unreduced | None:
        engine = self._engine_of(module)
        # (fault tolerance reduces the unused-parameter notes inside its commit vote: one collective fewer a step)
        return engine.settle_gradients(module, defer_unused=self._crosses_each_step) if engine is not None else None

    def _engine_of(self, module: Module) -> Training | None:
        return self._module_engine if module is self._module else engine_of(module)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        if self._crosses_each_step:
            self._settle(optimizer)  # (the gradients averaged across groups are clipped, as DDP's)
        super().clip_gradients_value(module, optimizer, clip_val)

    @override
    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """The norm over ``optimizer``'s parameters, every shard counted once and replicas not double-counted, as
        Lightning's and DDP's."""
        engine = self._engine_of(module)
        if float(norm_type) != 2.0:
            raise UnsupportedOptionError(
                f"norm_type={norm_type!r}: lightning_smp clips by the 2-norm only. Fix: norm_type=2.0."
            )
        self.precision.unscale_gradients(optimizer)
        if self._crosses_each_step:
            self._settle(optimizer)  # the norm of the gradients averaged across groups, as DDP's
        total = None
        if engine is not None:  # (the module is checked first: the optimizer's parameters are read only then)
            total = engine.clip_grad_norm(module, float(max_norm), list(self.precision.main_params(optimizer)))
        if total is None:
            raise TypeError(
                "Gradient clipping by norm needs the module that fabric.setup_module() returned (one sharded root)."
                f" Got: {type(module).__name__}."
            )
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of the gradients is {total.item()}: not finite.")
        return total

    # ------------------------------------------------------------------ checkpoints

    def _sharded(self, module: Module) -> Any:
        from lightning.fabric.wrappers import _unwrap_objects

        owner, module = "lightning_smp.fabric.HybridShardFSDPStrategy", _unwrap_objects(module)
        self.core.check_root(module, owner)  # before anything else: the same error on every rank, launched or not
        return self.core.sharded_model(module, self.root_device, owner)

    def full_state_dict(self, module: Module) -> dict[str, Any]:
        """The unsharded weights of ``module`` (what ``fabric.setup_module`` returned) on global rank 0, an empty
        dict elsewhere. Call it on every rank; only replica group 0 gathers."""
        return checkpoint_lib.full_model_state(self._sharded(module))

    def full_optimizer_state(self, module: Module, optimizer: Optimizer) -> dict[str, Any]:
        """The unsharded state of ``optimizer`` on global rank 0 (torch's standard layout), empty elsewhere."""
        from lightning.fabric.wrappers import _unwrap_objects

        return checkpoint_lib.full_optimizer_state(self._sharded(module), _unwrap_objects(optimizer))

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """``fabric.save(path, state)``, Fabric's contract: the module and optimizers as (sharded or full) state
        dicts, every other object with ``state_dict()``/``load_state_dict()`` (a stateful data loader, a scheduler)
        through its ``state_dict()``, plain values as they are; anything else is refused before anything is written.

        ``"sharded"``: the same folder as the Trainer strategy writes. ``"full"``: one file in the layout of Fabric's
        ``FSDPStrategy``, the model and optimizers under the user's keys (``{"model": ..., "optimizer": ...}``).
        """
        check_storage_options(storage_options)  # first, as Lightning's FSDPStrategy
        _, module, optimizer_keys, _ = split_state(state)
        sharded = self._sharded(module)  # refuses a module that was not set up here, on every rank alike
        kind, background, run = self.options.state_dict_type, self._background, self.core.checkpoint_run
        self.sync_replicas()  # replica_sync: a checkpoint holds synced weights
        checkpoint = fabric_checkpoint(state, sharded, kind, self._local_state_check, filter)
        if not self._writes_checkpoints():
            # fault_tolerance: every group holds the same state, one live group writes it; under replica_sync each
            # other group keeps its own inner optimizer state beside it
            # (a full checkpoint in Fabric's layout holds the optimizers under the state's own keys)
            states = ([checkpoint[key] for key in optimizer_keys if key in checkpoint] if kind == FULL
                      else checkpoint.get(OPTIMIZERS_KEY, []))
            own = self._own_inner_checkpoint(states, path)
            if own is None:
                return
            checkpoint, path, run = own
        else:
            checkpoint.update(self._replica_checkpoint_state())
            checkpoint = self._replica_sync_checkpoint(checkpoint, sharded, [state[key] for key in optimizer_keys],
                                                       kind, self._local_state_check)
        checkpoint_lib.save(checkpoint, path, kind=kind, collectives=Collectives.current(self.root_device),
                            run=run, layout=self.core.layout, storage_options=storage_options, background=background,
                            writes_data=background is None or self.outer_sync is not None or sharded.writes_data())

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """``fabric.load(path, state)`` / ``fabric.load_raw(path, module)``: either format, written by either front
        end (or a full file of Lightning's own Fabric ``FSDPStrategy``), at any degree and world size; loads only
        tensors and plain values. Objects with ``load_state_dict()`` in ``state`` are restored in place, other
        entries replaced; what ``state`` did not ask for is returned."""
        self.wait_for_checkpoint()  # it may be the checkpoint in flight
        if state is None:
            raise HybridShardConfigError(
                "fabric.load(path) without a state: give the objects to restore, e.g. fabric.load(path, {'model':"
                " model, 'optimizer': optimizer}) (lightning_smp.checkpoint.read_full(path) reads a checkpoint into"
                " one process)."
            )
        if isinstance(state, Optimizer):
            raise UnsupportedOptionError(
                "fabric.load_raw(path, optimizer): an optimizer state is loaded together with its model. Fix:"
                " fabric.load(path, {'model': model, 'optimizer': optimizer})."
            )
        if isinstance(state, Module):
            load_raw(Path(path), state, strict, self._sharded)
            return {}
        _, module, optimizer_keys, _ = split_state(state)
        outer = self._outer_optimizer()
        extra = self._replica_sync_load_entries([state[key] for key in optimizer_keys], outer)
        with ungated(state[key] for key in optimizer_keys):  # (DCP creates a missing state with a step: no vote)
            remainder = restore_fabric_state(self._sharded(module), path, state, strict=strict,
                                             run=self.core.checkpoint_run, extra=extra)
        self._resume_replica_groups(remainder)  # (the replica groups' step, never returned to the loop)
        record = remainder.get(REPLICA_SYNC_KEY)
        self._resume_replica_sync(remainder, outer)  # (the outer loop's state, never returned to the loop)
        self._load_own_inner_state(path, self._sharded(module), [state[key] for key in optimizer_keys], record)
        return remainder


__all__ = ["HybridShardFSDPStrategy", "HybridShardFabricPrecision"]
