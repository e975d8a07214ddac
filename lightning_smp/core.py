"""What every front end of hybrid sharding shares: the Trainer strategy and the Fabric strategy each hold one
:class:`HybridShardCore` and are thin glue around it.

The core takes explicit inputs (the user's arguments, the number of nodes and devices, the root device, the
module) and knows neither Lightning's Trainer nor Fabric. In order:

1. :meth:`HybridShardCore.from_options`: the options checked once by
   :meth:`~lightning_smp.config.options.StrategyOptions.from_arguments` (before anything is built, the same on every
   rank), and against the engine when ``fsdp_version`` names it already;
2. :meth:`~HybridShardCore.configure`: when the front end is created (before any process starts), the configuration
   is resolved once from every source, the engine chosen and the arguments checked against it, and the layout
   resolved for the world size, so that a bad degree fails there;
3. :meth:`~HybridShardCore.build_mesh`: once the process group exists (on every rank), the ``(replicate, shard)``
   mesh;
4. :meth:`~HybridShardCore.shard`: the module sharded by the engine, every replica starting from rank 0's weights.

With ``hybrid_shard_degree="auto"``, step 2 leaves the layout open and :meth:`~HybridShardCore.choose_degree` settles
it from the model, on every rank, between steps 3 and 4.
"""

from __future__ import annotations

import importlib.metadata
import weakref
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.nn import Module

from lightning_smp import buffers, unit_order
from lightning_smp.checkpoint import CheckpointRun, ShardedModel
from lightning_smp.collectives import Collectives
from lightning_smp.config import SMPConfig, resolve_config
from lightning_smp.config.fault_tolerance import FaultTolerance, check_fault_tolerant_layout, check_torchft
from lightning_smp.config.keys import FRONT_END_NAMES, refuse_unacted, unacted
from lightning_smp.config.options import ASYNC_FULL, StrategyOptions, engine_facing
from lightning_smp.config.replica_sync import ReplicaSync, fault_tolerant_sync_refusal, one_group_refusal
from lightning_smp.degree import Layout, resolve_strategy_layout
from lightning_smp.engines import (
    Engine,
    ShardingPlan,
    engine_for,
    engine_for_layout,
    engine_of,
    offloads_parameters,
    options_for,
    own_offload_config,
    replica_sync_refusal,
    scalars,
    selected_by,
)
from lightning_smp.errors import HybridShardConfigError, UnsupportedOptionError
from lightning_smp.mesh import axis_group, build_device_mesh
from lightning_smp.names import AUTO, SHARD_AXIS, SHARDED, FrontEndName, GradientAccumulation
from lightning_smp.replicas import broadcast_across_replicas, broadcast_before_wrapping

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from torch.distributed.device_mesh import DeviceMesh

    from lightning_smp.planner import Plan


@dataclass(frozen=True)
class Settled:
    """What configuration settles, replaced whole and never edited: the configuration merged from every source once,
    the layout (``None`` while ``hybrid_shard_degree="auto"`` waits for the model) and the engine that runs it."""

    config: SMPConfig
    layout: Layout | None
    engine: Engine

    # (cached: a Settled is never edited, and the core reads these on every backward)
    @cached_property
    def fault_tolerance(self) -> FaultTolerance | None:
        """The ``fault_tolerance`` option in effect (merged from every source), checked; ``None``: off."""
        values = self.config.fault_tolerance
        return None if values is None else FaultTolerance.from_mapping(values)

    @cached_property
    def replica_sync(self) -> ReplicaSync | None:
        """The ``replica_sync`` option in effect (merged from every source), checked; ``None``: off."""
        values = self.config.replica_sync
        return None if values is None else ReplicaSync.from_mapping(values)


@dataclass(frozen=True)
class Built:
    """What setup builds once the process group exists, replaced whole: the mesh (``None`` under a ``process_group``
    of the user's) and the layout and device type it was built for."""

    mesh: DeviceMesh | None
    layout: Layout
    device_type: str


