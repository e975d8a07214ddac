"""The engine seam: everything that depends on which FSDP implementation shards the model.

Data flows one way (``docs/architecture.md``): config -> degree -> :class:`~lightning_smp.degree.Layout` and mesh ->
**engine** -> front end (the Lightning Trainer strategy; later Fabric). A front end builds a :class:`ShardingPlan`
from the layout and the user's arguments and asks the engine to wrap; the checkpoint, replica and accounting code
ask the engine about a wrapped model through the same interface. Nothing outside an engine imports the FSDP
implementation's internals.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.degree import Layout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_smp.accounting.comm import CommFigure


@dataclass(frozen=True)
class ShardingPlan:
    """What a front end asks an engine to build: the layout, where, and the user's own FSDP options.

    Attributes:
        layout: replicas, shard degree and the sharding strategy that runs.
        device: the root device (its type decides the mesh and FSDP's ``device_id``).
        mesh: the mesh FSDP is given (2-D for hybrid sharding, else the 1-D axis it works on); ``None`` when the
            user passed a ``process_group`` instead.
        mixed_precision: the engine's mixed-precision config, or ``None``.
        cpu_offload: the engine's CPU offload config, or ``None``.
        options: every other argument the user passed for the FSDP implementation (``auto_wrap_policy``,
            ``process_group``, ``use_orig_params``, ...), passed through unchanged.
    """

    layout: Layout
    device: torch.device
    mesh: DeviceMesh | None = None
    mixed_precision: Any = None
    cpu_offload: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StorageUnit:
    """One tensor of persistent model storage as a rank holds it, for memory accounting.

    Attributes:
        tensor: what the rank holds (a flat shard, or a plain parameter); its ``.grad`` is the gradient it holds.
        local_numel: elements of ``tensor`` this rank stores.
        full_numel: elements of the unsharded parameters it stands for, without padding.
        padded_numel: elements of the unsharded, padded whole (``local_numel x shard ranks``, or ``full_numel``).
    """

    tensor: torch.Tensor
    local_numel: int
    full_numel: int
    padded_numel: int


@dataclass(frozen=True)
class ShardingFacts:
    """How a wrapped model is sharded, read back from the model itself.

    Attributes:
        sharding_strategy: the FSDP sharding strategy name.
        shard_degree: ranks one copy of the model is split over (1 when nothing is sharded).
        replicas: copies of the model.
        groups: ``{axis: process group}`` that the engine communicates on (``"shard"``, ``"replicate"``).
    """

    sharding_strategy: str
    shard_degree: int
    replicas: int
    groups: Mapping[str, ProcessGroup]


@runtime_checkable
class Engine(Protocol):
    """One FSDP implementation, as the rest of the package needs it. Implementations: :class:`FSDP1Engine`."""

    #: a short name for logs and records (``"fsdp1"``)
    name: str

    def wrap(self, module: Module, plan: ShardingPlan) -> Module:
        """Shard ``module`` as ``plan`` says and return the module to train (the root wrapper)."""
        ...

    def wrap_context(self, plan: ShardingPlan) -> AbstractContextManager[None]:
        """A context in which modules the user shards by hand (``configure_model``) get ``plan``'s settings."""
        ...

    def is_sharded(self, module: Module) -> bool:
        """Whether any part of ``module`` is already sharded by this engine."""
        ...

    def holds_shards(self, module: Module) -> bool:
        """Whether ``module``'s parameters are already this engine's shards (sizes then differ between ranks)."""
        ...

    def full_model_state(self, model: Module, device: torch.device) -> dict[str, Any]:
        """The unsharded model state, gathered inside this rank's shard group. Collective over that group."""
        ...

    def full_optimizer_state(
        self, model: Module, optimizer: Optimizer, device: torch.device, group: ProcessGroup | None
    ) -> dict[str, Any]:
        """The unsharded optimizer state keyed by parameter index in the optimizer's order (torch's standard
        layout), gathered over ``group``; meaningful on that group's first rank. Collective over ``group``."""
        ...

    def optimizer_state_by_name(self, model: Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """A full optimizer state keyed by parameter index, re-keyed by parameter name for ``set_optimizer_state_dict``."""
        ...

    def clip_grad_norm(self, model: Module, max_norm: float) -> torch.Tensor | None:
        """Clip the gradients of the whole model to ``max_norm`` (the norm over all shards, each counted once) and
        return the total norm; ``None``, clipping nothing, when ``model`` has no single root to clip over."""
        ...

    def storage(self, model: Module) -> list[StorageUnit]:
        """What this rank stores of every parameter of ``model``, managed by the engine or not."""
        ...

    def full_numels(self, model: Module) -> dict[int, int]:
        """``{id(tensor): unsharded elements}`` for every parameter and shard of ``model`` (optimizer accounting)."""
        ...

    def sharding(self, model: Module) -> ShardingFacts | None:
        """How ``model`` is sharded; ``None`` when the engine does not manage it."""
        ...

    def step_textbook(self, model: Module, backward_passes: int, synced_passes: int) -> CommFigure | None:
        """The textbook communication of one optimizer step of ``model`` with ``backward_passes`` micro-batches,
        ``synced_passes`` of them reducing gradients."""
        ...

    def patch_wrapper(self, rewrite: Callable[[dict[str, Any]], Callable[[Module], None] | None]) -> Callable[[], None]:
        """Make every later wrapper call of the plain-PyTorch API pass its bound arguments through ``rewrite`` (which
        may change them in place and return a hook to run on the wrapped module); return a function that undoes it.
        Used by :func:`lightning_smp.init`."""
        ...


__all__ = ["Engine", "ShardingFacts", "ShardingPlan", "StorageUnit"]
