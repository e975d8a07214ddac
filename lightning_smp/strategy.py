"""``HybridShardFSDPStrategy``: Lightning glue around :mod:`lightning_smp.degree` and :mod:`lightning_smp.mesh`."""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.strategies.fsdp import (
    _has_meta_device_parameters_or_buffers,
    _move_torchmetrics_to_device,
    _setup_activation_checkpointing,
)
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smp import checkpoint as checkpoint_lib
from lightning_smp.degree import (
    HYBRID_SHARD,
    HYBRID_SHARD_ZERO2,
    HYBRID_STRATEGIES,
    Layout,
    check_degree,
    check_sharding_strategy,
    resolve_layout,
)
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.launcher import HybridShardMultiProcessingLauncher
from lightning_smp.mesh import REPLICATE_AXIS, SHARD_AXIS, build_device_mesh, fsdp_mesh
from lightning_smp.precision import HybridShardPrecision
from lightning_smp.replicas import broadcast_across_replicas, broadcast_before_wrapping

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    _POLICY = Union[set[type[Module]], Any, ModuleWrapPolicy]

log = logging.getLogger(__name__)

StartMethod = Literal["popen", "fork", "spawn", "forkserver"]
_START_METHODS = ("popen", "fork", "spawn", "forkserver")

#: Names registered in Lightning's ``StrategyRegistry`` on ``import lightning_smp``: (name, description, init args).
REGISTERED_NAMES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("smp_hybrid", "SMP-style hybrid sharded data parallelism (FSDP HYBRID_SHARD)", {"sharding_strategy": HYBRID_SHARD}),
    (
        "smp_hybrid_zero2",
        "SMP-style hybrid sharded data parallelism, ZeRO-2 flavour (FSDP _HYBRID_SHARD_ZERO2)",
        {"sharding_strategy": HYBRID_SHARD_ZERO2},
    ),
    (
        "smp_hybrid_notebook",
        "SMP-style hybrid sharding launched by fork, for Jupyter notebooks",
        {"sharding_strategy": HYBRID_SHARD, "start_method": "fork"},
    ),
)


