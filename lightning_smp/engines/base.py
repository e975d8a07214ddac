"""The engine seam: everything that depends on which FSDP implementation shards the model.

Data flows one way (``docs/architecture.md``): config -> degree -> :class:`~lightning_smp.degree.Layout` and mesh ->
**engine** -> front end (the Lightning Trainer strategy; later Fabric). A front end builds a :class:`ShardingPlan`
from the layout and the user's arguments and asks the engine to wrap; the checkpoint, replica and accounting code
ask the engine about a wrapped model through the same interface. Nothing outside an engine imports the FSDP
implementation's internals.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.degree import Layout
from lightning_smp.names import GradientAccumulation

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_smp.engines.prediction import Prediction
    from lightning_smp.engines.textbook import CommFigure
    from lightning_smp.engines.unused import Unreduced


@dataclass(frozen=True)
class ShardingPlan:
    """What a front end asks an engine to build: the layout, where, and the user's own FSDP options.

    Attributes:
        layout: replicas, shard degree and the sharding strategy that runs.
        device: the root device (its type decides the mesh and FSDP's ``device_id``).
        mesh: the mesh FSDP is given (2-D for hybrid sharding, else the 1-D axis it works on); ``None`` when the
            user passed a ``process_group`` instead.
        mixed_precision: the user's mixed-precision config for the engine, else Lightning's FSDP1 config for the
            Trainer's precision (an engine that needs another kind builds it from ``precision``), or ``None``.
        cpu_offload: Lightning's ``CPUOffload`` (or the engine's own offload config the user passed), or ``None``.
        precision: the Trainer's precision (``"32-true"``, ``"bf16-mixed"``, ...).
        options: every other argument the user passed for the FSDP implementation (``auto_wrap_policy``,
            ``process_group``, ``use_orig_params``, ...), passed through unchanged.
        steps_inside_a_step: whether backward passes and optimizer steps run inside a step that runs as the root's
            forward (Lightning's manual optimization).
        broadcast_buffers: whether every rank gets global rank 0's buffers by DDP's rule (the DDP engine passes it
            to ``DistributedDataParallel``; the core installs :mod:`lightning_smp.buffers` for the others).

    Every option declared to act in the engines (``acts_in=("engines",)``) is a field here of the option's name,
    which the core fills from the declaration (:func:`lightning_smp.config.options.engine_facing`): adding one is
    its declaration, its field here, and the engines reading it.
    """

    layout: Layout
    device: torch.device
    mesh: DeviceMesh | None = None
    mixed_precision: Any = None
    cpu_offload: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)
    precision: str = "32-true"
    steps_inside_a_step: bool = False
    broadcast_buffers: bool = True



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


@dataclass(frozen=True)
class Capabilities:
    """How an engine differs from the others, as one record (the front ends and the core read it; ``docs/engines.md``
    tabulates it).

    Attributes:
        accumulations: the gradient-accumulation modes it implements (:mod:`lightning_smp.accumulation`), its
            default first.
        checkpoint_activations_first: activation checkpointing is applied before sharding (else after, on the
            wrapped model).
        steps_inside_a_step: backward passes and optimizer steps can run inside a Lightning step (manual
            optimization).
        replaces_parameters: wrapping replaces the module's parameter objects (an optimizer built before would
            update nothing).
        syncs_buffers_itself: its wrapper runs DDP's buffer rule before forwards itself (else
            :mod:`lightning_smp.buffers` does).
        fault_tolerance: it runs fault-tolerant replica groups (``fault_tolerance=``): the gradients of each
            parameter reach the crossing as this rank's part of them, after the group's own reduction.
        replica_sync: it runs semi-synchronous replica groups (``replica_sync=``): each rank's part of each parameter
            is the same part of the same parameter in every replica group, a plain tensor or its local shard, so
            that the outer loop averages it across groups rank by rank.
        own_options: the user's arguments only this engine takes (the others set them aside:
            :func:`lightning_smp.engines.options_for`).
    """

    accumulations: tuple[GradientAccumulation, ...]
    checkpoint_activations_first: bool
    steps_inside_a_step: bool
    replaces_parameters: bool
    syncs_buffers_itself: bool
    fault_tolerance: bool = False
    replica_sync: bool = False
    own_options: frozenset[str] = frozenset()

    @property
    def default_accumulation(self) -> GradientAccumulation:
        return self.accumulations[0]


@runtime_checkable
class Wrapping(Protocol):
    """Sharding a module, and recognising what sharding made (the core, the planner's probe, ``init()``'s patches)."""

    def check_options(self, options: Mapping[str, Any], mixed_precision: Any, cpu_offload: Any) -> None:
        """Refuse, with :class:`~lightning_smp.errors.UnsupportedOptionError`, arguments this engine does not take,
        naming its equivalent. Static: called before any process starts."""
        ...

    def mesh_for(self, mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
        """The part of the 2-D ``(replicate, shard)`` mesh this engine is given for ``layout``."""
        ...

    def wrap(self, module: Module, plan: ShardingPlan) -> Module:
        """Shard ``module`` as ``plan`` says and return the module to train (the root wrapper)."""
        ...

    def complete(self, module: Module, plan: ShardingPlan) -> Module:
        """A model the user sharded (in part) in ``configure_model``, made ready to train as ``plan`` says."""
        ...

    def wrap_context(self, plan: ShardingPlan) -> AbstractContextManager[None]:
        """A context in which modules the user shards by hand (``configure_model``) get ``plan``'s settings."""
        ...

    def units(self, module: Module) -> list[tuple[str, Module]]:
        """The sharded units of ``module`` (qualified name, module), in ``named_modules`` order."""
        ...

    def has_wrapped(self, module: Module) -> bool:
        """Whether this engine wrapped ``module`` or any part of it (a unit below it, or the root itself)."""
        ...

    def parameters_sharded(self, module: Module) -> bool:
        """Whether ``module``'s parameters already are this engine's shards (their sizes then differ between ranks,
        and they were synced when they were sharded)."""
        ...

    def is_shard_tensor(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one of this engine's shards (of a unit wrapped already), not a full tensor; also a
        value computed from one (FSDP2: a ``DTensor``)."""
        ...


@runtime_checkable
class Training(Protocol):
    """What a step needs of the engine: the front ends' hooks and the precision plugins, once per micro-batch or
    optimizer step."""

    def call_through_root(self, root: Module, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` (a step of the module that is itself the sharded root) so that the root's forward hooks
        run once around it; a root that wraps the module (FSDP1) calls it directly."""
        ...

    def prepare_backward(self, model: Module, output: Any) -> None:
        """Before a backward that the root's forward did not prepare (Lightning's manual optimization, where a step
        may run several): whatever the engine must know of it (DDP: the outputs its reducer starts from)."""
        ...

    def accumulation_context(self, model: Module, accumulation: GradientAccumulation) -> AbstractContextManager[None]:
        """The context every micro-batch but the last of an optimizer step runs in, as the mode's record says
        (:mod:`lightning_smp.accumulation`); leaving it restores full synchronisation, so that the last micro-batch
        always reduces (and the optimizer never sees missing gradients)."""
        ...

    def settle_gradients(self, model: Module, *, defer_unused: bool = False) -> Unreduced | None:
        """Before an optimizer step, on every rank (it may be a collective): raise
        :class:`~lightning_smp.errors.GradientSyncError` when the last backward ran with gradient reduction still
        turned off (the gradients would be missing or unreduced, silently); then leave each ``.grad`` as DDP would,
        ``None`` for a parameter that no rank gave a gradient since the last step.

        With ``defer_unused`` that last part is left to the caller: this rank's notes come back unreduced
        (:class:`~lightning_smp.engines.unused.Unreduced`; ``None`` where the engine keeps none) for the caller to
        reduce in a collective of its own (fault tolerance reduces them inside its commit vote)."""
        ...

    def discard_unreduced_gradients(self, model: Module) -> None:
        """Forget gradients accumulated for a later reduction and held outside ``.grad`` (``optimizer.zero_grad()``
        in the middle of an accumulation window discards them, as it does under DDP)."""
        ...

    def release_gathered(self, model: Module) -> None:
        """Free the parameters a forward without backward left gathered (a validation run), so that the next forward
        gathers the shards again: called before something outside a training step writes the shards in place
        (``replica_sync``'s outer loop), which the gathered copies would otherwise hide from that forward."""
        ...

    def clip_grad_norm(self, model: Module, max_norm: float,
                       parameters: Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
        """Clip the gradients of ``parameters`` (an optimizer's, as Lightning and DDP clip; ``None``: the whole model)
        to ``max_norm``, the norm taken over all their shards, each counted once, and return that norm; ``None``,
        clipping nothing, when ``model`` has no single root to clip over. Collective: same ``parameters`` on every
        rank."""
        ...


@runtime_checkable
class StateDicts(Protocol):
    """Full and local state dicts of a model the engine sharded (the checkpoint code; sharded state dicts go through
    ``torch.distributed.checkpoint.state_dict``, which every engine supports)."""

    def full_model_state(self, model: Module, device: torch.device) -> dict[str, Any]:
        """The unsharded model state, gathered inside this rank's shard group. Collective over that group."""
        ...

    def full_optimizer_state(
        self, model: Module, optimizer: Optimizer, device: torch.device, group: ProcessGroup | None
    ) -> dict[str, Any]:
        """The unsharded optimizer state keyed by parameter index in the optimizer's order (torch's standard
        layout), gathered over ``group``; meaningful on that group's first rank. Collective over ``group``."""
        ...

    def optimizer_state_context(self, model: Module, optimizer: Optimizer) -> AbstractContextManager[None]:
        """The context in which torch's state-dict functions read or load ``optimizer``'s state of ``model`` (whatever
        part of the model it steps)."""
        ...

    def optimizer_state_by_name(self, model: Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """A full optimizer state keyed by parameter index, re-keyed by parameter name for ``set_optimizer_state_dict``."""
        ...

    def local_model_state(self, model: Module) -> dict[str, Any] | None:
        """The model's sharded state as ``get_model_state_dict`` holds it, described from this rank's shards without
        any collective (pieces that are views of the live tensors); ``None`` where torch's state dict is as cheap, or
        the layout is not one the engine can describe. See :mod:`lightning_smp.checkpoint.local`."""
        ...

    def local_optimizer_state(self, model: Module, optimizer: Optimizer) -> dict[str, Any] | None:
        """The optimizer's sharded state as ``get_optimizer_state_dict`` holds it, described like
        :meth:`local_model_state`; ``None`` where that is not needed or not possible."""
        ...


@runtime_checkable
class PlainAPI(Protocol):
    """:func:`lightning_smp.init`'s plain-PyTorch mode: the user's own calls of the engine's API."""

    def patch_plain_calls(self, calls: PlainCalls) -> Callable[[], None]:
        """Make the user's own calls of this engine's API take the configured degree through ``calls``; return a
        function that undoes it."""
        ...


@runtime_checkable
class Engine(Wrapping, Training, StateDicts, PlainAPI, Protocol):
    """One implementation of data parallelism, as the rest of the package needs it: its identity, its
    :class:`Capabilities`, its layout rules for the planner, and four roles, each caller typed with the one it uses
    (:class:`Wrapping`, :class:`Training`, :class:`StateDicts`, :class:`PlainAPI`).

    Implementations: :class:`~lightning_smp.engines.fsdp1.engine.FSDP1Engine` (``FullyShardedDataParallel``),
    :class:`~lightning_smp.engines.fsdp2.engine.FSDP2Engine` (``fully_shard``) and
    :class:`~lightning_smp.engines.ddp.engine.DDPEngine` (``DistributedDataParallel``, for layouts with nothing
    sharded); each also takes the optional :class:`Accounting` role.
    """

    #: a short name for logs and records (``"fsdp1"``)
    name: str
    #: the ``fsdp_version`` that selects it (0: chosen by the layout, never by ``fsdp_version``)
    version: int
    #: how it differs from the others
    capabilities: Capabilities
    #: its layout rules over parameter shapes, for the planner (:mod:`~lightning_smp.engines.prediction`)
    prediction: Prediction


@runtime_checkable
class Accounting(Protocol):
    """The optional role of an :class:`Engine`: reading back what a rank of a model it sharded holds and sends, for
    the memory report and its tests. An engine without it trains as well; the report then shows "n/a" for what only
    it could say (:mod:`lightning_smp.accounting.memory`)."""

    def gradient_bytes(self, model: Module) -> int:
        """Bytes of gradient memory this rank holds now: reduced gradients, padding included, and any unsharded or
        partially reduced gradient buffers of gradient accumulation; each storage counted once."""
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

    def step_textbook(self, model: Module, backward_passes: int, accumulation: GradientAccumulation,
                      root_gathered: bool = False) -> CommFigure | None:
        """The textbook communication of one optimizer step of ``model`` with ``backward_passes`` micro-batches
        accumulated as ``accumulation`` says (see :func:`~lightning_smp.engines.textbook.fsdp_step_textbook` for
        ``root_gathered``)."""
        ...


class PlainCalls(Protocol):
    """What :func:`lightning_smp.init` does to the user's own wrapping calls; each engine's
    :meth:`PlainAPI.patch_plain_calls` calls it from the hook its API offers."""

    def rewrite(self, engine: Engine, arguments: dict[str, Any]) -> Callable[[Module], None] | None:
        """Apply the configured degree to one wrapper constructor's ``arguments`` in place; return a hook to run on
        the wrapped module, or ``None``."""
        ...

    def default_mesh(self, engine: Engine) -> DeviceMesh | None:
        """The mesh a sharding call that passes none gets (``None``: the engine's own default)."""
        ...


def replace_attribute(owner: Any, name: str, replacement: Any, what: str) -> Callable[[], None]:
    """Set ``owner.name`` to ``replacement`` and return a function that puts the original back, unless something
    else replaced it again in the meantime (that later patch is then left in place, with a warning naming
    ``what``). The engines' patches of the plain-PyTorch API for :func:`lightning_smp.init` use it."""
    import warnings

    original = getattr(owner, name)
    setattr(owner, name, replacement)

    def restore() -> None:
        if getattr(owner, name) is replacement:
            setattr(owner, name, original)
        else:
            warnings.warn(f"lightning_smp.shutdown(): {what} was patched again after lightning_smp.init(); that later"
                          " patch is left in place.", UserWarning, stacklevel=3)

    return restore


__all__ = [
    "Accounting",
    "Capabilities",
    "Engine",
    "PlainAPI",
    "PlainCalls",
    "ShardingFacts",
    "ShardingPlan",
    "StateDicts",
    "StorageUnit",
    "Training",
    "Wrapping",
    "replace_attribute",
]
