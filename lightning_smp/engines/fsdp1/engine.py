"""The FSDP1 engine: ``torch.distributed.fsdp.FullyShardedDataParallel`` with flat parameters.

FSDP1 has no public API for what a rank stores (flat-parameter shards, their padding, the process groups of a
hybrid unit), so this module reads FSDP1's internals (``_handle``, ``flat_param._numels``, ``_inter_node_pg``, ...);
each read is checked against the real tensors by the memory-accounting tests. The only other modules that read
them do one job each: :mod:`~lightning_smp.engines.fsdp1.state` (the shards of a background save),
:mod:`~lightning_smp.engines.fsdp1.unused` (which parameters a backward used) and
:mod:`~lightning_smp.engines.fsdp1.left_out` (units the last backward of a ``no_sync`` window did not reach).

Above 300 lines for a reason: one class implementing every method of the :class:`~lightning_smp.engines.Engine`
protocol for FSDP1 (the class alone is over 300 lines); splitting it would spread FSDP1's internals further.
"""

from __future__ import annotations

import collections
import functools
import inspect
from collections.abc import Callable, Generator, Mapping, Sequence
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
from lightning_smp.engines.fsdp1 import clip, left_out
from lightning_smp.engines.fsdp1 import unused as fsdp1_unused
from lightning_smp.engines.fsdp1.prediction import FSDP1Prediction
from lightning_smp.engines.prediction import Prediction
from lightning_smp.engines.scalars import scalar_parameters
from lightning_smp.engines.scalars import track as track_scalars
from lightning_smp.errors import GradientSyncError, UnsupportedOptionError
from lightning_smp.names import EVERY_MICRO_BATCH, NO_SHARD, NO_SYNC, REPLICATE_AXIS, SHARD_AXIS, GradientAccumulation

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_smp.engines.textbook import CommFigure, FSDPUnitSpec


def _fsdp() -> Any:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _handles(model: Module, units: Sequence[Any] | None = None) -> list[Any]:
    """The flat-parameter handles of ``model``'s FSDP units (``units``: those units, already found)."""
    return [unit._handle for unit in (_fsdp().fsdp_modules(model) if units is None else units)
            if unit._handle is not None]


def _owner(model: Module, handle: Any) -> Any:
    return next((u for u in _fsdp().fsdp_modules(model) if u._handle is handle), None)


@contextmanager
def full_state_dict_context(model: Module, device: torch.device, rank0_only: bool = True) -> Generator[None, None, None]:
    """FSDP1's full state-dict mode, offloading to CPU only from accelerators.

    On a CPU device FSDP's "offload" aliases the storage it frees right afterwards (a segfault), so it is off there.
    """
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp.api import FullOptimStateDictConfig

    offload = device.type != "cpu"
    with _fsdp().state_dict_type(
        module=model,
        state_dict_type=StateDictType.FULL_STATE_DICT,
        state_dict_config=FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
    ):
        yield


def _track(root: Module) -> None:
    """What the engine follows on every root it shards or completes."""
    left_out.track(root)  # accumulation: units the last micro-batch did not reach are reduced too
    fsdp1_unused.track(root)  # a parameter no rank used keeps .grad None (engines/unused.py)
    clip.install(_live_shard_groups)  # torch's clip_grad_norm_ over shards: DDP's norm


def _materialize_in_module_order(module: Module, plan: ShardingPlan) -> None:
    """A meta-device model in full, before wrapping: FSDP1 materializes each unit when it wraps it, innermost units
    first and a unit's own modules after its children's, so the random numbers each layer draws follow wrapping
    order, not the order the model was built in: a seeded model nested deeper than one level of units started from
    other weights than the same model built unsharded (DDP's). In full, each module's ``reset_parameters`` draws in
    ``module.modules()`` order, what building the model draws; rank 0's weights then go to every rank, and FSDP1
    shards real tensors. Costs the full model on each rank for a moment, as the FSDP2 engine's materialization on
    devices without DTensor random numbers; a ``param_init_fn`` of the user's is left to FSDP1."""
    from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers, _materialize_meta_tensors

    from lightning_smp.replicas import broadcast_module_state

    if "param_init_fn" in plan.options or not _has_meta_device_parameters_or_buffers(module):
        return
    _materialize_meta_tensors(module, plan.device)
    broadcast_module_state(module, plan.device, src=0)