class HybridShardFSDPStrategy(FSDPStrategy):
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
        sharding_strategy: ``"HYBRID_SHARD"`` (default), ``"_HYBRID_SHARD_ZERO2"``, ``"FULL_SHARD"``,
            ``"SHARD_GRAD_OP"`` or ``"NO_SHARD"`` (any case), or a ``ShardingStrategy``. With
            ``hybrid_shard_degree >= 2`` anything but ``"_HYBRID_SHARD_ZERO2"`` becomes ``"HYBRID_SHARD"`` (a warning
            names both). A shard group that spans the whole world runs ``FULL_SHARD`` (``SHARD_GRAD_OP`` for
            ZeRO-2), which costs no all-reduce over size-1 replica groups.
        state_dict_type: ``"sharded"`` (default) or ``"full"``. ``"sharded"``: a folder written by
            ``torch.distributed.checkpoint``, every rank writing its shard once (replica group 0 only), nothing
            gathered on one rank; the default because resuming is what checkpoints during training are for, and
            it resumes exactly at any degree and world size. ``"full"``: one file assembled once on rank 0, which
            also loads on a single device. Either loads whatever is configured; convert with
            ``python -m lightning_smp.checkpoint consolidate SRC DST`` (see :mod:`lightning_smp.checkpoint`).
        device_mesh: ``None`` (default: built from ``hybrid_shard_degree``), a tuple ``(replicas, shard_degree)``
            (same as ``hybrid_shard_degree=shard_degree``), or a 2-D ``DeviceMesh`` you built yourself (used as is;
            its second dimension is the shard group). Contradicting ``hybrid_shard_degree`` is an error.
        hybrid_shard_degree: ``None`` (default: take it from :func:`lightning_smp.init` or the environment, else
            ``0``), ``0`` (native FSDP: ``HYBRID_SHARD`` shards inside a node, ``FULL_SHARD`` over all ranks),
            ``1`` (no sharding: full replicas kept in sync like DDP) or any divisor ``d >= 2`` of the world size
            (shard groups of ``d`` ranks, ``world_size / d`` replicas).
        start_method: how processes are started. ``None`` (default): ``"fork"`` in an interactive session
            (Jupyter, IPython), else ``"popen"`` (re-run the script per rank, like Lightning's FSDP). Also
            ``"fork"``, ``"spawn"`` or ``"forkserver"`` (Lightning's multiprocessing launcher). Processes started
            externally (``torchrun``, SLURM) are always used as they are. With fork/spawn, the process that calls
            ``fit`` gets the trained weights, loop counters, metrics and callback reports back, and its
            ``trainer.save_checkpoint`` writes one full checkpoint file; such a Trainer fits once (use a new one).
            See :mod:`lightning_smp.launcher`.
        \**kwargs: passed to :class:`torch.distributed.fsdp.FullyShardedDataParallel` (e.g. ``process_group``,
            ``limit_all_gathers``, ``use_orig_params``, defaulting to ``True``). A ``process_group`` you pass is used
            as is (no mesh is built); its size must match ``hybrid_shard_degree`` when both are given.

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
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        cpu_offload: Union[bool, "CPUOffload", None] = None,
        mixed_precision: Optional["MixedPrecision"] = None,
        auto_wrap_policy: Optional["_POLICY"] = None,
        activation_checkpointing: Optional[Union[type[Module], list[type[Module]]]] = None,
        activation_checkpointing_policy: Optional["_POLICY"] = None,
        sharding_strategy: Union[
            "ShardingStrategy", Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
        ] = "HYBRID_SHARD",
        state_dict_type: Literal["sharded", "full"] = "sharded",
        device_mesh: Optional[Union[tuple[int, int], "DeviceMesh"]] = None,
        hybrid_shard_degree: Optional[int] = None,
        start_method: Optional[StartMethod] = None,
        **kwargs: Any,
    ) -> None:
        self._requested_strategy = check_sharding_strategy(sharding_strategy)
        self._degree_arg = None if hybrid_shard_degree is None else check_degree(hybrid_shard_degree)
        self._user_mesh, mesh_degree = _check_device_mesh(device_mesh)
        self._mesh_shape_arg = tuple(device_mesh) if isinstance(device_mesh, (tuple, list)) else None
        if device_mesh is not None and kwargs.get("process_group") is not None:
            raise HybridShardConfigError(
                "device_mesh and process_group were both given; they are mutually exclusive. Fix: pass only one."
            )
        self._degree_arg = _reconcile("device_mesh", mesh_degree, self._degree_arg)
        self._degree_arg = _reconcile("process_group", _process_group_degree(kwargs.get("process_group")), self._degree_arg)
        if start_method is not None and start_method not in _START_METHODS:
            raise HybridShardConfigError(
                f"start_method={start_method!r} is not supported. Valid values: None (automatic), "
                + ", ".join(repr(m) for m in _START_METHODS)
                + "."
            )
        if state_dict_type not in ("full", "sharded"):
            raise HybridShardConfigError(f"state_dict_type={state_dict_type!r} is not supported. Valid values: 'full', 'sharded'.")
        self._start_method: StartMethod = start_method or ("fork" if _IS_INTERACTIVE else "popen")
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
            state_dict_type=state_dict_type,
            device_mesh=None,
            **kwargs,
        )
        self._layout: Optional[Layout] = None
        self._device_mesh: Optional["DeviceMesh"] = None
        self._mesh_layout: Optional[tuple[Layout, str]] = None
        self._wrapped_root: Optional[Module] = None
        self._warned_override = False

    # ------------------------------------------------------------------ configuration

    @property
    def hybrid_shard_degree(self) -> int:
        """The degree in effect: the constructor argument, else a LightningCLI ``smp:`` section, else
        :func:`lightning_smp.init`, else ``LIGHTNING_SMP_CONFIG``/``SM_HP_MP_PARAMETERS``, else 0.

        Every source is checked even when a higher one wins (see :mod:`lightning_smp.config`).
        """
        from lightning_smp.config import configured_degree

        return configured_degree(explicit=self._degree_arg)

    @property
    def start_method(self) -> StartMethod:
        """How processes are started: ``"popen"``, ``"fork"``, ``"spawn"`` or ``"forkserver"``."""
        return self._start_method

    @property
    def layout(self) -> Layout:
        """Replicas, shard degree and the FSDP sharding strategy in effect (known once the Trainer exists)."""
        if self._layout is None:
            raise HybridShardConfigError(
                "HybridShardFSDPStrategy.layout is not known yet: it is resolved when the Trainer is created."
            )
        return self._layout

    @property
    def device_mesh(self) -> "DeviceMesh":
        """The 2-D ``DeviceMesh`` with axes ``("replicate", "shard")``, built in ``setup_environment``."""
        if self._device_mesh is None:
            if self.kwargs.get("process_group") is not None:
                raise HybridShardConfigError(
                    "HybridShardFSDPStrategy.device_mesh does not exist: a process_group was passed and is used as is."
                )
            raise HybridShardConfigError(
                "HybridShardFSDPStrategy.device_mesh is not available before setup: it is built in"
                " setup_environment(), once the process group exists (inside Trainer.fit/validate/test/predict)."
            )
        return self._device_mesh

    def _resolve_layout(self) -> Layout:
        world_size = self.num_nodes * self.num_processes
        layout = resolve_layout(
            world_size, self.hybrid_shard_degree, self._requested_strategy, devices_per_node=self.num_processes
        )
        if self._user_mesh is not None and layout.sharding_strategy not in HYBRID_STRATEGIES:
            # the user's own mesh is given to FSDP as is, which needs a hybrid strategy
            layout = _with_strategy(layout, HYBRID_SHARD_ZERO2 if "ZERO2" in layout.requested_strategy else HYBRID_SHARD)
        given = tuple(self._user_mesh.shape) if self._user_mesh is not None else self._mesh_shape_arg
        if given is not None and given != layout.mesh_shape:
            raise HybridShardConfigError(
                f"device_mesh of shape {given} does not fit world_size={world_size}"
                f" (num_nodes={self.num_nodes} x devices={self.num_processes}). Fix: use shape"
                f" {layout.mesh_shape} or pass hybrid_shard_degree instead."
            )
        return layout

    # ------------------------------------------------------------------ launch and process groups

    @override
    def _configure_launcher(self) -> None:
        # Validate the world-size facts here, at Trainer(...), before any process is started.
        self._layout = layout = self._resolve_layout()
        self.precision_plugin.set_device_type(self.root_device.type)
        if layout.overridden and not self._warned_override:
            self._warned_override = True
            rank_zero_warn(layout.override_message())
        assert self.cluster_environment is not None
        if self._start_method == "popen" or self.cluster_environment.creates_processes_externally:
            # unlike FSDPStrategy, also in externally started processes: the launcher caps their threads
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = HybridShardMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        # Same inputs on every rank, so every rank fails identically here, before the first collective.
        self._layout = layout = self._resolve_layout()
        super().setup_environment()
        if dist.get_world_size() != layout.world_size:
            raise HybridShardConfigError(
                f"torch.distributed has {dist.get_world_size()} ranks but the Trainer was configured for"
                f" world_size={layout.world_size} (num_nodes x devices). Fix: make devices/num_nodes match the launcher."
            )
        from torch.distributed.fsdp import ShardingStrategy

        self.sharding_strategy = ShardingStrategy[layout.sharding_strategy]
        if self.kwargs.get("process_group") is None:
            if self._user_mesh is not None:
                self._device_mesh = self._user_mesh
            elif self._mesh_layout != (layout, self.root_device.type):
                # fit, then validate/test on the same Trainer: building again would create new process groups
                self._device_mesh = build_device_mesh(layout, self.root_device.type)
                self._mesh_layout = (layout, self.root_device.type)
            self.kwargs["device_mesh"] = self._device_mesh if self._user_mesh is not None else fsdp_mesh(self._device_mesh, layout)
        rank_zero_info(f"{type(self).__name__}: {layout.describe()}")

    # ------------------------------------------------------------------ model wrapping

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        # a ModelCheckpoint(save_top_k=0) without save_last never saves
        saving = [cb for cb in trainer.checkpoint_callbacks
                  if getattr(cb, "save_top_k", 1) != 0 or getattr(cb, "save_last", False)]
        if trainer.state.fn == TrainerFn.FITTING and saving:
            # fail now, not at the first save hours into training (the same check as checkpoint_lib.save)
            datamodule = getattr(trainer, "datamodule", None)
            problem = checkpoint_lib.hyperparameters_problem(trainer.lightning_module, datamodule)
            problem = self.broadcast(problem if self.global_rank == 0 else None)
            if problem is not None:
                raise HybridShardConfigError(f"ModelCheckpoint could not save this run: {problem}")
        super().setup(trainer)
        self.precision_plugin.fsdp_module = self.model

    @override
    def _setup_model(self, model: Module) -> Module:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp._common_utils import _is_fsdp_flattened

        previous = self._wrapped_root
        if previous is not None and previous.module is model:
            # validate/test (or another fit) after fit in the same processes: wrapping again would find the
            # parameters already flattened into shards and leave 1-D views for the forward; keep the wrapper
            return previous
        already_wrapped = any(isinstance(mod, FullyShardedDataParallel) for mod in model.modules())
        # parameters FSDP already manages were synced when they were wrapped; their local views differ in size
        # between ranks and must not be broadcast
        synced = any(_is_fsdp_flattened(p) for p in model.parameters())
        if already_wrapped:
            if _has_meta_device_parameters_or_buffers(model):
                rank_zero_warn("The model is already wrapped in `FSDP` but there are still parameters on the meta device.")
            if "auto_wrap_policy" in self.kwargs:
                rank_zero_warn("A FSDP `auto_wrap_policy` is set, but the model is already wrapped. The policy will be ignored.")
                del self.kwargs["auto_wrap_policy"]
        else:
            if not synced:
                # DDP semantics: every replica starts from rank 0's weights, however the ranks were seeded.
                synced = broadcast_before_wrapping(model, self.root_device)
            model = FullyShardedDataParallel(module=model, **self._fsdp_kwargs())
            self._wrapped_root = model
        if not synced and self._device_mesh is not None:
            broadcast_across_replicas(model, self._device_mesh, self.root_device)

        _move_torchmetrics_to_device(model, self.root_device)
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, **self._fsdp_kwargs()):
            yield

    def _fsdp_kwargs(self) -> dict[str, Any]:
        """What every ``FullyShardedDataParallel`` this strategy creates is given."""
        return {
            "cpu_offload": self.cpu_offload,
            "mixed_precision": self.mixed_precision_config,
            "sharding_strategy": self.sharding_strategy,
            # FSDP needs a device, not an index: ``torch.device("cpu").index`` is None
            "device_id": self.root_device,
            **self.kwargs,
        }

    # ------------------------------------------------------------------ precision

    @property
    @override
    def precision_plugin(self) -> HybridShardPrecision:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = HybridShardPrecision("32-true")
        return plugin  # type: ignore[return-value]

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        if precision_plugin is not None and not isinstance(precision_plugin, FSDPPrecision):
            raise TypeError(
                f"HybridShardFSDPStrategy needs an `FSDPPrecision` plugin, found {type(precision_plugin).__name__}."
                " Fix: pass `Trainer(precision=...)` (e.g. '32-true', 'bf16-mixed') instead of a precision plugin,"
                " or an `FSDPPrecision`."
            )
        if isinstance(precision_plugin, FSDPPrecision) and not isinstance(precision_plugin, HybridShardPrecision):
            precision_plugin = HybridShardPrecision.from_plugin(precision_plugin)
        self._precision_plugin = precision_plugin

    # ------------------------------------------------------------------ state dicts

    def full_state_dict(self) -> dict[str, Any]:
        """The unsharded model weights on global rank 0 (an empty dict on the other ranks). Call it on every rank.

        Assembled once: only replica group 0 gathers, the other replicas skip the work.
        """
        return checkpoint_lib.full_model_state(self)

    def _in_launching_process(self) -> bool:
        """True in the process (a notebook) that forked the ranks: its module is unwrapped and holds full weights."""
        launcher = self._launcher
        return isinstance(launcher, HybridShardMultiProcessingLauncher) and launcher.in_main_process

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        if self._in_launching_process():
            # the ranks that held the shards have ended: one full file, with the optimizer state they sent back
            assert isinstance(self._launcher, HybridShardMultiProcessingLauncher)
            checkpoint = self._launcher.complete_checkpoint(checkpoint)
            checkpoint_lib.save(self, checkpoint, filepath, storage_options, kind=checkpoint_lib.FULL)
            return
        # atomic, never over another run's checkpoint, tensors written once (see lightning_smp.checkpoint)
        checkpoint_lib.save(self, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # always weights_only: a sharded folder or full file, resharded to this degree and world size
        return checkpoint_lib.load(self, checkpoint_path)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._in_launching_process():
            return self.lightning_module.state_dict()  # type: ignore[union-attr]
        return checkpoint_lib.module_state_dict(self)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        return checkpoint_lib.optimizer_state(self, optimizer)

    # ------------------------------------------------------------------ registration

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``smp_hybrid``, ``smp_hybrid_zero2`` and ``smp_hybrid_notebook``; calling it again is harmless."""
        if not dist.is_available():
            return
        for name, description, init_params in REGISTERED_NAMES:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **init_params)
            if name not in cls._registered_strategies:
                cls._registered_strategies.append(name)


def _check_device_mesh(device_mesh: Any) -> tuple[Optional["DeviceMesh"], Optional[int]]:
    """Static checks of ``device_mesh``: returns (user mesh or None, the shard degree it implies or None)."""
    if device_mesh is None:
        return None, None
    if isinstance(device_mesh, (tuple, list)):
        if len(device_mesh) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in device_mesh):
            raise HybridShardConfigError(
                f"device_mesh={device_mesh!r} must be a tuple (replicas, shard_degree) of two positive integers."
                " Fix: e.g. device_mesh=(2, 4), or pass hybrid_shard_degree=4 instead."
            )
        return None, device_mesh[1]
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 2:
        raise HybridShardConfigError(
            f"device_mesh={device_mesh!r} must be a 2-D DeviceMesh (replicate, shard) or a tuple (replicas, shard_degree)."
        )
    if device_mesh.size(1) == 1:
        raise HybridShardConfigError(
            f"device_mesh of shape {tuple(device_mesh.shape)} has shard groups of one rank: FSDP would all-reduce over"
            " size-1 groups and replicas would never synchronise. Fix: pass hybrid_shard_degree=1 instead."
        )
    return device_mesh, device_mesh.size(1)


def _process_group_degree(process_group: Any) -> Optional[int]:
    if process_group is None:
        return None
    intra = process_group[0] if isinstance(process_group, tuple) else process_group
    return intra.size()


def _reconcile(source: str, implied: Optional[int], degree: Optional[int]) -> Optional[int]:
    """Merge the degree implied by ``device_mesh``/``process_group`` with ``hybrid_shard_degree``."""
    if implied is None:
        return degree
    if degree not in (None, 0, implied):
        raise HybridShardConfigError(
            f"hybrid_shard_degree={degree} contradicts {source}, whose shard group has {implied} rank(s)."
            f" Fix: pass only one of them, or make them agree (hybrid_shard_degree={implied})."
        )
    return implied


def _with_strategy(layout: Layout, sharding_strategy: str) -> Layout:
    from dataclasses import replace

    return replace(layout, sharding_strategy=sharding_strategy)


__all__ = ["HybridShardFSDPStrategy", "REGISTERED_NAMES", "SHARD_AXIS", "REPLICATE_AXIS"]
