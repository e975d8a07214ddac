"""The DDP engine: no sharding, one whole copy of the model per rank, ``DistributedDataParallel``'s bucketed all-reduce.

Degree 1 (and degree 0 where it resolves to no sharding) needs nothing of FSDP: FSDP's ``NO_SHARD`` all-reduces
each unit's gradient on its own, with no bucketing (PyTorch's own measurement, pytorch#76736, found it 6-17% slower
than DDP on GPUs; 1.56x Lightning's DDP in ``make bench`` on CPU). This engine runs the same layout on
``DistributedDataParallel`` and keeps every guarantee of the others (see ``docs/engines.md``):

- replicas start from global rank 0's weights (the core broadcasts them, or syncs them after a meta-device model is
  materialised), so DDP's own start-up broadcast is skipped (``init_sync=False``);
- ``find_unused_parameters=True``: a parameter that a rank did not use contributes zeros, one that no rank used keeps
  ``.grad`` ``None`` (DDP's own rule, the one the FSDP engines reproduce with their bitmap); DDP all-reduces its
  used-parameter bitmap (4 bytes a parameter) with every synced backward, counted in the textbook. The strategy's
  ``find_unused_parameters=False`` (DDP's own default) declares a model whose every parameter takes part in every
  step, and saves that traversal and all-reduce; a parameter left out then fails as under DDP (an error at the next
  step, or, left out on some ranks only, a collective that waits until the process group's timeout);
- gradients are views into DDP's buckets (``gradient_as_bucket_view=True``): one copy of the gradients, no copy
  after each all-reduce;
- buffers follow the strategy's ``broadcast_buffers`` (DDP's own switch, default ``True``): DDP copies rank 0's
  buffers before a forward that follows a synced training forward, the rule :mod:`lightning_smp.buffers` runs for
  the FSDP engines.

It is chosen by :func:`lightning_smp.engines.engine_for_layout`, never by ``fsdp_version``; a run that asks for what
only FSDP does (CPU offload, a mixed-precision config of its own, FSDP arguments with a meaning beyond sharding: see
:data:`SHARDING_ONLY_OPTIONS`) keeps FSDP's ``NO_SHARD``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.nn import Module, Parameter
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_smp.accumulation import accumulation_mode
from lightning_smp.degree import Layout
from lightning_smp.engines.base import Capabilities, PlainCalls, ShardingFacts, ShardingPlan, StorageUnit
from lightning_smp.engines.ddp.prediction import BITMAP_BYTES, DDPPrediction
from lightning_smp.engines.prediction import Prediction
from lightning_smp.errors import GradientSyncError
from lightning_smp.names import (
    DEFER_ALL_REDUCE,
    EVERY_MICRO_BATCH,
    NO_SHARD,
    NO_SYNC,
    REPLICATE_AXIS,
    GradientAccumulation,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_smp.engines.textbook import CommFigure

#: FSDP arguments that only say how to shard or to schedule sharded communication: with nothing sharded they mean
#: nothing, and the DDP engine runs without them. Any other FSDP argument (``ignored_modules``, ``process_group``,
#: ``use_orig_params=False``, ``param_init_fn``, ...) changes what is trained or how, and keeps FSDP's ``NO_SHARD``.
SHARDING_ONLY_OPTIONS = frozenset({
    "auto_wrap_policy", "limit_all_gathers", "forward_prefetch", "backward_prefetch", "sync_module_states",
    "use_orig_params", "reshard_after_forward", "shard_placement_fn",
})

#: DDP's own arguments that the strategy takes (the FSDP engines, which keep .grad None for unused parameters
#: without being told, set them aside): ``find_unused_parameters=False`` declares that every parameter takes part in
#: every step on every rank, and saves the engine a traversal of the autograd graph and one all-reduce per step
DDP_ONLY_OPTIONS = frozenset({"find_unused_parameters"})

#: DDP's switch for syncing buffers before a forward: torch 2.13 names it ``forward_sync_buffers`` (its
#: ``broadcast_buffers`` warns), older versions ``broadcast_buffers``
_BUFFER_SYNC = (
    "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else "broadcast_buffers"
)



def takes(options: Mapping[str, Any], mixed_precision: Any, cpu_offload: Any) -> bool:
    """Whether a no-sharding layout with these arguments runs on the DDP engine (else on FSDP's ``NO_SHARD``)."""
    if mixed_precision is not None or cpu_offload not in (None, False):
        return False
    if options.get("use_orig_params") is False:  # optimizers built over flat parameters
        return False
    return all(key in SHARDING_ONLY_OPTIONS or key in DDP_ONLY_OPTIONS for key in options)


def _inner(model: Module) -> Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _trainable(model: Module) -> list[Parameter]:
    return [p for p in _inner(model).parameters() if p.requires_grad]


class DDPEngine:
    """:class:`~lightning_smp.engines.Engine` for ``DistributedDataParallel``: layouts with nothing sharded."""

    name = "ddp"
    version = 0  # chosen by the layout (no sharding), never by fsdp_version
    capabilities = Capabilities(
        # every mode an FSDP engine takes, so that switching to this engine never refuses what was accepted: without
        # shards, deferring the all-reduce to the last micro-batch *is* DDP's no_sync
        accumulations=(NO_SYNC, EVERY_MICRO_BATCH, DEFER_ALL_REDUCE),
        # after wrapping, as Lightning's FSDPStrategy orders it (the parameters stay the same objects, DDP's hooks
        # hold)
        checkpoint_activations_first=False,
        steps_inside_a_step=True,  # Lightning's manual optimization: see prepare_backward
        replaces_parameters=False,
        syncs_buffers_itself=True,  # DistributedDataParallel with broadcast_buffers
        fault_tolerance=True,  # (a group of one rank: its whole gradient crosses the groups)
        replica_sync=True,  # whole parameters: every rank averages all of them with its peers in the other groups
        own_options=DDP_ONLY_OPTIONS,
    )
    prediction: Prediction = DDPPrediction()

    def check_options(self, options: Mapping[str, Any], mixed_precision: Any, cpu_offload: Any) -> None:
        return None  # chosen only for arguments it takes (takes())

    def mesh_for(self, mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
        return mesh[REPLICATE_AXIS]  # the whole world: every rank is a replica

    # ------------------------------------------------------------------ wrapping

    def wrap(self, module: Module, plan: ShardingPlan) -> Module:
        from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers, _materialize_meta_tensors

        if _has_meta_device_parameters_or_buffers(module):
            # what FSDP does with a meta-device model: reset_parameters() on each module; the core then gives every
            # replica rank 0's values (broadcast_across_replicas)
            _materialize_meta_tensors(module, plan.device)
        module.to(plan.device)
        group = plan.mesh.get_group() if plan.mesh is not None else None
        device_ids = [plan.device.index] if plan.device.type != "cpu" and plan.device.index is not None else None
        return DistributedDataParallel(module, device_ids=device_ids, process_group=group, init_sync=False,
                                       find_unused_parameters=bool(plan.options.get("find_unused_parameters", True)),
                                       gradient_as_bucket_view=True,
                                       **cast(dict[str, Any], {_BUFFER_SYNC: plan.broadcast_buffers}))

    def complete(self, module: Module, plan: ShardingPlan) -> Module:
        return module  # a DistributedDataParallel the user built is used as it is

    def call_through_root(self, root: Module, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)  # DDP is a wrapper: Lightning redirects through its forward itself

    def patch_plain_calls(self, calls: PlainCalls) -> Callable[[], None]:
        """Nothing: a ``DistributedDataParallel`` of the user's own shards nothing, and already starts every replica
        from rank 0's weights."""
        return lambda: None

    def wrap_context(self, plan: ShardingPlan) -> AbstractContextManager[None]:
        return nullcontext()  # torch's wrap() outside enable_wrap returns the module: nothing to shard

    def prepare_backward(self, model: Module, output: Any) -> None:
        """Before a backward that did not follow the root's forward directly (Lightning's manual optimization: several
        backward passes in one step): DDP's reducer is told which outputs the backward starts from, as Lightning's
        ``DDPStrategy.pre_backward`` does."""
        if isinstance(model, DistributedDataParallel):
            from lightning.pytorch.overrides.distributed import prepare_for_backward

            prepare_for_backward(model, output)

    def units(self, module: Module) -> list[tuple[str, Module]]:
        return []  # nothing is sharded

    def has_wrapped(self, module: Module) -> bool:
        return isinstance(module, DistributedDataParallel)

    def parameters_sharded(self, module: Module) -> bool:
        return False

    def is_shard_tensor(self, tensor: torch.Tensor) -> bool:
        return False

    # ------------------------------------------------------------------ state dicts

    def full_model_state(self, model: Module, device: torch.device) -> dict[str, Any]:
        return {k: v.detach().cpu().clone() for k, v in _inner(model).state_dict().items()}

    def full_optimizer_state(
        self, model: Module, optimizer: Optimizer, device: torch.device, group: ProcessGroup | None
    ) -> dict[str, Any]:
        return optimizer.state_dict()  # every rank holds it whole, keyed by index already

    def optimizer_state_context(self, model: Module, optimizer: Optimizer) -> AbstractContextManager[None]:
        return nullcontext()

    def optimizer_state_by_name(self, model: Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        names = {id(p): name for name, p in _inner(model).named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        return {
            "state": {order[index]: value for index, value in state.get("state", {}).items()},
            "param_groups": [{**group, "params": [order[index] for index in group["params"]]}
                             for group in state.get("param_groups", [])],
        }

    def local_model_state(self, model: Module) -> dict[str, Any] | None:
        return None  # torch's state dict is the live tensors already

    def local_optimizer_state(self, model: Module, optimizer: Optimizer) -> dict[str, Any] | None:
        return None

    # ------------------------------------------------------------------ clipping and accumulation

    def clip_grad_norm(self, model: Module, max_norm: float,
                       parameters: Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
        # the gradients are reduced and whole on every rank: the local norm is the global one, and torch's own
        # clip_grad_norm_ clips as Lightning's DDPStrategy does
        params = list(parameters) if parameters is not None else list(_inner(model).parameters())
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def accumulation_context(self, model: Module, accumulation: GradientAccumulation) -> AbstractContextManager[None]:
        # nothing is sharded: a mode that defers any reduction defers DDP's all-reduce
        if not accumulation_mode(accumulation).all_reduce_each and isinstance(model, DistributedDataParallel):
            return cast(AbstractContextManager[None], model.no_sync())
        return nullcontext()

    def settle_gradients(self, model: Module, *, defer_unused: bool = False) -> None:
        # (DDP's reducer leaves an unused parameter's .grad alone itself: no notes to give back)
        if isinstance(model, DistributedDataParallel) and not model.require_backward_grad_sync:
            raise GradientSyncError(
                "DistributedDataParallel.no_sync() is still active as the optimizer is about to step: the gradients"
                " were never all-reduced and the replicas would drift apart. Fix: leave no_sync() before the last"
                " backward of a step."
            )

    def discard_unreduced_gradients(self, model: Module) -> None:
        return None  # no_sync accumulates in .grad itself, which zero_grad clears

    def release_gathered(self, model: Module) -> None:
        return None  # every rank computes with the parameters themselves: nothing is gathered

    def gradient_bytes(self, model: Module) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in _inner(model).parameters() if p.grad is not None)

    # ------------------------------------------------------------------ accounting

    def storage(self, model: Module) -> list[StorageUnit]:
        return [StorageUnit(p, p.numel(), p.numel(), p.numel()) for p in _inner(model).parameters()]

    def full_numels(self, model: Module) -> dict[int, int]:
        return {id(p): p.numel() for p in _inner(model).parameters()}

    def sharding(self, model: Module) -> ShardingFacts | None:
        if not isinstance(model, DistributedDataParallel):
            return None
        group = model.process_group
        return ShardingFacts(NO_SHARD, 1, group.size(), {REPLICATE_AXIS: group})

    def step_textbook(self, model: Module, backward_passes: int, accumulation: GradientAccumulation,
                      root_gathered: bool = False) -> CommFigure | None:
        from lightning_smp.engines.textbook import ddp_bucket_count, ddp_step_textbook

        if not isinstance(model, DistributedDataParallel):
            return None
        trainable = _trainable(model)
        grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
        bitmap = len(trainable) * BITMAP_BYTES if model.find_unused_parameters else 0  # a DDP built elsewhere: none
        return ddp_step_textbook(grad_bytes, model.process_group.size(), ddp_bucket_count(model) or 1,
                                 synced_passes=accumulation_mode(accumulation).passes(backward_passes)[1],
                                 used_bitmap_bytes=bitmap)


__all__ = ["BITMAP_BYTES", "DDP_ONLY_OPTIONS", "SHARDING_ONLY_OPTIONS", "DDPEngine", "DDPPrediction", "takes"]