def _ignoring(kwargs: dict[str, Any], scalars: list[torch.nn.Parameter], device: torch.device) -> dict[str, Any]:
    """``kwargs`` with ``scalars`` added to what FSDP ignores (the user's ``ignored_modules`` joined in
    ``ignored_states``, which takes modules and parameters alike; FSDP1 refuses both arguments together)."""
    kwargs = dict(kwargs)
    ignored = [*(kwargs.pop("ignored_modules", None) or ()), *(kwargs.pop("ignored_states", None) or ())]
    with torch.no_grad():
        for param in scalars:
            param.data = param.data.to(device)  # FSDP moves only what it manages
    kwargs["ignored_states"] = [*ignored, *scalars]
    return kwargs


def _live_shard_groups() -> dict[int, ProcessGroup]:
    groups: dict[int, ProcessGroup] = {}
    for root in fsdp1_unused.roots():
        groups.update(clip.shard_ids(_handles(root)))
    return groups


#: ``fully_shard`` (FSDP2) arguments and configs, refused under FSDP1 with the way to get them
_FSDP2_ONLY = {
    "mp_policy": "mixed_precision=MixedPrecision(...) (or fsdp_version=2)",
    "offload_policy": "cpu_offload=True (or fsdp_version=2)",
    "reshard_after_forward": "sharding_strategy (HYBRID_SHARD reshards after forward, _HYBRID_SHARD_ZERO2 does not)",
    "shard_placement_fn": "fsdp_version=2",
    "ignored_params": "ignored_states (or fsdp_version=2)",
}