@dataclass
class HybridShardCore:
    """The front-end-independent state of one hybrid-sharding strategy (see the module docstring for its order).

    Attributes:
        options: what the user asked for, checked (:class:`~lightning_smp.config.options.StrategyOptions`); the SMP
            keys among them are the highest configuration source.
        engine_options: the user's own engine arguments (``auto_wrap_policy`` and the ``**kwargs``), before a front
            end adds its defaults.
        mixed_precision, cpu_offload: those arguments as the user gave them.
        chosen: the planner's :class:`~lightning_smp.planner.Plan` once ``hybrid_shard_degree="auto"`` has been
            resolved by :meth:`choose_degree`.
        settled: what :meth:`configure` settled (:class:`Settled`: the configuration, layout and engine), replaced
            whole when "auto" chooses or a module sharded by another engine arrives; built: what
            :meth:`build_mesh` built (:class:`Built`); checkpoint_run: who writes this run's checkpoints.
    """

    options: StrategyOptions
    engine_options: dict[str, Any]
    mixed_precision: Any = None
    cpu_offload: Any = None
    chosen: Plan | None = None
    settled: Settled | None = None
    built: Built | None = None
    checkpoint_run: CheckpointRun = field(default_factory=CheckpointRun)
    _wrapped_root: Module | None = None
    #: every root :meth:`shard` returned, so that a state dict is only ever taken of one (see :meth:`sharded_model`)
    _roots: weakref.WeakSet[Module] = field(default_factory=weakref.WeakSet)

    # ------------------------------------------------------------------ 1. static checks

    @classmethod
    def from_options(cls, options: StrategyOptions, *, engine_options: Mapping[str, Any], mixed_precision: Any = None,
                     cpu_offload: Any = None) -> HybridShardCore:
        """The core of checked ``options``; when an ``fsdp_version`` argument names the engine already, the engine
        arguments are checked against it now (:class:`HybridShardConfigError`)."""
        core = cls(options, dict(engine_options), mixed_precision, cpu_offload)
        if options.smp.get("fsdp_version") is not None:
            core.check_engine()  # the engine is known already: refuse its wrong arguments now
        return core

    def check_engine(self, engine: Engine | None = None) -> None:
        """Static checks of the arguments against ``engine`` (by default the one in effect)."""
        engine = engine or self.engine
        engine.check_options(options_for(engine, self.engine_options), self.mixed_precision, self.cpu_offload)
        accumulation = self.options.gradient_accumulation
        if accumulation is not None and accumulation not in engine.capabilities.accumulations:
            needs = selected_by(lambda capabilities: accumulation in capabilities.accumulations)
            raise HybridShardConfigError(
                f"gradient_accumulation={accumulation!r} needs {needs}; fsdp_version="
                f"{engine.version} implements " + ", ".join(repr(g) for g in engine.capabilities.accumulations)
                + f". Fix: pass {needs}, or one of those."
            )

    # ------------------------------------------------------------------ 2. configuration, at the front end's creation

    def resolve_config(self) -> SMPConfig:
        """Every configuration source merged, the arguments on top (see :mod:`lightning_smp.config`)."""
        return resolve_config(dict(self.options.smp) or None)

    def configure(self, num_nodes: int, devices: int, front_end: FrontEndName = "trainer") -> Layout | None:
        """Resolve the configuration once (refusing a key ``front_end`` does not act on), choose the engine, check
        the arguments against it and resolve the layout for ``num_nodes x devices`` ranks (``None`` while
        ``hybrid_shard_degree="auto"`` waits for the model). Call it before any process starts."""
        config = self.resolve_config()
        refuse_unacted(config, unacted(config, front_end), FRONT_END_NAMES[front_end])
        if config.async_save and self.options.state_dict_type != SHARDED:
            # a lower source asked for background saves: the same refusal as for the argument
            raise HybridShardConfigError(ASYNC_FULL.format(state_dict_type=self.options.state_dict_type))
        self.check_engine(engine_for(config.fsdp_version))
        self.settled = Settled(config, None, engine_for(config.fsdp_version))
        self._set_layout(None if self.auto_pending else self.resolve_layout(num_nodes, devices))
        settings = self.settled.fault_tolerance  # (checked whole here, once every source is merged)
        if settings is not None:
            check_torchft(_installed("torchft"))
            fixed = ("device_mesh" if self.options.device_mesh is not None else
                     "process_group" if self.engine_options.get("process_group") is not None else None)
            check_fault_tolerant_layout(settings, self.layout, fixed_by=fixed, auto=self.auto)
            if not self.engine.capabilities.fault_tolerance:
                raise HybridShardConfigError(
                    f"fault_tolerance does not run on the {self.engine.name} engine: the reduction across groups"
                    " needs each rank's part of each parameter's gradient after the group's own reduction. Fix: pass"
                    f" {selected_by(lambda capabilities: capabilities.fault_tolerance)}."
                )
        if self.settled.replica_sync is not None:
            self._check_replica_sync()
        return self.layout

    def _check_replica_sync(self) -> None:
        """What semi-synchronous replica groups (``replica_sync``) need of this job, checked before any process
        starts (the same answer on every rank)."""
        fault_tolerance = self.settled.fault_tolerance if self.settled is not None else None
        fixed = ("device_mesh" if self.options.user_mesh is not None else
                 "process_group" if self.engine_options.get("process_group") is not None else None)
        if fixed is not None:
            raise HybridShardConfigError(
                f"{fixed} with replica_sync: the replica groups are the rows of the mesh the strategy builds. Fix:"
                " drop it and pass hybrid_shard_degree."
            )
        refusal = replica_sync_refusal(self.engine)  # (the planner leaves out what it refuses)
        if refusal is not None:
            raise HybridShardConfigError(refusal)
        layout = self.layout
        if fault_tolerance is not None:  # (each group its own job, the groups meeting through the lighthouse)
            if fault_tolerance.groups < 2:
                raise HybridShardConfigError(
                    f"replica_sync with fault_tolerance groups={fault_tolerance.groups}: there is nothing to sync"
                    " across. Fix: groups >= 2 (a job per group), or drop replica_sync."
                )
            sync = self.replica_sync
            refusal = fault_tolerant_sync_refusal(sync) if sync is not None else None
            if refusal is not None:
                raise UnsupportedOptionError(refusal)
        elif layout is not None:
            refusal = one_group_refusal(layout)
            if refusal is not None:
                raise HybridShardConfigError(refusal)

    @property
    def replica_sync(self) -> ReplicaSync | None:
        """The ``replica_sync`` option in effect, once :meth:`configure` has merged every source; ``None``: off."""
        return self.settled.replica_sync if self.settled is not None else None

    @property
    def step_group(self) -> dist.ProcessGroup | None:
        """Where a training step's own collectives run: the replica group's ranks under ``replica_sync`` (nothing
        crosses the groups between syncs), else ``None``, the world."""
        mesh = self.device_mesh
        if self.replica_sync is None or mesh is None:
            return None
        return axis_group(mesh, SHARD_AXIS)

    def _set_layout(self, layout: Layout | None) -> None:
        """The layout, and the engine that runs it: DDP's where nothing is sharded and the arguments allow
        (:func:`~lightning_smp.engines.engine_for_layout`), else the engine of ``fsdp_version``."""
        config = self.config
        engine = engine_for_layout(config.fsdp_version, layout, options=self.engine_options,
                                   mixed_precision=self.mixed_precision, cpu_offload=self.cpu_offload)
        self.settled = Settled(config, layout, engine)

    def _set_engine(self, engine: Engine) -> None:
        """A module that ``engine`` sharded (by hand, or the root of an earlier run) runs on it."""
        self.settled = replace(self.settled or Settled(self.config, self.layout, engine), engine=engine)

    @property
    def config(self) -> SMPConfig:
        """The configuration: resolved once by :meth:`configure`; before it, from the sources as they stand."""
        return self.settled.config if self.settled is not None else self.resolve_config()

    @property
    def layout(self) -> Layout | None:
        """The layout, once :meth:`configure` (or "auto"'s choice) has settled it."""
        return self.settled.layout if self.settled is not None else None

    @property
    def engine(self) -> Engine:
        """The engine in effect: before :meth:`configure`, the one ``fsdp_version`` names."""
        if self.settled is not None:
            return self.settled.engine
        return engine_for(self.options.smp.get("fsdp_version") or 1)

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The ``(replicate, shard)`` mesh :meth:`build_mesh` built, or the user's own."""
        return self.built.mesh if self.built is not None else None

    def resolve_layout(self, num_nodes: int, devices: int) -> Layout:
        degree = self.hybrid_shard_degree
        if degree == AUTO:
            raise HybridShardConfigError(
                "hybrid_shard_degree='auto' is chosen from the model when it is set up (Trainer.fit/validate/test/"
                "predict, fabric.setup_module); the layout is not known before."
            )
        return resolve_strategy_layout(num_nodes, devices, int(degree), self.options.sharding_strategy_name,
                                       mesh_shape=self.options.mesh_shape,
                                       user_mesh=self.options.user_mesh is not None)

    @property
    def configured_degree(self) -> int | str:
        """The degree as configured: a number, or ``"auto"``."""
        return self.config.hybrid_shard_degree

    @property
    def fault_tolerance(self) -> FaultTolerance | None:
        """The ``fault_tolerance`` option in effect, once :meth:`configure` has merged every source; ``None``: off."""
        return self.settled.fault_tolerance if self.settled is not None else None

    @property
    def async_save(self) -> bool:
        """Whether sharded checkpoints are written in the background (the argument, else any configuration source)."""
        return bool(self.config.async_save)

    @property
    def auto(self) -> bool:
        return self.configured_degree == AUTO

    @property
    def auto_pending(self) -> bool:
        """``hybrid_shard_degree="auto"`` and the planner has not chosen yet (nothing may be sharded)."""
        return self.auto and self.chosen is None

    @property
    def hybrid_shard_degree(self) -> int | str:
        """The degree in effect: the planner's choice once made, else the configured one (possibly ``"auto"``)."""
        return self.chosen.degree if self.chosen is not None else self.configured_degree

    @property
    def gradient_accumulation(self) -> GradientAccumulation:
        # the default of the engine fsdp_version selects, also where the DDP engine runs (which takes every mode)
        return (self.options.gradient_accumulation
                or engine_for(self.config.fsdp_version).capabilities.default_accumulation)

    # ------------------------------------------------------------------ 3. the mesh, once the process group exists

    def build_mesh(self, num_nodes: int, devices: int, device_type: str) -> Layout | None:
        """Check the world size against the layout (every rank fails alike, before any collective) and build the
        mesh once per layout and device type; none when the user passed a ``process_group``."""
        if self.layout is None and self.auto_pending:
            return None  # the planner chooses once the model exists (choose_degree), and builds the mesh then
        if self.layout is None:
            self._set_layout(self.resolve_layout(num_nodes, devices))
        layout = cast(Layout, self.layout)
        if dist.get_world_size() != layout.world_size:
            raise HybridShardConfigError(
                f"torch.distributed has {dist.get_world_size()} ranks but the strategy was configured for"
                f" world_size={layout.world_size} (num_nodes x devices). Fix: make devices/num_nodes match the launcher."
            )
        if self.engine_options.get("process_group") is not None:
            self.built = Built(None, layout, device_type)
        elif self.options.user_mesh is not None:
            self.built = Built(self.options.user_mesh, layout, device_type)
        elif self.built is None or (self.built.layout, self.built.device_type) != (layout, device_type):
            # fit, then validate/test in the same processes: building again would create new process groups
            self.built = Built(build_device_mesh(layout, device_type), layout, device_type)
        return layout

    def choose_degree(self, module: Module, *, num_nodes: int, devices: int, device: torch.device, precision: str,
                      example_input: Any = None, checkpoint: Callable[[Module], None] | None = None,
                      micro_batches: int = 1, optimizer: Any = None, training: bool = True) -> Plan:
        """``hybrid_shard_degree="auto"``: the planner's choice for ``module`` on ``num_nodes x devices`` ranks, then
        the layout (call it on every rank, once the process group exists, before sharding; the mesh comes next).

        The budget is the configured ``memory_budget``, else the device's free memory; every rank plans and the
        outcomes are compared (:func:`~lightning_smp.planner.agree.plan_on_every_rank`), so that all choose the same
        degree or all fail alike.
        """
        from lightning_smp.planner.agree import plan_on_every_rank

        if self.chosen is not None:
            return self.chosen
        if self.engine.has_wrapped(module) or self.engine.parameters_sharded(module):
            raise HybridShardConfigError(
                "hybrid_shard_degree='auto' plans from the model before it is sharded, but this model is sharded"
                " already (by configure_model or by hand). Fix: build the layers in configure_model without sharding"
                " them (the strategy shards them), or pass a number as hybrid_shard_degree."
            )
        offload = self.cpu_offload
        config = self.config
        chosen = plan_on_every_rank(
            module, configured_budget=config.memory_budget, configured_links=config.links, device=device,
            local_ranks=devices, world_size=num_nodes * devices, devices_per_node=devices,
            fsdp_version=config.fsdp_version, auto_wrap_policy=self.engine_options.get("auto_wrap_policy"),
            optimizer=optimizer, sharding_strategy=self.options.sharding_strategy_name, precision=precision,
            micro_batches=micro_batches, accumulation=self.gradient_accumulation, example_input=example_input,
            checkpoint=checkpoint, training=training,
            cpu_offload=offloads_parameters(offload), replica_sync=config.replica_sync,
        )
        self.chosen = chosen
        self._set_layout(self.resolve_layout(num_nodes, devices))
        return self.chosen

    def adopt(self, chosen: Plan, num_nodes: int, devices: int) -> None:
        """Take the choice made in the launched ranks (the process that launched them made none)."""
        self.chosen = chosen
        self._set_layout(self.resolve_layout(num_nodes, devices))

    def plan(self, device: torch.device, *, mixed_precision: Any, cpu_offload: Any, options: dict[str, Any],
             precision: str, steps_inside_a_step: bool = False) -> ShardingPlan:
        """What the engine builds: the layout on ``device``, with the user's own engine arguments."""
        if self.layout is None:
            raise HybridShardConfigError("the layout is not known yet: the strategy has not been configured.")
        mesh = self.device_mesh
        if mesh is not None and self.replica_sync is not None:
            mesh = mesh[SHARD_AXIS]  # each replica group trains on its own: the engine sees its group only
        elif mesh is not None and self.options.user_mesh is None:
            mesh = self.engine.mesh_for(mesh, self.layout)
        if own_offload_config(self.cpu_offload):
            cpu_offload = self.cpu_offload  # FSDP2's own config, kept as the user gave it
        return ShardingPlan(layout=self.layout, device=device, mesh=mesh, mixed_precision=mixed_precision,
                            cpu_offload=cpu_offload, options=options_for(self.engine, options), precision=precision,
                            steps_inside_a_step=steps_inside_a_step,
                            **engine_facing(self.options, self.config))

    # ------------------------------------------------------------------ 4. sharding the module

    def shard(self, module: Module, plan: ShardingPlan, *, checkpoint_activations: Callable[[Module], None],
              on_already_sharded: Callable[[Module], None]) -> Module:
        """Shard ``module`` (or complete what the user sharded), every replica from global rank 0's weights.

        ``checkpoint_activations`` applies the front end's activation checkpointing (before or after sharding, as the
        engine needs); ``on_already_sharded`` is told about a module the user sharded (the front ends warn there).
        Sharding the same module again (validate after fit in the same processes) returns the first result.
        """
        previous = self._wrapped_root
        if previous is not None and (previous is module or getattr(previous, "module", None) is module):
            # wrapping again would find the parameters already sharded (FSDP1: flattened, leaving 1-D views)
            self._set_engine(engine_of(previous) or self.engine)
            return previous
        other = engine_of(module)
        if other is not None and other is not self.engine:
            # sharded by hand in configure_model (fully_shard, or a DDP of the user's own): that engine runs it
            self._set_engine(other)
            if self.device_mesh is not None and self.options.user_mesh is None and self.layout is not None:
                plan = replace(plan, mesh=other.mesh_for(self.device_mesh, self.layout))
        engine, device = self.engine, plan.device
        first = engine.capabilities.checkpoint_activations_first and not engine.has_wrapped(module)
        if first:
            checkpoint_activations(module)
        # parameters the engine already manages were synced when they were sharded; their local views differ in
        # size between ranks and must not be broadcast
        synced = by_hand = engine.parameters_sharded(module)
        if engine.has_wrapped(module):
            on_already_sharded(module)
            module = engine.complete(module, plan)
        else:
            if not synced:
                # DDP semantics: every replica starts from rank 0's weights, however the ranks were seeded.
                synced = broadcast_before_wrapping(module, device)
            module = engine.wrap(module, plan)
        self._wrapped_root = module
        self._roots.add(module)
        if (not synced or (by_hand and self.replica_sync is not None)) and self.device_mesh is not None:
            # (replica_sync: a model sharded by hand was synced inside its group only, the engine's mesh being the
            # group's; it starts from the first group's shards here: every group must start from the same weights)
            broadcast_across_replicas(module, self.device_mesh, device)
        if not first:
            checkpoint_activations(module)
        if plan.broadcast_buffers and not engine.capabilities.syncs_buffers_itself:  # DDP's broadcast_buffers, on every engine
            buffers.install(module, device, self.step_group)
        unit_order.install(module, engine.units(module), device)  # LIGHTNING_SMP_CHECK_UNIT_ORDER=1 only
        return module

    def before_backward(self, module: Module) -> None:
        """Before every backward of the sharded ``module`` (both front ends): the unit-order check's turn (a no-op
        unless ``LIGHTNING_SMP_CHECK_UNIT_ORDER=1``)."""
        unit_order.before_backward(module)

    def after_backward(self, module: Module, reduced: bool) -> None:
        """After every backward of the sharded ``module`` (both front ends); ``reduced``: it ran outside an
        accumulation window, so its gradients were reduced: the scalar parameters FSDP leaves out are too."""
        if reduced:
            scalars.reduce(module, self.step_group)

    def sharded_model(self, module: Module | None, device: torch.device, owner: str) -> ShardedModel:
        """``module`` with what the state-dict code needs to know about it (``owner`` names the front end in errors)."""
        self.check_root(module, owner)
        return ShardedModel(cast(Module, module), self.engine, self.device_mesh, Collectives.current(device))

    def check_root(self, module: Module | None, owner: str) -> None:
        """Raise unless ``module`` is a root that :meth:`shard` returned (``owner`` names the front end)."""
        if module is None:
            raise HybridShardConfigError(
                f"{owner} has no model yet: state dicts exist once the model has been set up."
            )
        if module not in self._roots:
            # e.g. the module given to fabric.setup_module instead of the one it returned: under FSDP1 its
            # parameters are views into flat shards, and a checkpoint of them would be written without error, corrupt
            raise HybridShardConfigError(
                f"Could not find a FSDP model in the provided checkpoint state: the {type(module).__name__} given is"
                f" not a model that {owner} sharded. Fix: pass the module that fabric.setup_module(model) (or"
                " fabric.setup) returned, e.g. `model = fabric.setup_module(model)`, then {'model': model, ...}."
            )


def _installed(distribution: str) -> str | None:
    """The version of ``distribution`` installed here, ``None`` if it is not."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


__all__ = ["Built", "HybridShardCore", "Settled"]
