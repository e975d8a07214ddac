"""What the Trainer and the Fabric strategies expose of their :class:`~lightning_smp.core.HybridShardCore`, once.

The two strategies differ in their Lightning base class (``lightning.pytorch.strategies.FSDPStrategy`` and
``lightning.fabric.strategies.FSDPStrategy``) and in the hooks they override; the public properties, the start-up
steps they share and their messages are this mixin's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module

from lightning_smp.checkpoint import CheckpointRun
from lightning_smp.checkpoint.background import BackgroundSaver
from lightning_smp.collectives import Collectives, checkpoint_group, release_process_groups_at_exit
from lightning_smp.core import HybridShardCore
from lightning_smp.degree import Layout
from lightning_smp.engines import Engine, ShardingPlan
from lightning_smp.engines.unused import read_outside_forward_message
from lightning_smp.errors import HybridShardConfigError, ShardedParameterError
from lightning_smp.mesh import group_ranks
from lightning_smp.names import MESH_AXES, GradientAccumulation
from lightning_smp.peers import RankAddress, gather_addresses, lost_peer_note

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import ShardingStrategy

    from lightning_smp.planner import Plan


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
    node_rank: int  # Lightning's ParallelStrategy, Trainer's and Fabric's alike

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
        return ShardingStrategy[layout.sharding_strategy if layout is not None else self.core.requested_strategy]

    @sharding_strategy.setter
    def sharding_strategy(self, value: Any) -> None:
        # Lightning's FSDPStrategy.__init__ writes FULL_SHARD here (the hybrid strategy was passed to it as FULL_SHARD:
        # its check for HYBRID_* needs a mesh that cannot exist yet); what is in effect follows the layout
        pass

    def _refuse_shard_values(self, tensor: Any) -> None:
        """Before a backward of ``tensor`` or a reduction of it across ranks (``sync_dist``, ``fabric.all_reduce``):
        a value computed from parameters outside their unit's forward is itself a shard (FSDP2: a ``DTensor``),
        on every rank alike; torch would fail deep inside the backward or the collective without naming the cause."""
        if isinstance(tensor, torch.Tensor) and self.engine.is_shard(tensor):
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
        return layout

    @property
    def async_save(self) -> bool:
        """Whether sharded checkpoints are written in the background (see :mod:`lightning_smp.checkpoint.background`)."""
        return self.core.async_save

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


__all__ = ["HybridShardFrontEnd"]

