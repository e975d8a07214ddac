"""What the Trainer and the Fabric strategies expose of their :class:`~lightning_smp.core.HybridShardCore`, once.

The two strategies differ in their Lightning base class (``lightning.pytorch.strategies.FSDPStrategy`` and
``lightning.fabric.strategies.FSDPStrategy``) and in the hooks they override; the public properties, the start-up
steps they share and their messages are this mixin's.
"""

from __future__ import annotations

import atexit
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module

from lightning_smp.checkpoint import CheckpointRun
from lightning_smp.core import HybridShardCore
from lightning_smp.degree import Layout
from lightning_smp.engines import Engine
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.names import GradientAccumulation

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class HybridShardFrontEnd:
    """Mixin of the two strategies (listed before their Lightning base class)."""

    core: HybridShardCore
    #: who creates the strategy, and where its mesh is built, for messages
    _created_by = "the Trainer"
    _mesh_built_in = "inside Trainer.fit/validate/test/predict"
    _warned_override = False

    @property
    def hybrid_shard_degree(self) -> int:
        """The degree in effect: the constructor argument, else a LightningCLI ``smp:`` section, else
        :func:`lightning_smp.init`, else ``LIGHTNING_SMP_CONFIG``/``SM_HP_MP_PARAMETERS``, else 0.

        Resolved once, when the strategy is configured; every source is checked even when a higher one wins (see
        :mod:`lightning_smp.config`).
        """
        return self.core.hybrid_shard_degree

    @property
    def engine(self) -> Engine:
        """The engine that shards the model (``fsdp_version``; settled when the strategy is configured)."""
        return self.core.engine

    @property
    def checkpoint_run(self) -> CheckpointRun:
        """Who writes this run's checkpoints (see :class:`lightning_smp.checkpoint.CheckpointRun`)."""
        return self.core.checkpoint_run

    @property
    def fsdp_version(self) -> int:
        """The engine in effect: 1 (``FullyShardedDataParallel``) or 2 (``fully_shard``)."""
        return self.engine.version

    @property
    def gradient_accumulation(self) -> GradientAccumulation:
        """What micro-batches before the last of an optimizer step communicate (the engine's default unless given)."""
        return self.core.gradient_accumulation

    @property
    def layout(self) -> Layout:
        """Replicas, shard degree and the FSDP sharding strategy in effect (known once the strategy is configured)."""
        if self.core.layout is None:
            raise HybridShardConfigError(
                f"{type(self).__name__}.layout is not known yet: it is resolved when {self._created_by} is created."
            )
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

    def _warn_override_once(self, layout: Layout) -> None:
        if layout.overridden and not self._warned_override:
            self._warned_override = True
            rank_zero_warn(layout.override_message())

    def _set_up_mesh(self, num_nodes: int, devices: int, device_type: str) -> Layout:
        """The mesh, once the process group exists; FSDP's own ``sharding_strategy`` attribute follows the layout."""
        from torch.distributed.fsdp import ShardingStrategy

        _destroy_process_groups_at_exit()
        layout = self.core.build_mesh(num_nodes, devices, device_type)
        self.sharding_strategy = ShardingStrategy[layout.sharding_strategy]
        rank_zero_info(f"{type(self).__name__}: {layout.describe()}")
        return layout

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


_exit_hook_registered = False


def _destroy_process_groups_at_exit() -> None:
    """Destroy the process groups while the interpreter is still whole, for every backend.

    Lightning registers this for NCCL only. A gloo process group left to interpreter finalization can abort the
    process (``terminate called without an active exception``, exit code -6) after a run that finished: its worker
    threads still hold work objects whose tensors need the GIL (pytorch/pytorch#190489). The mesh's extra groups
    make this likelier. Destroying a group is local for gloo, so a peer that already exited cannot block it.
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(_destroy_dist_connection)
