"""The FSDP2 engine: ``torch.distributed.fsdp.fully_shard``, per-parameter ``DTensor`` shards.

Parameters become ``DTensor``s placed ``(Replicate(), Shard(0))`` on the 2-D ``(replicate, shard)`` mesh (or
``(Shard(0),)`` on the shard axis alone when one group spans the world); degree 1 is the mesh ``(world, 1)``, on
which FSDP2 issues no shard-group collective and all-reduces every gradient across the world, as DDP does.

This module is the :class:`~lightning_smp.engines.Engine` protocol for ``fully_shard``; the work behind it lives
beside it: the arguments it takes (:mod:`~lightning_smp.engines.fsdp2.options`), wrapping
(:mod:`~lightning_smp.engines.fsdp2.wrap`), gradient accumulation (:mod:`~lightning_smp.engines.fsdp2.accumulation`),
full state dicts (:mod:`~lightning_smp.engines.fsdp2.state_dicts`), and every read of FSDP2's parameter groups
(:mod:`~lightning_smp.engines.fsdp2.groups`, with :mod:`~lightning_smp.engines.fsdp2.unused`). This module itself
replaces ``fully_shard``'s default-mesh lookup (``_patch_default_mesh``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.accumulation import accumulation_mode
from lightning_smp.degree import Layout
from lightning_smp.engines import unused
from lightning_smp.engines.base import (
    Capabilities,
    PlainCalls,
    ShardingFacts,
    ShardingPlan,
    StorageUnit,
    replace_attribute,
)
from lightning_smp.engines.fsdp2 import accumulation as fsdp2_accumulation
from lightning_smp.engines.fsdp2 import groups as fsdp2_groups
from lightning_smp.engines.fsdp2 import options as fsdp2_options
from lightning_smp.engines.fsdp2 import state_dicts as fsdp2_state_dicts
from lightning_smp.engines.fsdp2.groups import fsdp_module_cls, fsdp_modules
from lightning_smp.engines.fsdp2.prediction import FSDP2Prediction
from lightning_smp.engines.fsdp2.wrap import materialize_where_shards_cannot_draw, shard_root, wrap_targets
from lightning_smp.engines.prediction import Prediction
from lightning_smp.engines.scalars import scalar_parameters
from lightning_smp.engines.scalars import track as track_scalars
from lightning_smp.names import (
    DEFER_ALL_REDUCE,
    EVERY_MICRO_BATCH,
    FULL_SHARD,
    NO_SYNC,
    SHARD_AXIS,
    SHARD_GRAD_OP,
    GradientAccumulation,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_smp.engines.textbook import CommFigure, FSDPUnitSpec

# The sharding strategy each root this engine sharded runs: FSDP2 keeps no such name, and a root-only model under
# ZeRO-2 looks like HYBRID_SHARD (the root never reshards after forward in either). Weak: never keeps a model alive.
_SHARDED_AS: weakref.WeakKeyDictionary[Module, str] = weakref.WeakKeyDictionary()


class FSDP2Engine:
    """:class:`~lightning_smp.engines.Engine` for ``fully_shard`` (FSDP2)."""

    name = "fsdp2"
    version = 2
    capabilities = Capabilities(
        # deferred first: sharded gradients and one crossing of the replicas per optimizer step, whatever k is
        accumulations=(DEFER_ALL_REDUCE, EVERY_MICRO_BATCH, NO_SYNC),
        # torchtitan's order: checkpoint wrappers inside, then fully_shard (hooks see the wrapped layers)
        checkpoint_activations_first=True,
        steps_inside_a_step=True,  # with every parameter in a unit below the root (see wrap.shard_root)
        replaces_parameters=True,  # fully_shard swaps each parameter for a DTensor shard
        syncs_buffers_itself=False,  # FSDP never syncs buffers
        fault_tolerance=True,  # DTensor shards per parameter: each rank's part of each gradient crosses the groups
        replica_sync=True,  # the same DTensor layout in every group: rank r's local shards pair across groups
    )
    prediction: Prediction = FSDP2Prediction()

    # ------------------------------------------------------------------ options

    def check_options(self, options: Mapping[str, Any], mixed_precision: Any, cpu_offload: Any) -> None:
        fsdp2_options.check_options(options, mixed_precision, cpu_offload)

    def mesh_for(self, mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
        # NO_SHARD keeps the 2-D mesh: shard groups of one rank cost nothing in FSDP2 (no collective is issued on
        # them) and the replicate axis all-reduces over the world, as DDP does
        if layout.sharding_strategy in (FULL_SHARD, SHARD_GRAD_OP):
            return mesh[SHARD_AXIS]
        return mesh

    # ------------------------------------------------------------------ wrapping

    def shard_kwargs(self, plan: ShardingPlan) -> dict[str, Any]:
        """What every ``fully_shard`` call for ``plan`` is given (the root's ``reshard_after_forward`` aside)."""
        return fsdp2_options.shard_kwargs(plan)

    def wrap(self, module: Module, plan: ShardingPlan) -> Module:
        from torch.distributed.fsdp import fully_shard

        materialize_where_shards_cannot_draw(module, plan)
        kwargs = self.shard_kwargs(plan)
        scalars = scalar_parameters(module)
        if scalars:  # fully_shard cannot shard a 0-dim parameter: each rank keeps it whole (engines/scalars.py)
            with torch.no_grad():
                for param in scalars:
                    param.data = param.data.to(plan.device)  # fully_shard moves only what it manages
            kwargs["ignored_params"] = {*(kwargs.get("ignored_params") or ()), *scalars}
        for target in wrap_targets(module, plan.options.get("auto_wrap_policy")):
            fully_shard(target, **kwargs)
        _SHARDED_AS[module] = plan.layout.sharding_strategy
        root = shard_root(module, kwargs, plan)
        track_scalars(root, scalars, plan.device)
        return root

    def complete(self, module: Module, plan: ShardingPlan) -> Module:
        """Shard the root too when the user sharded only submodules: its remaining parameters join it (else they
        would never be reduced across ranks), and the model gets one root to accumulate, clip and checkpoint over.
        Replicas then start from the first replica's shards (FSDP2 has no ``sync_module_states``)."""
        from lightning_smp.replicas import broadcast_across_replicas

        if not isinstance(module, fsdp_module_cls()):
            _SHARDED_AS[module] = plan.layout.sharding_strategy
            module = shard_root(module, self.shard_kwargs(plan), plan)
        if plan.mesh is not None and plan.mesh.ndim == 2:
            broadcast_across_replicas(module, plan.mesh, plan.device)
        return module

    @contextmanager
    def wrap_context(self, plan: ShardingPlan) -> Generator[None, None, None]:
        """Inside ``configure_model``: ``fully_shard(module)`` without a mesh shards over ``plan``'s mesh."""
        if plan.mesh is None:
            yield
            return
        restore = _patch_default_mesh(lambda: plan.mesh)
        try:
            yield
        finally:
            restore()

    def prepare_backward(self, model: Module, output: Any) -> None:
        return None  # its hooks are registered at wrapping and need nothing per backward

    def units(self, module: Module) -> list[tuple[str, Module]]:
        return [(fsdp2_state_dicts.clean_fqn(name), m) for name, m in module.named_modules()
                if isinstance(m, fsdp_module_cls())]

    def has_wrapped(self, module: Module) -> bool:
        return bool(fsdp_modules(module))

    def call_through_root(self, root: Module, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` (a LightningModule step) as the forward of the sharded ``root``: its hooks gather the
        root's own parameters and prepare their gradient reduction, whatever the step calls. Calls of the root
        inside the step (``self(x)``) then run its forward without those hooks again (they would gather twice)."""
        if not isinstance(root, fsdp_module_cls()):
            return method(*args, **kwargs)
        hooks = fsdp2_groups.root_forward_hooks(root)
        original_forward = root.forward

        # Under autocast (the Trainer's "*-mixed" precision) the step's arguments, the batch, do not pass through the
        # root's hooks: FSDP2 casts a forward's floating-point inputs to param_dtype, and the targets, which DDP keeps
        # in fp32, would be rounded to bf16 with them (autocast casts what each operation computes with). Without
        # autocast (a MixedPrecisionPolicy of the user's), the root's own parameters need inputs in their dtype.
        autocast = torch.is_autocast_enabled(next(iter(root.parameters()), torch.empty(0)).device.type)

        def step_as_forward(*step_args: Any, **step_kwargs: Any) -> Any:
            root.forward = original_forward  # restored before the step calls it
            paused = [(table, key, table.pop(key)) for table, key in hooks if key in table]
            try:
                return method(*args, **kwargs) if autocast else method(*step_args, **step_kwargs)
            finally:
                for table, key, hook in paused:
                    table[key] = hook

        root.forward = step_as_forward
        try:
            return root() if autocast else root(*args, **kwargs)
        finally:
            root.forward = original_forward

    def parameters_sharded(self, module: Module) -> bool:
        return any(self.is_shard_tensor(p) for p in module.parameters())

    def is_shard_tensor(self, tensor: torch.Tensor) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(tensor, DTensor)

    # ------------------------------------------------------------------ state dicts

    def full_model_state(self, model: Module, device: torch.device) -> dict[str, Any]:
        return fsdp2_state_dicts.full_model_state(model, device)

    def full_optimizer_state(
        self, model: Module, optimizer: Optimizer, device: torch.device, group: ProcessGroup | None
    ) -> dict[str, Any]:
        # torch's own layout (keyed by index in the optimizer's order); every DTensor state is gathered over its
        # shard axis, which is ``group``'s ranks
        return fsdp2_state_dicts.full_optimizer_state(optimizer, device)

    def optimizer_state_context(self, model: Module, optimizer: Optimizer) -> AbstractContextManager[None]:
        return nullcontext()  # one state per parameter: any subset of the model's parameters reads and loads

    def optimizer_state_by_name(self, model: Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        return fsdp2_state_dicts.optimizer_state_by_name(model, optimizer, state)

    def local_model_state(self, model: Module) -> dict[str, Any] | None:
        return None  # torch's sharded state dict is this rank's DTensor shards already: nothing to gather

    def local_optimizer_state(self, model: Module, optimizer: Optimizer) -> dict[str, Any] | None:
        return None

    # ------------------------------------------------------------------ clipping

    def clip_grad_norm(self, model: Module, max_norm: float,
                       parameters: Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
        """The 2-norm over the gradients of ``parameters`` (``None``: every one of ``model``): each DTensor's local
        norm, reduced over the shard axis only (the replicate axis holds identical copies, counted once), as a plain
        tensor; then scaled like ``torch.nn.utils.clip_grad_norm_``. ``None`` when ``model`` has no FSDP2 root."""
        from torch.distributed.tensor import DTensor

        if not isinstance(model, fsdp_module_cls()):
            return None
        source: Iterable[torch.Tensor] = model.parameters() if parameters is None else parameters
        params = [p for p in source if p.grad is not None]
        total = torch.nn.utils.get_total_norm([cast(torch.Tensor, p.grad) for p in params], norm_type=2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    # ------------------------------------------------------------------ gradient accumulation

    def accumulation_context(self, model: Module, accumulation: GradientAccumulation) -> AbstractContextManager[None]:
        mode = accumulation_mode(accumulation)
        if mode.all_reduce_each:
            return nullcontext()
        return self._reducing_off(model, all_reduce_only=mode.reduce_scatter_each)

    def _reducing_off(self, model: Module, all_reduce_only: bool) -> AbstractContextManager[None]:
        return fsdp2_accumulation.reducing_off(model, all_reduce_only)

    def settle_gradients(self, model: Module, *, defer_unused: bool = False) -> unused.Unreduced | None:
        return fsdp2_accumulation.settle_gradients(model, defer_unused)

    def discard_unreduced_gradients(self, model: Module) -> None:
        fsdp2_accumulation.discard_unreduced_gradients(model)

    def release_gathered(self, model: Module) -> None:
        # the root keeps its parameters gathered after a forward (reshard_after_forward=False: they are needed again
        # in the backward), and after a forward without backward they stay so until the next backward ends
        for module in fsdp_modules(model):
            module.reshard()

    def gradient_bytes(self, model: Module) -> int:
        return fsdp2_groups.gradient_bytes(model)

    # ------------------------------------------------------------------ accounting

    def storage(self, model: Module) -> list[StorageUnit]:
        return fsdp2_groups.storage(model)

    def full_numels(self, model: Module) -> dict[int, int]:
        return {id(unit.tensor): unit.full_numel for unit in self.storage(model)}

    def sharding(self, model: Module) -> ShardingFacts | None:
        return fsdp2_groups.sharding(model, _SHARDED_AS.get(model))

    def comm_units(self, model: Module) -> list[FSDPUnitSpec]:
        """One :class:`~lightning_smp.engines.textbook.FSDPUnitSpec` per module that owns parameters: one all-gather
        and one reduce-scatter each, of all its parameters' padded shards together."""
        return fsdp2_groups.comm_units(model)

    def step_textbook(self, model: Module, backward_passes: int, accumulation: GradientAccumulation,
                      root_gathered: bool = False) -> CommFigure | None:
        from lightning_smp.engines.textbook import fsdp_step_textbook

        facts = self.sharding(model)
        if facts is None:
            return None
        scattered, synced = accumulation_mode(accumulation).passes(backward_passes)
        presences = fsdp2_groups.presences(model)  # the unused-parameter bitmap
        return fsdp_step_textbook(self.comm_units(model), facts.sharding_strategy, facts.shard_degree, facts.replicas,
                                  backward_passes, synced_passes=synced, reduce_scatter_passes=scattered,
                                  root_gathered=root_gathered,
                                  unused_bitmap_bytes=unused.bitmap_bytes(presences))

    # ------------------------------------------------------------------ plain PyTorch

    def patch_plain_calls(self, calls: PlainCalls) -> Callable[[], None]:
        """Make ``fully_shard(module)`` calls that pass no ``mesh`` shard over ``calls.default_mesh(self)`` (when it
        is not ``None``); return a function that undoes it. A ``mesh=`` the caller passes always wins."""
        return _patch_default_mesh(lambda: calls.default_mesh(self))


def _patch_default_mesh(mesh: Callable[[], DeviceMesh | None]) -> Callable[[], None]:
    """Make ``fully_shard`` calls without ``mesh=`` shard over ``mesh()`` when it is not ``None``; return the undo.

    ``fully_shard`` looks its default mesh up through a module-level function at every call, so replacing that
    function reaches every caller, however it imported ``fully_shard``.
    """
    from torch.distributed.fsdp._fully_shard import _fully_shard

    original = _fully_shard._init_default_mesh

    def _init_default_mesh(*args: Any, **kwargs: Any) -> DeviceMesh:
        configured = mesh()
        return configured if configured is not None else original(*args, **kwargs)

    return replace_attribute(_fully_shard, "_init_default_mesh", _init_default_mesh, "fully_shard's default mesh")


__all__ = ["FSDP2Engine"]
