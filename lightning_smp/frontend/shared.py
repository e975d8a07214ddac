"""What the Trainer and the Fabric strategies share: :class:`HybridShardFrontEnd`, the mixin both list before their
Lightning base class (``lightning.pytorch.strategies.FSDPStrategy``, ``lightning.fabric.strategies.FSDPStrategy``).
Its public properties, the start-up steps and messages, sharding, the registration of the strategy names and the
discarded accumulation window are here; the degree's choice (:mod:`.degree_choice`), the replica groups
(:mod:`.replica_groups`) and the background saves (:mod:`.background_saves`) are mixins of their own; each
constructor's signature is :func:`~lightning_smp.frontend.signatures.with_options`'s."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module

from lightning_smp.checkpoint import CheckpointRun
from lightning_smp.collectives import release_process_groups_at_exit
from lightning_smp.config import SMPConfig
from lightning_smp.config.options import StrategyOptions, option_names
from lightning_smp.config.replica_sync import ReplicaSync
from lightning_smp.core import HybridShardCore
from lightning_smp.degree import Layout
from lightning_smp.engines import Engine, ShardingPlan
from lightning_smp.engines.unused import read_outside_forward_message
from lightning_smp.errors import HybridShardConfigError, ShardedParameterError
from lightning_smp.frontend.background_saves import BackgroundSaves
from lightning_smp.frontend.degree_choice import DegreeChoice
from lightning_smp.frontend.replica_groups import ReplicaGroupSteps
from lightning_smp.frontend.replica_sync import ReplicaSyncSteps
from lightning_smp.mesh import group_ranks
from lightning_smp.names import FULL_SHARD, MESH_AXES, STRATEGY_NAMES, GradientAccumulation, StartMethod
from lightning_smp.peers import RankAddress, gather_addresses, lost_peer_note

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import ShardingStrategy

    from lightning_smp.planner import Plan


def start_line(name: str, layout: Layout, engine: str, replica_sync: ReplicaSync | None) -> str:
    """The line a strategy logs once its mesh exists: the layout, the engine that runs it, and ``replica_sync``'s
    settings (under which each replica group is sharded on its own and the groups only meet at a sync)."""
    if replica_sync is None:
        return f"{name}: {layout.describe()}, engine {engine}"
    inside = f"{FULL_SHARD} inside each" if layout.shard > 1 else "nothing sharded"
    return (f"{name}: hybrid_shard_degree={layout.degree}: {layout.replicate} replica group(s) x {layout.shard}"
            f" shard(s) over {layout.world_size} rank(s), {inside}, engine {engine}; {replica_sync.describe()}")


class HybridShardFrontEnd(DegreeChoice, ReplicaGroupSteps, ReplicaSyncSteps, BackgroundSaves):
    """Mixin of the two strategies (listed before their Lightning base class): what they share, the degree's choice,
    the replica groups' and the background saves' glue (each its own module of this package) included."""

    core: HybridShardCore
    _plan: Callable[[], ShardingPlan]  # each strategy's: the layout on its root device, with the user's arguments
    _activation_checkpointing_kwargs: dict[str, Any]  # Lightning's FSDP strategies, Trainer's and Fabric's alike
    #: who creates the strategy, and where its mesh is built, for messages
    _created_by = "the Trainer"
    _mesh_built_in = "inside Trainer.fit/validate/test/predict"
    #: where every rank runs, learnt at setup on more than one node (names a lost node when a collective fails)
    _peers: list[RankAddress] | None = None
    #: the names this class registered (each strategy's own list; the Trainer's ``get_registered_strategies`` reads it)
    _registered_strategies: list[str]
    _trained_module: Callable[[], Module | None]  # each strategy's: the module being trained, once set up
    node_rank: int  # Lightning's ParallelStrategy, Trainer's and Fabric's alike
    _start_method: StartMethod
    #: the record of the strategy's options; a subclass of the strategy may add options of its own with a subclass of
    #: :class:`~lightning_smp.config.options.StrategyOptions` (``docs/architecture.md``, "How to add")
    options_type: ClassVar[type[StrategyOptions]] = StrategyOptions

    def _take_options(self, arguments: Mapping[str, Any], kwargs: dict[str, Any], *, auto_wrap_policy: Any,
                      mixed_precision: Any, cpu_offload: Any) -> dict[str, Any]:
        """Both constructors' one call: the options among ``arguments`` (the constructor's ``locals()``: its
        generated option parameters) and ``kwargs`` (a subclass's own options: :func:`with_options`), checked (static
        checks, before anything is built, the same on every rank), the core made from them; returns what is left of
        ``kwargs``, the engine's own arguments."""
        names = set(option_names(self.options_type))
        arguments = {**{key: value for key, value in arguments.items() if key in names},
                     **{key: kwargs.pop(key) for key in list(kwargs) if key in names}}
        options = self.options_type.from_arguments(arguments, kwargs)
        engine_options = {**kwargs, **({"auto_wrap_policy": auto_wrap_policy} if auto_wrap_policy else {})}
        #: what the Trainer and Fabric strategies share (configuration, layout, engine, mesh, sharding)
        self.core = HybridShardCore.from_options(options, engine_options=engine_options,
                                                 mixed_precision=mixed_precision, cpu_offload=cpu_offload)
        self._start_method = options.start_method or ("fork" if _IS_INTERACTIVE else "popen")
        return kwargs

    @property
    def options(self) -> StrategyOptions:
        """The options as given, checked (each documented in the class docstring)."""
        return self.core.options

    @property
    def config(self) -> SMPConfig:
        """The SMP keys in effect (``hybrid_shard_degree``, ``fsdp_version``, ``async_save``, ...): the arguments, else
        the other configuration sources, else the defaults (:mod:`lightning_smp.config`); resolved once, when the
        strategy is configured."""
        return self.core.config

    @property
    def start_method(self) -> StartMethod:
        """How processes are started: ``"popen"``, ``"fork"``, ``"spawn"`` or ``"forkserver"``."""
        return self._start_method

    @property
    def hybrid_shard_degree(self) -> int | str:
        """The degree in effect: the constructor argument, else a LightningCLI ``smp:`` section, else
        :func:`lightning_smp.init`, else ``LIGHTNING_SMP_CONFIG``/``SM_HP_MP_PARAMETERS``, else 0.

        Resolved once, when the strategy is configured; every source is checked even when a higher one wins (see
        :mod:`lightning_smp.config`). ``"auto"`` until the planner has chosen (when the model is set up), then the
        chosen degree; :attr:`degree_plan` holds the planner's table.
        """
        return self.core.hybrid_shard_degree

    @property
    def degree_plan(self) -> Plan | None:
        """The planner's :class:`~lightning_smp.planner.Plan` when ``hybrid_shard_degree="auto"`` chose the degree
        (its table, the reason), else ``None``."""
        return self.core.chosen

    @property
    def engine(self) -> Engine:
        """The engine that runs the model: the engine of ``fsdp_version``, or DDP's where the layout shards nothing
        (settled with the layout: when the strategy is configured, or when ``"auto"`` has chosen)."""
        return self.core.engine

    @property
    def checkpoint_run(self) -> CheckpointRun:
        """Who writes this run's checkpoints (see :class:`lightning_smp.checkpoint.CheckpointRun`)."""
        return self.core.checkpoint_run

    @property
    def fsdp_version(self) -> int:
        """The FSDP implementation configured: 1 (``FullyShardedDataParallel``) or 2 (``fully_shard``); a layout that
        shards nothing runs on the DDP engine whichever it is (:attr:`engine`)."""
        return self.core.config.fsdp_version

    @property
    def gradient_accumulation(self) -> GradientAccumulation:
        """What micro-batches before the last of an optimizer step communicate (the engine's default unless given)."""
        return self.core.gradient_accumulation

    @property
    def layout(self) -> Layout:
        """Replicas, shard degree and the FSDP sharding strategy in effect (known once the strategy is configured)."""
        if self.core.layout is None:
            when = (f"it is chosen by the planner when the model is set up ({self._mesh_built_in})" if self.core.auto
                    else f"it is resolved when {self._created_by} is created")
            raise HybridShardConfigError(f"{type(self).__name__}.layout is not known yet: {when}.")
        return self.core.layout

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 2-D ``DeviceMesh`` with axes ``("replicate", "shard")``, built in ``setup_environment``."""
        if self.core.device_mesh is None:
            if self.core.engine_options.get("process_group") is not None:
                raise HybridShardConfigError(
                    f"{type(self).__name__}.device_mesh does not exist: a process_group was passed and is used as is."
                )
            raise HybridShardConfigError(
                f"{type(self).__name__}.device_mesh is not available before setup: it is built in"
                f" setup_environment(), once the process group exists ({self._mesh_built_in})."
            )
        return self.core.device_mesh

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The FSDP sharding strategy in effect: the layout's once it is resolved (when the Trainer or Fabric is
        created; with ``"auto"``, when the planner has chosen), the one asked for before."""
        from torch.distributed.fsdp import ShardingStrategy

        layout = self.core.layout
        return ShardingStrategy[layout.sharding_strategy if layout is not None else
                                self.core.options.sharding_strategy_name]

    @sharding_strategy.setter
    def sharding_strategy(self, value: Any) -> None:
        # Lightning's FSDPStrategy.__init__ writes FULL_SHARD here (the hybrid strategy was passed to it as FULL_SHARD:
        # its check for HYBRID_* needs a mesh that cannot exist yet); what is in effect follows the layout
        pass

    def _refuse_shard_values(self, tensor: Any) -> None:
        """Before a backward of ``tensor`` or a reduction of it across ranks (``sync_dist``, ``fabric.all_reduce``):
        a value computed from parameters outside their unit's forward is itself a shard (FSDP2: a ``DTensor``),
        on every rank alike; torch would fail deep inside the backward or the collective without naming the cause."""
        if isinstance(tensor, torch.Tensor) and self.engine.is_shard_tensor(tensor):
            raise ShardedParameterError(read_outside_forward_message())

    def _set_up_mesh(self, num_nodes: int, devices: int, device_type: str) -> Layout | None:
        """The mesh, once the process group exists, and where every rank runs (for :meth:`_lost_peer_note`).
        ``None`` while ``hybrid_shard_degree="auto"`` waits for the model (:meth:`_choose_degree`)."""
        release_process_groups_at_exit()
        self._start_background_saves(device_type)
        if self._peers is None and num_nodes > 1:
            self._peers = gather_addresses(self.node_rank)
        layout = self.core.build_mesh(num_nodes, devices, device_type)
        if layout is None:
            return None
        rank_zero_info(start_line(type(self).__name__, layout, self.core.engine.name, self.core.replica_sync))
        self._join_replica_groups(device_type)
        return layout

    def _lost_peer_note(self, error: BaseException) -> str | None:
        """Which node this rank's collectives were waiting for when ``error`` (a timeout, a closed connection) ended
        them; ``None`` for other errors and on one node (see :mod:`lightning_smp.peers`)."""
        if not self._peers:
            return None
        world = list(range(len(self._peers)))
        mesh = self.core.device_mesh
        groups = [world] + ([group_ranks(mesh, axis) for axis in MESH_AXES] if mesh is not None else [])
        return lost_peer_note(error, self._peers, groups, dist.get_rank() if dist.is_initialized() else 0)

    def _shard(self, module: Module, options: dict[str, Any]) -> Module:
        """Both front ends' sharding: :meth:`HybridShardCore.shard` on this strategy's plan, then torchmetrics' states
        moved to the root device, as Lightning's FSDP strategies do (they are not shards); ``options``: the user's
        engine arguments, for the warnings about a model they sharded themselves."""
        plan = self._plan()
        module = self.core.shard(module, plan, checkpoint_activations=self._checkpoint_activations,
                                 on_already_sharded=lambda sharded: self._warn_already_sharded(sharded, options))
        _move_torchmetrics_to_device(module, plan.device)
        return module

    def _checkpoint_activations(self, module: Module) -> None:
        """The strategy's activation checkpointing (its ``activation_checkpointing*`` arguments) applied to
        ``module``: when sharding, and to the copy the planner traces."""
        _setup_activation_checkpointing(module, self._activation_checkpointing_kwargs)

    def _sharded_context(self) -> AbstractContextManager:
        """The engine's wrap context for modules built inside it; none while the planner has not chosen yet (nothing
        may be sharded before ``hybrid_shard_degree="auto"`` is resolved from the finished model)."""
        if self.core.layout is None and self.core.auto_pending:
            return nullcontext()
        return self.engine.wrap_context(self._plan())

    @staticmethod
    def _warn_already_sharded(module: Module, options: dict[str, Any]) -> None:
        """Lightning's FSDP warnings for a model the user sharded themselves (a policy given is then dropped)."""
        from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers

        if _has_meta_device_parameters_or_buffers(module):
            rank_zero_warn("The model is already wrapped in `FSDP` but there are still parameters on the meta device.")
        if "auto_wrap_policy" in options:
            rank_zero_warn("A FSDP `auto_wrap_policy` is set, but the model is already wrapped. The policy will be ignored.")
            del options["auto_wrap_policy"]

    def _discard_window(self) -> None:
        """``zero_grad`` in the middle of an accumulation window (manual optimization, a hook, a Fabric loop) drops
        all of it, as under DDP."""
        module = self._trained_module()
        if module is not None:
            self.engine.discard_unreduced_gradients(module)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the library's names (:data:`~lightning_smp.names.STRATEGY_NAMES`: ``smp_hybrid``,
        ``smp_hybrid_zero2``, ...) in a front end's registry (the Trainer's, Fabric's) for this class; calling it
        again is harmless."""
        if not dist.is_available():
            return
        for name, description, init_params in STRATEGY_NAMES:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **init_params)
            if name not in cls._registered_strategies:
                cls._registered_strategies.append(name)


__all__ = ["HybridShardFrontEnd"]
