"""What the Trainer and the Fabric strategies expose of their :class:`~lightning_smp.core.HybridShardCore`, once.

The two strategies differ in their Lightning base class (``lightning.pytorch.strategies.FSDPStrategy`` and
``lightning.fabric.strategies.FSDPStrategy``) and in the hooks they override; the public properties, the start-up
steps they share and their messages are this mixin's, and so is how their constructors take the options
(:func:`with_options`, :meth:`HybridShardFrontEnd._take_options`).
"""

from __future__ import annotations

import inspect
import logging
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.checkpoint import CheckpointRun
from lightning_smp.checkpoint.background import BackgroundSaver
from lightning_smp.checkpoint.format import REPLICA_GROUPS_KEY
from lightning_smp.checkpoint.local import LocalStateCheck
from lightning_smp.collectives import Collectives, checkpoint_group, release_process_groups_at_exit
from lightning_smp.config import SMPConfig
from lightning_smp.config.options import (
    DOC_BEGIN,
    DOC_END,
    StrategyOptions,
    arguments_doc,
    option_names,
    signature_parameters,
)
from lightning_smp.core import HybridShardCore
from lightning_smp.degree import Layout
from lightning_smp.engines import Engine, ShardingPlan
from lightning_smp.engines.unused import read_outside_forward_message
from lightning_smp.errors import HybridShardConfigError, ShardedParameterError
from lightning_smp.fault_tolerance.session import ReplicaGroups
from lightning_smp.fault_tolerance.state import TrackedState
from lightning_smp.mesh import group_ranks
from lightning_smp.names import MESH_AXES, GradientAccumulation, StartMethod
from lightning_smp.optimizers import step_when_committed
from lightning_smp.peers import RankAddress, gather_addresses, lost_peer_note

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import ShardingStrategy

    from lightning_smp.engines.unused import Unreduced
    from lightning_smp.planner import Plan

#: The line of a subclass's docstring that :func:`with_options` replaces by the options' documentation (the library's
#: own strategies hold it in their source, between ``DOC_BEGIN`` and ``DOC_END``).
OPTIONS_LINE = "(every option of lightning_smp.config.options, documented here when the class is created)"

_Strategy = TypeVar("_Strategy", bound="type[HybridShardFrontEnd]")


def with_options(cls: _Strategy) -> _Strategy:
    """Give a strategy class's constructor every option of its ``options_type`` as a typed parameter, and its
    docstring their documentation, from their one declaration (:mod:`lightning_smp.config.options`): what IDE help,
    ``help()``, notebooks and LightningCLI (``lightning-smp fit --help``, ``--print_config``) read.

    The library's strategies list Lightning's own arguments, then the options, and document them, as written from
    their declarations by ``python -m lightning_smp.generate`` (what static type checkers and IDEs read; their
    docstring holds the options' entries between ``DOC_BEGIN`` and ``DOC_END``; ``tests/test_how_to_add.py`` holds
    the source equal to what the command writes: nothing here checks it). Options that are positional parameters of
    the Lightning base class (``sharding_strategy``, ``state_dict_type``, ``device_mesh``) keep their place and kind
    there: a drop-in replacement; the others are keyword-only. A subclass that only adds options (its own
    ``options_type``, no constructor) gets them in its runtime signature, taken through ``**kwargs``
    (:meth:`HybridShardFrontEnd._take_options`)."""
    doc = vars(cls).get("__doc__") or ""
    written = "__init__" in vars(cls)
    generated = written and DOC_BEGIN in doc  # (one of the library's own strategies, written by the command)
    if not written:
        # a subclass that only adds options (options_type): its own constructor, so that the parent's keeps its
        # signature
        parent_init = cls.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            parent_init(self, *args, **kwargs)

        __init__.__signature__ = inspect.signature(parent_init)  # type: ignore[attr-defined]
        # resolved where the parent's names are (this function's module has not imported them)
        __init__.__annotations__ = typing.get_type_hints(parent_init)
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        cls.__init__ = __init__  # type: ignore[method-assign]
    init: Any = vars(cls)["__init__"]  # the class's own constructor (a function: its signature is set below)
    every = set(option_names(cls.options_type))
    parameters = [p for p in inspect.signature(init).parameters.values() if p.name not in every]
    own = [p for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    rest = [p for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD]
    lightning = next(base for base in cls.__mro__[1:]
                     if base.__module__.startswith("lightning.") and "__init__" in vars(base))
    theirs = list(inspect.signature(vars(lightning)["__init__"]).parameters.values())[len(own):]
    declared = {p.name: p for p in signature_parameters(cls.options_type)}
    positional = []
    for parameter in theirs:  # Lightning's positional parameters that follow the constructor's own, in order
        if parameter.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or parameter.name not in declared:
            break
        positional.append(declared.pop(parameter.name).replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD))
    init.__signature__ = inspect.Signature([*own, *positional, *declared.values(), *rest], return_annotation=None)
    init.__annotations__ = {**init.__annotations__, **{p.name: p.annotation for p in [*positional, *declared.values()]}}
    if generated:  # the options' entries, at run time the declarations' (without the two lines around them)
        lines = doc.splitlines()
        first = next(i for i, line in enumerate(lines) if line.strip() == DOC_BEGIN)
        last = next(i for i, line in enumerate(lines) if line.strip() == DOC_END)
        indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())]
        cls.__doc__ = "\n".join([*lines[:first], arguments_doc(indent, cls.options_type), *lines[last + 1:]])
        return cls
    line = next((line for line in doc.splitlines() if line.strip() == OPTIONS_LINE), None)
    if line is None:  # (a subclass's own docstring, or none): the options as its arguments section
        cls.__doc__ = f"{doc.rstrip()}\n\n    Arguments:\n{arguments_doc(' ' * 8, cls.options_type)}\n"
    else:
        indent = line[: len(line) - len(line.lstrip())]
        cls.__doc__ = doc.replace(line, arguments_doc(indent, cls.options_type))
    return cls