class FSDP1Engine:
    """:class:`~lightning_smp.engines.Engine` for ``FullyShardedDataParallel`` (FSDP1)."""

    name = "fsdp1"
    version = 1
    capabilities = Capabilities(
        # no_sync first: Lightning's behaviour, kept as the default for drop-in compatibility with FSDPStrategy
        accumulations=(NO_SYNC, EVERY_MICRO_BATCH),
        checkpoint_activations_first=False,  # Lightning's FSDPStrategy wraps first, then checkpoints
        # a Lightning step runs inside the root's forward (Lightning's redirection), where FSDP1 cannot run a backward
        steps_inside_a_step=False,
        # FullyShardedDataParallel's flat parameters are new objects, but Lightning's setup_module_and_optimizers
        # rebuilds the optimizer's references to them (use_orig_params=True keeps the original ones)
        replaces_parameters=False,
        syncs_buffers_itself=False,  # FSDP never syncs buffers
    )
    prediction: Prediction = FSDP1Prediction()

    def check_options(self, options: Mapping[str, Any], mixed_precision: Any, cpu_offload: Any) -> None:
        for key, fix in _FSDP2_ONLY.items():
            if key in options:
                raise UnsupportedOptionError(
                    f"{key}={options[key]!r} is an FSDP2 (fully_shard) argument; FSDP1 does not take it. Fix: {fix}."
                )
        for argument, value in (("mixed_precision", mixed_precision), ("cpu_offload", cpu_offload)):
            if type(value).__name__ in ("MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy"):
                raise UnsupportedOptionError(
                    f"{argument}={type(value).__name__}(...) is an FSDP2 config. Fix: pass fsdp_version=2, or"
                    f" {'MixedPrecision' if argument == 'mixed_precision' else 'CPUOffload'}(...) for FSDP1."
                )

    def mesh_for(self, mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
        from lightning_smp.mesh import fsdp_mesh

        return fsdp_mesh(mesh, layout)

    # ------------------------------------------------------------------ wrapping

    def wrapper_kwargs(self, plan: ShardingPlan) -> dict[str, Any]:
        """What every ``FullyShardedDataParallel`` built for ``plan`` is given."""
        from torch.distributed.fsdp import ShardingStrategy

        kwargs: dict[str, Any] = {
            "cpu_offload": plan.cpu_offload,
            "mixed_precision": plan.mixed_precision,
            "sharding_strategy": ShardingStrategy[plan.layout.sharding_strategy],
            # FSDP needs a device, not an index: ``torch.device("cpu").index`` is None
            "device_id": plan.device,
            **plan.options,
        }
        if plan.mesh is not None:
            kwargs["device_mesh"] = plan.mesh
        return kwargs

    def wrap(self, module: Module, plan: ShardingPlan) -> Module:
        _materialize_in_module_order(module, plan)
        kwargs = self.wrapper_kwargs(plan)
        scalars = scalar_parameters(module)
        if scalars:  # FSDP1 cannot flatten a 0-dim parameter: each rank keeps it whole (engines/scalars.py)
            kwargs = _ignoring(kwargs, scalars, plan.device)
        root = _fsdp()(module=module, **kwargs)
        _track(root)
        track_scalars(root, scalars, plan.device)
        return root

    def call_through_root(self, root: Module, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)  # the FSDP1 root is a wrapper: Lightning redirects through it itself

    def complete(self, module: Module, plan: ShardingPlan) -> Module:
        if isinstance(module, _fsdp()):
            _track(module)
        return module  # Lightning's FSDPStrategy: a model wrapped by the user is used as it is

    def wrap_context(self, plan: ShardingPlan) -> Any:
        from torch.distributed.fsdp.wrap import enable_wrap

        return enable_wrap(wrapper_cls=_fsdp(), **self.wrapper_kwargs(plan))

    def prepare_backward(self, model: Module, output: Any) -> None:
        return None  # its hooks are registered at wrapping and need nothing per backward

    def units(self, module: Module) -> list[tuple[str, Module]]:
        from torch.distributed.fsdp._common_utils import clean_tensor_name  # without FSDP's wrapper prefixes

        return [(clean_tensor_name(name), m) for name, m in module.named_modules() if isinstance(m, _fsdp())]

    def has_wrapped(self, module: Module) -> bool:
        return isinstance(module, _fsdp()) or any(isinstance(m, _fsdp()) for m in module.modules())

    def parameters_sharded(self, module: Module) -> bool:
        return any(self.is_shard_tensor(p) for p in module.parameters())

    def is_shard_tensor(self, tensor: torch.Tensor) -> bool:
        # a FlatParameter, or (use_orig_params) one of its original parameters' views
        from torch.distributed.fsdp._common_utils import _is_fsdp_flattened

        return bool(_is_fsdp_flattened(tensor))

    # ------------------------------------------------------------------ state dicts

    def full_model_state(self, model: Module, device: torch.device) -> dict[str, Any]:
        with full_state_dict_context(model, device):
            state = model.state_dict()
        return collections.OrderedDict((k, v.detach().cpu().clone()) for k, v in state.items())

    def full_optimizer_state(
        self, model: Module, optimizer: Optimizer, device: torch.device, group: ProcessGroup | None
    ) -> dict[str, Any]:
        from torch.distributed.fsdp import OptimStateKeyType

        with full_state_dict_context(model, device), self.optimizer_state_context(model, optimizer):
            state = _fsdp().optim_state_dict(model, optimizer, group=group)
        if not state:
            return {}  # not the gathering rank
        # rekey by the optimizer's own parameter order (FSDP's default is model.parameters() order)
        return _fsdp().rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, model, optim=optimizer)

    @contextmanager
    def optimizer_state_context(self, model: Module, optimizer: Optimizer) -> Generator[None, None, None]:
        """While an optimizer's state is read or loaded: the trainable parameters of a flat parameter that
        ``optimizer`` does not hold read as frozen. torch's FSDP1 optimizer state dicts refuse an optimizer that holds
        some of a flat parameter's trainable parameters but not all ("... is not in the optimizer state": an
        optimizer over the head of a model wrapped as one unit, or two optimizers sharing a unit), and handle frozen
        parameters in a flat parameter; to this optimizer the parameters it does not step are just that."""
        chosen = {id(p) for group in optimizer.param_groups for p in group["params"]}
        frozen: list[torch.Tensor] = []
        for handle in _handles(model):
            params = [p for p in handle.flat_param._params or () if p.requires_grad]
            if any(id(p) in chosen for p in params):
                frozen.extend(p for p in params if id(p) not in chosen)
        for param in frozen:
            param.requires_grad_(False)
        try:
            yield
        finally:
            for param in frozen:
                param.requires_grad_(True)

    def optimizer_state_by_name(self, model: Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.fsdp import OptimStateKeyType

        return _fsdp().rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, model, optim=optimizer)

    # ------------------------------------------------------------------ clipping

    def local_model_state(self, model: Module) -> dict[str, Any] | None:
        # torch's sharded state dict gathers every flat parameter to cut it per parameter; this one gathers nothing
        from lightning_smp.engines.fsdp1.state import local_model_state

        return local_model_state(model) if isinstance(model, _fsdp()) else None

    def local_optimizer_state(self, model: Module, optimizer: Optimizer) -> dict[str, Any] | None:
        from lightning_smp.engines.fsdp1.state import local_optimizer_state

        return local_optimizer_state(model, optimizer) if isinstance(model, _fsdp()) else None

    def clip_grad_norm(self, model: Module, max_norm: float,
                       parameters: Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
        """FSDP1's own ``clip_grad_norm_`` on the root unit when ``parameters`` cover every trainable parameter: it is
        hybrid-aware, the norm taken once over all shards (counted once across replicas), exactly as DDP's over the
        full gradients. Over a subset (an optimizer of part of the model), the same norm of that subset: each
        rank's shards of it summed over the shard group (FSDP's process group; nothing to sum under NO_SHARD, whose
        gradients are whole), parameters FSDP does not manage added once. ``None`` (nothing clipped) when ``model``
        is not one root unit."""
        if not isinstance(model, _fsdp()):
            return None
        chosen = {id(p) for p in parameters} if parameters is not None else None
        if chosen is None or all(id(p) in chosen for p in model.parameters() if p.requires_grad):
            return model.clip_grad_norm_(max_norm)
        params = [p for p in model.parameters() if id(p) in chosen]
        # every rank reduces, with or without gradients of its own
        total = clip.total_norm(params, 2.0, clip.shard_ids(_handles(model)))
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, total)
        return total

    # ------------------------------------------------------------------ gradient accumulation

    def accumulation_context(self, model: Module, accumulation: GradientAccumulation) -> AbstractContextManager[None]:
        # FSDP1's no_sync on the root: no reduce-scatter and no all-reduce; every unit keeps its unsharded gradient
        if not accumulation_mode(accumulation).reduce_scatter_each and isinstance(model, _fsdp()):
            return cast(AbstractContextManager[None], model.no_sync())
        return nullcontext()

    def release_gathered(self, model: Module) -> None:
        # nothing writes FSDP1's flat shards outside a training step: replica_sync, which does, refuses this engine
        # (Capabilities.replica_sync)
        return None

    def discard_unreduced_gradients(self, model: Module) -> None:
        # no_sync accumulates the unsharded gradient in .grad (the original parameters' views of it), which
        # zero_grad clears itself; nothing is held elsewhere. What the window used so far is dropped with it.
        unused.forget(fsdp1_unused.presences(_handles(model)))

    def settle_gradients(self, model: Module, *, defer_unused: bool = False) -> unused.Unreduced | None:
        units = _fsdp().fsdp_modules(model)  # one walk of the model per step: the root first
        off = [unit for unit in units if not unit._sync_gradients]
        if off:
            raise GradientSyncError(
                f"{len(off)} FSDP unit(s) still have gradient synchronisation turned off (FullyShardedDataParallel"
                ".no_sync() is still active) as the optimizer is about to step: their gradients were never reduced"
                " and the replicas would drift apart. Fix: leave no_sync() before the last backward of a step."
            )
        handles = _handles(model, units)
        if handles:
            root = units[0]  # its groups hold every rank that trains this model
            if defer_unused:
                return unused.unreduced(fsdp1_unused.presences(handles), handles[0].device)
            groups = [root.process_group, getattr(root, "_inter_node_pg", None)]
            unused.restore_unused(fsdp1_unused.presences(handles), handles[0].device, [g for g in groups if g])
        return None

    def gradient_bytes(self, model: Module) -> int:
        # under no_sync ``flat_param.grad`` is the unsharded gradient; the sharded one waits in ``_saved_grad_shard``
        held: dict[int, int] = {}
        for unit in self.storage(model):
            for grad in (unit.tensor.grad, getattr(unit.tensor, "_saved_grad_shard", None)):
                if grad is not None:
                    storage = grad.untyped_storage()
                    held[storage.data_ptr()] = max(held.get(storage.data_ptr(), 0), grad.numel() * grad.element_size())
        return sum(held.values())

    # ------------------------------------------------------------------ accounting

    def storage(self, model: Module) -> list[StorageUnit]:
        units: list[StorageUnit] = []
        managed: set[int] = set()
        for handle in _handles(model):
            flat = handle.flat_param
            local = getattr(flat, "_local_shard", flat)
            ranks = handle.world_size if handle.uses_sharded_strategy else 1
            units.append(StorageUnit(flat, local.numel(), sum(flat._numels), local.numel() * ranks))
            managed.add(id(flat))
            managed.update(id(p) for p in flat._params or ())
        for param in model.parameters():
            if id(param) not in managed:
                units.append(StorageUnit(param, param.numel(), param.numel(), param.numel()))
        return units

    def full_numels(self, model: Module) -> dict[int, int]:
        numels = {id(unit.tensor): unit.full_numel for unit in self.storage(model)}
        for handle in _handles(model):
            flat = handle.flat_param
            numels.update({id(p): n for p, n in zip(flat._params or (), flat._numels)})
        return numels

    def sharding(self, model: Module) -> ShardingFacts | None:
        handles = _handles(model)
        if not handles:
            return None
        handle = handles[0]
        state = _owner(model, handle)
        name = handle._sharding_strategy.name
        if not handle.uses_sharded_strategy:
            return ShardingFacts(name, 1, handle.world_size, {REPLICATE_AXIS: state.process_group})
        groups: dict[str, ProcessGroup] = {SHARD_AXIS: state.process_group}
        inter = getattr(state, "_inter_node_pg", None)
        replicas = 1
        if inter is not None and "HYBRID" in name:
            groups[REPLICATE_AXIS] = inter
            replicas = inter.size()
        return ShardingFacts(name, handle.world_size, replicas, groups)

    def comm_units(self, model: Module) -> list[FSDPUnitSpec]:
        """The :class:`~lightning_smp.engines.textbook.FSDPUnitSpec` of every unit of ``model`` that owns parameters."""
        from lightning_smp.engines.textbook import FSDPUnitSpec

        specs = []
        for unit in _fsdp().fsdp_modules(model):
            handle = unit._handle
            if handle is None:
                continue
            flat = handle.flat_param
            padded = sum(flat._numels_with_padding)
            if handle.uses_sharded_strategy and hasattr(flat, "_local_shard"):
                # the last rank's chunk carries the padding up to a multiple of the group size
                padded = flat._local_shard.numel() * handle.world_size
            gather_dtype = getattr(handle, "_fwd_bwd_param_dtype", None) or flat.dtype
            reduce_dtype = getattr(handle, "_reduce_dtype", None) or flat.dtype
            specs.append(FSDPUnitSpec(
                padded_numel=padded,
                is_root=bool(unit._is_root),
                gather_bytes=torch.empty((), dtype=gather_dtype).element_size(),
                reduce_bytes=torch.empty((), dtype=reduce_dtype).element_size(),
            ))
        return specs

    def step_textbook(self, model: Module, backward_passes: int, accumulation: GradientAccumulation,
                      root_gathered: bool = False) -> CommFigure | None:
        from lightning_smp.engines.textbook import fsdp_step_textbook

        facts = self.sharding(model)
        if facts is None:
            return None
        replicas = facts.replicas
        if facts.sharding_strategy == NO_SHARD:
            replicas = _handles(model)[0].world_size
        scattered, synced = accumulation_mode(accumulation).passes(backward_passes)
        presences = fsdp1_unused.presences(_handles(model))  # the unused-parameter bitmap
        return fsdp_step_textbook(self.comm_units(model), facts.sharding_strategy, facts.shard_degree, replicas,
                                  backward_passes, synced_passes=synced, reduce_scatter_passes=scattered,
                                  root_gathered=root_gathered, keep_gathered_unsynced=True,
                                  unused_bitmap_bytes=unused.bitmap_bytes(presences))

    # ------------------------------------------------------------------ plain PyTorch

    def patch_plain_calls(self, calls: PlainCalls) -> Callable[[], None]:
        """Patch ``FullyShardedDataParallel.__init__`` (the only thing :func:`lightning_smp.init` changes in FSDP1):
        every call's arguments go through ``calls.rewrite``."""
        engine = self
        cls = _fsdp()
        original = cls.__init__
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs)
            after = calls.rewrite(engine, bound.arguments)
            original(*bound.args, **bound.kwargs)
            if after is not None:
                after(self)

        return replace_attribute(cls, "__init__", __init__, "FullyShardedDataParallel.__init__")


__all__ = ["FSDP1Engine", "full_state_dict_context"]