class HybridShardFrontEnd:
    """Mixin of the two strategies (listed before their Lightning base class)."""

    core: HybridShardCore
    _plan: Callable[[], ShardingPlan]  # each strategy's: the layout on its root device, with the user's arguments
    _activation_checkpointing_kwargs: dict[str, Any]  # Lightning's FSDP strategies, Trainer's and Fabric's alike
    #: who creates the strategy, and where its mesh is built, for messages
    _created_by = "the Trainer"
    _mesh_built_in = "inside Trainer.fit/validate/test/predict"
    _warned_override = False
    #: the planner's options already warned about (each once: a user who set two hears of both)
    _warned_unused: frozenset[str] = frozenset()
    #: where every rank runs, learnt at setup on more than one node (names a lost node when a collective fails)
    _peers: list[RankAddress] | None = None
    #: writes sharded checkpoints in the background (``async_save``); made with its process group at setup
    _background: BackgroundSaver | None = None
    #: this rank's part in fault-tolerant replica groups (``fault_tolerance``), joined at setup
    _replicas: ReplicaGroups | None = None
    #: the forward pre-hook of the tracked module (the step-0 quorum before the first forward)
    _before_forward: Any = None
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

    def _warn_override_once(self, layout: Layout | None) -> None:
        if layout is not None and layout.overridden and not self._warned_override:
            self._warned_override = True
            rank_zero_warn(layout.override_message())
        config = self.core.config  # from any source
        for key, value in (("memory_budget", config.memory_budget), ("links", config.links)):
            if value is not None and not self.core.auto and key not in self._warned_unused:
                self._warned_unused = self._warned_unused | {key}
                rank_zero_warn(f"{key}={value} is used only with hybrid_shard_degree='auto';"
                               f" hybrid_shard_degree={self.core.configured_degree} is in effect. Fix: drop {key},"
                               " or set hybrid_shard_degree='auto'.")

    def _set_up_mesh(self, num_nodes: int, devices: int, device_type: str) -> Layout | None:
        """The mesh, once the process group exists, and where every rank runs (for :meth:`_lost_peer_note`).
        ``None`` while ``hybrid_shard_degree="auto"`` waits for the model (:meth:`_choose_degree`)."""
        release_process_groups_at_exit()
        if self.core.async_save and self._background is None:
            # its own gloo group: the writing threads' collectives must never queue behind the training's
            self._background = BackgroundSaver(checkpoint_group(device_type))
        if self._peers is None and num_nodes > 1:
            self._peers = gather_addresses(self.node_rank)
        layout = self.core.build_mesh(num_nodes, devices, device_type)
        if layout is None:
            return None
        rank_zero_info(f"{type(self).__name__}: {layout.describe()}")
        self._join_replica_groups(device_type)
        return layout

    # ------------------------------------------------------------------ fault-tolerant replica groups

    @property
    def replica_groups(self) -> ReplicaGroups | None:
        """This rank's part in fault-tolerant replica groups (``fault_tolerance``), once setup has joined them;
        ``None`` without the option."""
        return self._replicas

    @property
    def replica_metrics(self) -> dict[str, float]:
        """What the replica groups did at the last optimizer step (``fault_tolerance``), for a logger: the groups
        whose gradients were averaged, whether it committed, torchft's step, and a heal's source group and transfer
        time (:meth:`~lightning_smp.fault_tolerance.ReplicaGroups.metrics`); empty without the option. The Trainer
        logs them itself; a Fabric loop calls ``fabric.log_dict(fabric.strategy.replica_metrics)``."""
        return self._replicas.metrics() if self._replicas is not None else {}

    @property
    def step_committed(self) -> bool:
        """Whether the last optimizer step was committed by every replica group (always ``True`` without
        ``fault_tolerance``). A hand-written loop steps its schedulers and counters only when it is."""
        return self._replicas is None or self._replicas.last_committed is not False

    def _join_replica_groups(self, device_type: str) -> None:
        """Join the replica groups once this group's process group exists (``fault_tolerance``)."""
        settings = self.core.fault_tolerance
        if settings is not None and self._replicas is None:
            device = self.root_device  # type: ignore[attr-defined]  # Lightning's ParallelStrategy
            # (the group's store is torchrun's or the launcher's, MASTER_PORT; the others reach it at the group's
            # address, not MASTER_ADDR, which torchrun sets to 127.0.0.1)
            self._replicas = ReplicaGroups(settings, device, rank=dist.get_rank(), world_size=dist.get_world_size(),
                                           store_port=int(os.environ["MASTER_PORT"]),
                                           sync_buffers=self.core.options.broadcast_buffers)

    def _begin_replica_step(self) -> None:
        """Before a backward: the first of an optimizer step asks for the quorum of live groups."""
        if self._replicas is not None:
            self._replicas.begin_step()

    def _reduce_across_groups(self, optimizer: Any, notes: Unreduced | None = None) -> None:
        """After the group's own reduction (the engine's ``settle_gradients``), before clipping and the step: the
        gradients of ``optimizer``'s parameters averaged across the live groups (``notes``: the engine's
        unused-parameter notes, reduced along)."""
        if self._replicas is not None:
            self._replicas.reduce([p for group in optimizer.param_groups for p in group["params"]], notes)

    def _commit_step(self, optimizer: Any) -> bool:
        """The vote of :func:`~lightning_smp.optimizers.step_when_committed`: step only if every group commits."""
        return self._replicas is None or self._replicas.commit()

    def _gate_steps(self, optimizer: Any) -> Any:
        """``optimizer`` stepping only when every replica group commits (``fault_tolerance``), else as it is."""
        if self.core.fault_tolerance is None:
            return optimizer
        return step_when_committed(optimizer, self._commit_step)

    def _track_for_healing(self, module: Module, optimizers: Callable[[], Sequence[Optimizer]],
                           extra: Callable[[], dict[str, Any]] = dict,
                           load_extra: Callable[[dict[str, Any]], None] = lambda state: None) -> None:
        """What this rank sends a healing group, and receives when this group heals; at step 0, the quorum and the
        groups' comparison before the first forward (:meth:`ReplicaGroups.before_forward`)."""
        if self._replicas is not None:
            replicas = self._replicas
            replicas.track(TrackedState.of(module, optimizers, extra, load_extra))
            if self._before_forward is not None:
                self._before_forward.remove()  # (a model set up again: one hook)
            # (first: FSDP2 gathers the root's parameters in its own pre-hook, and a copy from another group made
            # after it would not be what the first forward computes with)
            self._before_forward = module.register_forward_pre_hook(lambda *_: replicas.before_forward(), prepend=True)

    def _replica_checkpoint_state(self) -> dict[str, Any]:
        """What a persistent checkpoint records of the replica groups (torchft's step), to resume from."""
        return {REPLICA_GROUPS_KEY: self._replicas.state_dict()} if self._replicas is not None else {}

    def _resume_replica_groups(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint's record of the replica groups' step, back into torchft (a checkpoint of a run without
        ``fault_tolerance`` has none: the step stays)."""
        state = checkpoint.pop(REPLICA_GROUPS_KEY, None)
        if self._replicas is not None and state is not None:
            self._replicas.load_state_dict(state)

    def _writes_checkpoints(self) -> bool:
        """Whether this group writes the job's persistent checkpoints (all groups hold the same state: one writes)."""
        return self._replicas is None or self._replicas.writes_checkpoints()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Lightning's split of the data over the ranks, and with ``fault_tolerance`` over every rank of every group:
        group ``g``'s rank ``r`` reads part ``g x hybrid_shard_degree + r`` of ``groups x hybrid_shard_degree``."""
        kwargs = dict(super().distributed_sampler_kwargs or {})  # type: ignore[misc]  # the Lightning base class's
        settings = self.core.fault_tolerance
        if settings is None or not kwargs:
            return kwargs
        world = int(kwargs["num_replicas"])
        return {**kwargs, "num_replicas": settings.groups * world, "rank": settings.group * world + int(kwargs["rank"])}

    @property
    def async_save(self) -> bool:
        """Whether sharded checkpoints are written in the background (see :mod:`lightning_smp.checkpoint.background`)."""
        return self.core.async_save

    @property
    def _local_state_check(self) -> LocalStateCheck | None:
        """The background saver's record of whether the engine's local description of the state holds (``None``
        without ``async_save``): what a save's state comes from (:func:`~lightning_smp.checkpoint.local.model_state_to_save`)."""
        return self._background.local_state if self._background is not None else None

    @property
    def checkpoint_staging_bytes(self) -> int:
        """Host memory this rank's staged copy of the largest background save took so far (0 without
        ``async_save``, and on ranks whose shards another replica writes)."""
        return self._background.peak_staged_bytes if self._background is not None else 0

    @property
    def checkpoint_in_flight(self) -> bool:
        """Whether a background save was submitted whose outcome has not been taken yet (see :meth:`wait_for_checkpoint`)."""
        return self._background is not None and self._background.in_flight

    def wait_for_checkpoint(self) -> None:
        """Block until the checkpoint being written in the background is committed (and what waited for it has run);
        raise its failure, the same on every rank. Nothing without ``async_save`` or a save in flight. Call it on
        every rank; the end of ``fit``, the next save and every load call it for you."""
        if self._background is not None:
            self._background.wait()

    def _poll_checkpoint(self, collectives: Collectives) -> None:
        """At a training step: take the outcome of a background save whose write ended on every rank."""
        if self._background is not None:
            self._background.poll(collectives)

    def end_checkpoint_after_error(self) -> None:
        """After training failed: wait for the write in flight (it commits if every rank wrote), skip what waited for
        it, and log (not raise) its own failure, which must not hide the error that ended training."""
        if self._background is not None and self._background.in_flight:
            try:
                self._background.wait(side_effects=False)
            except Exception as err:  # noqa: BLE001 - logged; the training error is the one raised
                log.error("%s", err)

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

    def _choose_degree(self, module: Module, *, num_nodes: int, devices: int, device: torch.device, precision: str,
                       micro_batches: int, optimizers: Sequence[Any] = (), training: bool = True) -> None:
        """``hybrid_shard_degree="auto"``: plan on every rank from the real model (before it is sharded; its
        ``example_input_array`` traced, with the strategy's activation checkpointing), log the table, then build the
        mesh of the chosen degree."""
        if not self.core.auto or self.core.chosen is not None:
            return
        chosen = self.core.choose_degree(
            module, num_nodes=num_nodes, devices=devices, device=device, precision=precision,
            example_input=getattr(module, "example_input_array", None),
            checkpoint=self._checkpoint_activations if self._activation_checkpointing_kwargs else None,
            micro_batches=micro_batches, optimizer=self._optimizer_for_plan(module, optimizers), training=training)
        rank_zero_info(f"{type(self).__name__}: hybrid_shard_degree='auto' chose {chosen.degree}.\n{chosen.text()}")
        if chosen.activation_checkpointing:
            # nothing fitted without it: the planner checkpointed the FSDP units (auto_wrap_policy's classes), and
            # so does the sharding that follows
            classes = tuple(self.core.engine_options["auto_wrap_policy"])
            self._activation_checkpointing_kwargs = {"check_fn": lambda submodule: isinstance(submodule, classes)}
        layout = self._set_up_mesh(num_nodes, devices, device.type)
        if layout is not None:
            self._warn_override_once(layout)

    def _sharded_context(self) -> AbstractContextManager:
        """The engine's wrap context for modules built inside it; none while the planner has not chosen yet (nothing
        may be sharded before ``hybrid_shard_degree="auto"`` is resolved from the finished model)."""
        if self.core.layout is None and self.core.auto_pending:
            return nullcontext()
        return self.engine.wrap_context(self._plan())

    def _optimizer_for_plan(self, module: Module, optimizers: Sequence[Any] = ()) -> Any:
        """The optimizer the planner assumes: the one given, else the LightningModule's ``configure_optimizers``
        (best effort: it may need what does not exist yet), else AdamW, saying so."""
        from lightning_smp.planner import optimizer_name

        try:
            return optimizer_name(optimizers[0] if optimizers else module)
        except Exception as err:  # noqa: BLE001  # a user hook run early, or an optimizer without a known layout
            rank_zero_warn(f"hybrid_shard_degree='auto': the planner could not read the optimizer ({err}); it"
                           " assumes AdamW (two state tensors per parameter).")
            return "adamw"

    @staticmethod
    def _warn_already_sharded(module: Module, options: dict[str, Any]) -> None:
        """Lightning's FSDP warnings for a model the user sharded themselves (a policy given is then dropped)."""
        from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers

        if _has_meta_device_parameters_or_buffers(module):
            rank_zero_warn("The model is already wrapped in `FSDP` but there are still parameters on the meta device.")
        if "auto_wrap_policy" in options:
            rank_zero_warn("A FSDP `auto_wrap_policy` is set, but the model is already wrapped. The policy will be ignored.")
            del options["auto_wrap_policy"]


__all__ = ["OPTIONS_LINE", "HybridShardFrontEnd", "with_options"]

