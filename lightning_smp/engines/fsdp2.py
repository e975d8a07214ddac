"""The FSDP2 engine: ``torch.distributed.fsdp.fully_shard``, per-parameter ``DTensor`` shards.

Parameters become ``DTensor``s placed ``(Replicate(), Shard(0))`` on the 2-D ``(replicate, shard)`` mesh (or
``(Shard(0),)`` on the shard axis alone when one group spans the world); degree 1 is the mesh ``(world, 1)``, on
which FSDP2 issues no shard-group collective and all-reduces every gradient across the world, as DDP does.

What FSDP2 does not expose publicly (the padded local shard of each parameter, the partial-reduce buffer of
deferred accumulation, whether a group still defers its all-reduce) is read here and only here, from the
``FSDPParamGroup`` of each ``FSDPModule``; the memory-accounting tests check every such read against the real
tensors.

Above 300 lines for a reason: one class implementing every method of the :class:`~lightning_smp.engines.Engine`
protocol for ``fully_shard``, plus the argument tables it checks; splitting it would spread FSDP2's internals.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.degree import Layout
from lightning_smp.engines import fsdp2_unused, unused
from lightning_smp.engines.base import ShardingFacts, ShardingPlan, StorageUnit, replace_attribute
from lightning_smp.engines.fsdp2_prediction import FSDP2Prediction
from lightning_smp.engines.prediction import Prediction
from lightning_smp.errors import GradientSyncError, UnsupportedOptionError
from lightning_smp.names import (
    DEFER_ALL_REDUCE,
    EVERY_MICRO_BATCH,
    FULL_SHARD,
    HYBRID_SHARD,
    HYBRID_SHARD_ZERO2,
    NO_SHARD,
    NO_SYNC,
    REPLICATE_AXIS,
    SHARD_AXIS,
    SHARD_GRAD_OP,
    GradientAccumulation,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_smp.accounting.comm import CommFigure, FSDPUnitSpec

#: FSDP1 arguments refused under FSDP2, each with what to do instead
FSDP1_ONLY = {
    "use_orig_params": "drop it: FSDP2 always keeps the original parameters (as DTensor shards)",
    "limit_all_gathers": "drop it: FSDP2 bounds in-flight all-gathers itself",
    "forward_prefetch": "drop it, or call FSDPModule.set_modules_to_forward_prefetch() on the wrapped modules",
    "backward_prefetch": "drop it, or call FSDPModule.set_modules_to_backward_prefetch() on the wrapped modules",
    "sync_module_states": "drop it: replicas always start from global rank 0's weights",
    "process_group": "pass hybrid_shard_degree or device_mesh instead (FSDP2 shards over a DeviceMesh)",
    "param_init_fn": "create the model under trainer.init_module(empty_init=True); modules are materialized with"
                     " reset_parameters()",
    "device_id": "drop it: the Trainer's devices decide",
    "ignored_modules": "pass ignored_params={...} (FSDP2's equivalent)",
    "ignored_states": "pass ignored_params={...} (FSDP2's equivalent)",
    "auto_wrap_policy_kwargs": "drop it",
    "reshard_after_forward": "choose sharding_strategy: HYBRID_SHARD reshards after forward, _HYBRID_SHARD_ZERO2"
                             " keeps parameters gathered until backward",
    "mesh": "pass device_mesh (or hybrid_shard_degree) to the strategy",
    "mp_policy": "pass mixed_precision=MixedPrecisionPolicy(...), or the Trainer's precision",
    "offload_policy": "pass cpu_offload=True or cpu_offload=CPUOffloadPolicy(...)",
}
#: ``fully_shard`` arguments passed through as they are
FSDP2_OPTIONS = ("shard_placement_fn", "ignored_params")

# The sharding strategy each root this engine sharded runs: FSDP2 keeps no such name, and a root-only model under
# ZeRO-2 looks like HYBRID_SHARD (the root never reshards after forward in either). Weak: never keeps a model alive.
_SHARDED_AS: weakref.WeakKeyDictionary[Module, str] = weakref.WeakKeyDictionary()


def _fsdp_module_cls() -> Any:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def fsdp_modules(model: Module) -> list[Any]:
    """Every ``FSDPModule`` in ``model`` (``model`` included), outermost first."""
    cls = _fsdp_module_cls()
    return [m for m in model.modules() if isinstance(m, cls)]


def _materialize_where_shards_cannot_draw(module: Module, plan: ShardingPlan) -> None:
    """Meta-device parameters in full, before sharding, where DTensor's random ops do not run (CPU: they need a
    CUDA-like device). Materialized after sharding there, each rank's ``reset_parameters`` would draw the first
    numbers of the same stream for its own shard, and every full weight would repeat one block of rows. In full, every
    rank draws what a non-sharded model seeded alike draws; rank 0's weights then go to every rank (ranks need not be
    seeded alike), and ``fully_shard`` splits real tensors. Costs the full model on each rank for a moment."""
    from lightning.fabric.strategies.model_parallel import _materialize_distributed_module
    from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers
    from torch.distributed.tensor._random import is_rng_supported_mesh

    from lightning_smp.replicas import broadcast_module_state

    if not _has_meta_device_parameters_or_buffers(module):
        return
    if plan.mesh is not None and is_rng_supported_mesh(plan.mesh):
        return
    _materialize_distributed_module(module, plan.device)  # to_empty, then reset_parameters() in module order
    broadcast_module_state(module, plan.device, src=0)


def _param_groups(model: Module) -> list[tuple[Any, Any]]:
    """``(FSDPModule, FSDPParamGroup)`` for every module of ``model`` that owns parameters."""
    groups: list[tuple[Any, Any]] = []
    for module in fsdp_modules(model):
        state = module._get_fsdp_state()
        # a module may own several groups (torch >= 2.10: ``_fsdp_param_groups``), older versions exactly one
        owned = getattr(state, "_fsdp_param_groups", None)
        if owned is None:
            owned = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        groups.extend((module, group) for group in owned)
    return groups


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def wrap_targets(module: Module, policy: Any) -> list[Module]:
    """The submodules of ``module`` that ``auto_wrap_policy`` selects, innermost first (the order ``fully_shard``
    must be applied in), the root excluded.

    ``policy`` is what FSDP1 and Lightning accept: ``None``, a set (or list, tuple) of layer classes, a
    ``ModuleWrapPolicy`` / ``CustomPolicy``, or a callable ``policy(module, recurse, nonwrapped_numel)`` such as
    ``functools.partial(size_based_auto_wrap_policy, min_num_params=...)``; a callable is walked exactly as FSDP1's
    ``_recursive_wrap`` walks it.
    """
    if policy is None:
        return []
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        return [m for m in _post_order(module) if m is not module and isinstance(m, classes)]
    from torch.distributed.fsdp.wrap import _Policy

    if isinstance(policy, _Policy):
        chosen = policy._run_policy(module, ignored_modules=set(), root_kwargs={})
        return [m for m in _post_order(module) if m is not module and m in chosen]
    if callable(policy):
        chosen_list: list[Module] = []
        _walk_callable(module, policy, chosen_list)
        return [m for m in chosen_list if m is not module]
    raise UnsupportedOptionError(
        f"auto_wrap_policy={policy!r} is not a wrapping policy. Fix: pass a set of layer classes (e.g. {{Block}}),"
        " a ModuleWrapPolicy, or an FSDP1-style callable policy."
    )


def _shard_below_the_root(module: Module, kwargs: dict[str, Any]) -> None:
    """Manual optimization: every parameter in a unit below the root, each child that holds some a unit of its own.

    Lightning's step runs as the root's forward (:meth:`FSDP2Engine.call_through_root`), so a backward inside it comes
    before the root's post-forward, which is what hooks the root's parameters into a backward: their gradients would
    stay None, and the step would silently skip them. A unit below the root gathers, hooks and reduces around each
    of its own calls, and follows ``requires_grad`` as ``toggle_optimizer`` sets it, whatever the step does between.
    Frozen parameters count too (a finetuning callback may unfreeze them later); the elements of a ``ModuleList`` or
    ``ModuleDict`` become the units (``fully_shard`` refuses containers).
    """
    from torch.distributed.fsdp import fully_shard

    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise UnsupportedOptionError(
            f"automatic_optimization=False with parameters held by the LightningModule itself ({', '.join(own)}):"
            " under fsdp_version=2 every parameter must be in a submodule, whose FSDP unit takes part in each"
            " backward inside the step. Fix: move them into a submodule (e.g. a small nn.Module holding them)."
        )
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)
    pending = list(module.children())
    while pending:
        child = pending.pop(0)
        if isinstance(child, _fsdp_module_cls()) or not any(True for _ in child.parameters()):
            continue
        if isinstance(child, containers):
            pending.extend(child.children())
        else:
            fully_shard(child, **kwargs)


def _post_order(module: Module) -> Iterator[Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _walk_callable(module: Module, policy: Callable[..., bool], chosen: list[Module]) -> int:
    # FSDP1's _recursive_wrap: a module is asked with recurse=True whether to look inside, then (with the
    # parameters its chosen descendants do not already cover) whether to wrap it; returns the parameters covered
    numel = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, nonwrapped_numel=numel):
        return 0
    covered = sum(_walk_callable(child, policy, chosen) for child in module.children())
    if policy(module=module, recurse=False, nonwrapped_numel=numel - covered):
        chosen.append(module)
        return numel
    return covered


def _mixed_precision_policy(plan: ShardingPlan) -> Any:
    """The ``MixedPrecisionPolicy`` for ``plan``: the user's, else the Trainer's precision mapped to FSDP2."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if isinstance(plan.mixed_precision, MixedPrecisionPolicy):
        return plan.mixed_precision
    # "*-mixed": parameters gathered and computed in low precision, gradients reduced in fp32 (FSDP2's recommended
    # setting; the sharded parameters and optimizer state stay fp32). "*-true" and "32-true": the module itself has
    # the dtype (the precision plugin converts it), nothing is cast.
    low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(plan.precision)
    if low is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def _offload_policy(plan: ShardingPlan) -> Any:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    offload = plan.cpu_offload
    if isinstance(offload, OffloadPolicy):
        return offload
    if offload is not None and getattr(offload, "offload_params", False):
        # pinned memory needs an accelerator: a CPU-only build of torch refuses pin_memory=True
        return CPUOffloadPolicy(pin_memory=plan.device.type != "cpu")
    return OffloadPolicy()


def _full_tensor(value: Any, device: torch.device) -> torch.Tensor:
    """``value`` unsharded (collective over its shard axis only), on the CPU."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    if value.device.type != device.type:
        # CPU-offloaded shards: the collective runs on the mesh's device (NCCL cannot move CPU tensors)
        value = DTensor.from_local(value.to_local().to(device), value.device_mesh, value.placements,
                                   run_check=False, shape=value.shape, stride=value.stride())
    return value.full_tensor().detach().cpu()


def _clean_fqn(name: str) -> str:
    # the names torch.distributed.checkpoint.state_dict uses: without activation-checkpointing wrappers
    return name.replace("_checkpoint_wrapped_module.", "")


class FSDP2Engine:
    """:class:`~lightning_smp.engines.Engine` for ``fully_shard`` (FSDP2)."""

    name = "fsdp2"
    version = 2
    # deferred first: sharded gradients and one crossing of the replicas per optimizer step, whatever k is
    accumulations: tuple[GradientAccumulation, ...] = (DEFER_ALL_REDUCE, EVERY_MICRO_BATCH, NO_SYNC)
    # torchtitan's order: checkpoint wrappers inside, then fully_shard (hooks see the wrapped layers)
    checkpoint_activations_first = True
    steps_inside_a_step = True  # with every parameter in a unit below the root (see _shard_root)
    replaces_parameters = True  # fully_shard swaps each parameter for a DTensor shard
    prediction: Prediction = FSDP2Prediction()

    # ------------------------------------------------------------------ options

    def check_options(self, options: Mapping[str, Any], mixed_precision: Any, cpu_offload: Any) -> None:
        for key in options:
            if key in FSDP1_ONLY:
                raise UnsupportedOptionError(
                    f"{key}={options[key]!r} is an FSDP1 argument that fsdp_version=2 (fully_shard) does not take."
                    f" Fix: {FSDP1_ONLY[key]}."
                )
            if key not in (*FSDP2_OPTIONS, "auto_wrap_policy"):
                raise UnsupportedOptionError(
                    f"{key}={options[key]!r} is not an argument of fully_shard (fsdp_version=2). Arguments passed"
                    f" through to it: {', '.join(FSDP2_OPTIONS)}. Fix: drop it, or use fsdp_version=1."
                )
        if mixed_precision is not None and type(mixed_precision).__name__ != "MixedPrecisionPolicy":
            raise UnsupportedOptionError(
                f"mixed_precision={type(mixed_precision).__name__}(...) is an FSDP1 config; fsdp_version=2 takes a"
                " torch.distributed.fsdp.MixedPrecisionPolicy. Fix: pass MixedPrecisionPolicy(param_dtype=...,"
                " reduce_dtype=...), or only the Trainer's precision."
            )
        if not isinstance(cpu_offload, (bool, type(None))) and type(cpu_offload).__name__ not in (
                "CPUOffload", "CPUOffloadPolicy", "OffloadPolicy"):
            raise UnsupportedOptionError(
                f"cpu_offload={cpu_offload!r} is not an offload config. Fix: pass True, or CPUOffloadPolicy(...)."
            )

    def mesh_for(self, mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
        # NO_SHARD keeps the 2-D mesh: shard groups of one rank cost nothing in FSDP2 (no collective is issued on
        # them) and the replicate axis all-reduces over the world, as DDP does
        if layout.sharding_strategy in (FULL_SHARD, SHARD_GRAD_OP):
            return mesh[SHARD_AXIS]
        return mesh

    # ------------------------------------------------------------------ wrapping

    def shard_kwargs(self, plan: ShardingPlan) -> dict[str, Any]:
        """What every ``fully_shard`` call for ``plan`` is given (the root's ``reshard_after_forward`` aside)."""
        kwargs: dict[str, Any] = {
            "reshard_after_forward": plan.layout.sharding_strategy not in (HYBRID_SHARD_ZERO2, SHARD_GRAD_OP),
            "mp_policy": _mixed_precision_policy(plan),
            "offload_policy": _offload_policy(plan),
            **{k: v for k, v in plan.options.items() if k in FSDP2_OPTIONS},
        }
        if plan.mesh is not None:
            kwargs["mesh"] = plan.mesh
        return kwargs

    def wrap(self, module: Module, plan: ShardingPlan) -> Module:
        from torch.distributed.fsdp import fully_shard

        _materialize_where_shards_cannot_draw(module, plan)
        kwargs = self.shard_kwargs(plan)
        for target in wrap_targets(module, plan.options.get("auto_wrap_policy")):
            fully_shard(target, **kwargs)
        _SHARDED_AS[module] = plan.layout.sharding_strategy
        return self._shard_root(module, kwargs, plan)

    def _shard_root(self, module: Module, kwargs: dict[str, Any], plan: ShardingPlan) -> Module:
        from lightning.fabric.strategies.model_parallel import _materialize_distributed_module
        from torch.distributed.fsdp import fully_shard

        if plan.steps_inside_a_step:
            _shard_below_the_root(module, kwargs)
        # the root keeps its parameters gathered from forward to backward, as FSDP1's root does (it is needed again
        # at once); under ZeRO-2 nothing reshards after forward anyway
        fully_shard(module, **{**kwargs, "reshard_after_forward": None if kwargs["reshard_after_forward"] else False})
        # every parameter that requires a gradient takes part in every reduction (zeros when a micro-batch did not use
        # it), as DDP's buckets do: the pending sum of a deferred all-reduce keeps one layout for the whole window.
        # Otherwise its layout follows the parameters each micro-batch used, and a head left out of the last
        # micro-batch is never all-reduced (its .grad stays None) or receives another head's sum
        for unit in fsdp_modules(module):
            unit.set_reduce_scatter_unused_params(True, recurse=False)
        # ... and a parameter that no rank used in the window gets its .grad back before the step (engines/unused.py)
        for group in (group for _, group in _param_groups(module)):
            fsdp2_unused.track(group)
        # meta-device parameters become real local shards, initialised by each module's reset_parameters()
        _materialize_distributed_module(module, plan.device)
        return module

    def complete(self, module: Module, plan: ShardingPlan) -> Module:
        """Shard the root too when the user sharded only submodules: its remaining parameters join it (else they
        would never be reduced across ranks), and the model gets one root to accumulate, clip and checkpoint over.
        Replicas then start from the first replica's shards (FSDP2 has no ``sync_module_states``)."""
        from lightning_smp.replicas import broadcast_across_replicas

        if not isinstance(module, _fsdp_module_cls()):
            _SHARDED_AS[module] = plan.layout.sharding_strategy
            module = self._shard_root(module, self.shard_kwargs(plan), plan)
        if plan.mesh is not None and plan.mesh.ndim == 2:
            broadcast_across_replicas(module, plan.mesh, plan.device)
        return module

    @contextmanager
    def wrap_context(self, plan: ShardingPlan) -> Generator[None, None, None]:
        """Inside ``configure_model``: ``fully_shard(module)`` without a mesh shards over ``plan``'s mesh."""
        if plan.mesh is None:
            yield
            return
        restore = self.patch_default_mesh(lambda: plan.mesh)
        try:
            yield
        finally:
            restore()

    def prepare_backward(self, model: Module, output: Any) -> None:
        return None  # its hooks are registered at wrapping and need nothing per backward

    def units(self, module: Module) -> list[tuple[str, Module]]:
        return [(_clean_fqn(name), m) for name, m in module.named_modules() if isinstance(m, _fsdp_module_cls())]

    def is_sharded(self, module: Module) -> bool:
        return bool(fsdp_modules(module))

    def call_through_root(self, root: Module, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` (a LightningModule step) as the forward of the sharded ``root``: its hooks gather the
        root's own parameters and prepare their gradient reduction, whatever the step calls. Calls of the root
        inside the step (``self(x)``) then run its forward without those hooks again (they would gather twice)."""
        if not isinstance(root, _fsdp_module_cls()):
            return method(*args, **kwargs)
        state = root._get_fsdp_state()
        hooks = [(root._forward_pre_hooks, state._pre_forward_hook_handle.id),
                 (root._forward_hooks, state._post_forward_hook_handle.id)]
        original_forward = root.forward

        def step_as_forward(*step_args: Any, **step_kwargs: Any) -> Any:
            root.forward = original_forward  # restored before the step calls it
            paused = [(table, key, table.pop(key)) for table, key in hooks if key in table]
            try:
                return method(*step_args, **step_kwargs)
            finally:
                for table, key, hook in paused:
                    table[key] = hook

        root.forward = step_as_forward
        try:
            return root(*args, **kwargs)
        finally:
            root.forward = original_forward

    def holds_shards(self, module: Module) -> bool:
        return any(self.is_shard(p) for p in module.parameters())

    def is_shard(self, parameter: torch.Tensor) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(parameter, DTensor)

    # ------------------------------------------------------------------ state dicts

    def full_model_state(self, model: Module, device: torch.device) -> dict[str, Any]:
        # collective over the shard axis only (the replicate axis is Replicate): shard group members call together
        return {key: _full_tensor(value, device) for key, value in model.state_dict().items()}

    def full_optimizer_state(
        self, model: Module, optimizer: Optimizer, device: torch.device, group: ProcessGroup | None
    ) -> dict[str, Any]:
        # torch's own layout (keyed by index in the optimizer's order); every DTensor state is gathered over its
        # shard axis, which is ``group``'s ranks
        local = optimizer.state_dict()
        state = {index: {key: _full_tensor(value, device) for key, value in entry.items()}
                 for index, entry in local["state"].items()}
        return {"state": state, "param_groups": [dict(g) for g in local["param_groups"]]}

    def optimizer_state_context(self, model: Module, optimizer: Optimizer) -> AbstractContextManager[None]:
        return nullcontext()  # one state per parameter: any subset of the model's parameters reads and loads

    def optimizer_state_by_name(self, model: Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        names = {id(p): _clean_fqn(name) for name, p in model.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        return {
            "state": {order[int(index)]: entry for index, entry in state["state"].items()},
            "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in state["param_groups"]],
        }

    # ------------------------------------------------------------------ clipping

    def local_model_state(self, model: Module) -> dict[str, Any] | None:
        return None  # torch's sharded state dict is this rank's DTensor shards already: nothing to gather

    def local_optimizer_state(self, model: Module, optimizer: Optimizer) -> dict[str, Any] | None:
        return None

    def clip_grad_norm(self, model: Module, max_norm: float,
                       parameters: Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
        """The 2-norm over the gradients of ``parameters`` (``None``: every one of ``model``): each DTensor's local
        norm, reduced over the shard axis only (the replicate axis holds identical copies, counted once), as a plain
        tensor; then scaled like ``torch.nn.utils.clip_grad_norm_``. ``None`` when ``model`` has no FSDP2 root."""
        from torch.distributed.tensor import DTensor

        if not isinstance(model, _fsdp_module_cls()):
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
        if accumulation == EVERY_MICRO_BATCH:
            return nullcontext()
        return self._reducing_off(model, all_reduce_only=accumulation == DEFER_ALL_REDUCE)

    @contextmanager
    def _reducing_off(self, model: Module, all_reduce_only: bool) -> Generator[None, None, None]:
        # per module (recurse=False): a model the user sharded module by module has no FSDP2 root
        modules = fsdp_modules(model)
        for module in modules:
            if all_reduce_only:
                module.set_requires_all_reduce(False, recurse=False)
            else:
                module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            # always back on: the last micro-batch must all-reduce, or ``.grad`` stays None and the step does nothing
            for module in modules:
                module.set_requires_gradient_sync(True, recurse=False)

    def settle_gradients(self, model: Module) -> None:
        off = [group for _, group in _param_groups(model) if not (group.reduce_grads and group.all_reduce_grads)]
        if off:
            raise GradientSyncError(
                f"{len(off)} FSDP2 module(s) still have their gradient reduction turned off"
                " (set_requires_all_reduce(False) or set_requires_gradient_sync(False)) as the optimizer is about to"
                " step: their .grad is None or unreduced and the step would silently skip them. Fix: turn it back on"
                " before the last micro-batch's backward (HybridShardFSDPStrategy does so for accumulate_grad_batches;"
                " do not call these setters yourself)."
            )
        # the state, not only the flags: a sum still waiting for its all-reduce was never applied to any .grad
        pending = [group for _, group in _param_groups(model) if getattr(group, "_partial_reduce_output", None) is not None]
        if pending:
            raise GradientSyncError(
                f"{len(pending)} FSDP2 parameter group(s) hold a gradient sum that was never all-reduced across replicas"
                " as the optimizer is about to step: the step would skip those gradients or apply them to the wrong"
                " window. Fix: run the last micro-batch's backward with gradient sync on (outside no_backward_sync),"
                " or discard the window with model.reset_iter_state() on the sharded root."
            )
        groups = [group for _, group in _param_groups(model)]
        if groups:
            mesh = groups[0].mesh_info.mesh  # the root's: every rank that trains this model
            unused.restore_unused(fsdp2_unused.presences(groups), groups[0].device,
                                  [mesh.get_group(axis) for axis in range(mesh.ndim)])

    def discard_unreduced_gradients(self, model: Module) -> None:
        unused.forget(fsdp2_unused.presences(group for _, group in _param_groups(model)))
        # the deferred all-reduce keeps each group's partial sum outside .grad; the root's reset_iter_state (torch's
        # recovery API) discards it, as zero_grad discards DDP's accumulated .grad
        if any(getattr(group, "_partial_reduce_output", None) is not None for _, group in _param_groups(model)):
            reset = getattr(model, "reset_iter_state", None)
            if reset is None:
                raise GradientSyncError(
                    "optimizer.zero_grad() in the middle of an accumulation window: the deferred gradient sums cannot"
                    " be discarded on this model (no sharded root with reset_iter_state). Fix: call zero_grad at an"
                    " optimizer step boundary, or use gradient_accumulation='every_micro_batch'."
                )
            reset()

    def gradient_bytes(self, model: Module) -> int:
        # sharded gradients are views of one reduce-scatter output per module: count each storage once
        held: dict[int, int] = {}

        def add(tensor: torch.Tensor | None) -> None:
            if tensor is None:
                return
            local = _local(tensor)
            storage = local.untyped_storage()
            held[storage.data_ptr()] = max(held.get(storage.data_ptr(), 0), storage.nbytes())

        managed: set[int] = set()
        for _, group in _param_groups(model):
            add(group._partial_reduce_output)  # deferred all-reduce: the 1/degree partial sum
            for fsdp_param in group.fsdp_params:
                managed.add(id(fsdp_param.sharded_param))
                add(fsdp_param.sharded_param.grad)
                add(fsdp_param.unsharded_accumulated_grad)  # no_sync in a lower reduce dtype
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                add(None if unsharded is None else unsharded.grad)  # no_sync: the unsharded gradient
        for param in model.parameters():
            if id(param) not in managed:
                add(param.grad)
        return sum(held.values())

    # ------------------------------------------------------------------ accounting

    def storage(self, model: Module) -> list[StorageUnit]:
        units: list[StorageUnit] = []
        managed: set[int] = set()
        for _, group in _param_groups(model):
            ranks = group.mesh_info.shard_mesh_size
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                local = fsdp_param._sharded_param_data.numel()  # the padded local shard the rank allocates
                units.append(StorageUnit(param, local, param.numel(), local * ranks))
                managed.add(id(param))
                # while a module is gathered its registered parameters are the unsharded ones: the same storage
                managed.add(id(getattr(fsdp_param, "_unsharded_param", None)))
        for param in model.parameters():
            if id(param) not in managed:
                units.append(StorageUnit(param, param.numel(), param.numel(), param.numel()))
        return units

    def full_numels(self, model: Module) -> dict[int, int]:
        return {id(unit.tensor): unit.full_numel for unit in self.storage(model)}

    def sharding(self, model: Module) -> ShardingFacts | None:
        groups = _param_groups(model)
        if not groups:
            return None
        info = groups[0][1].mesh_info
        shard = info.shard_mesh_size
        replicate_group: Any = getattr(info, "replicate_process_group", None)  # HSDP meshes only
        replicas = info.replicate_mesh_size if replicate_group is not None else 1
        if shard == 1:
            return ShardingFacts(NO_SHARD, 1, replicas, {REPLICATE_AXIS: replicate_group})
        known = _SHARDED_AS.get(model)
        if known is not None:
            zero2 = known in (HYBRID_SHARD_ZERO2, SHARD_GRAD_OP)
        else:
            # sharded by hand: ZeRO-2 when the non-root modules keep their parameters gathered after forward
            inner = [g for m, g in groups if not m._get_fsdp_state()._is_root]
            zero2 = bool(inner) and all(g.post_forward_mesh_info is None for g in inner)
        facts_groups: dict[str, ProcessGroup] = {SHARD_AXIS: info.shard_process_group}
        if replicate_group is not None and replicas > 1:
            facts_groups[REPLICATE_AXIS] = replicate_group
            name = HYBRID_SHARD_ZERO2 if zero2 else HYBRID_SHARD
        else:
            name = SHARD_GRAD_OP if zero2 else FULL_SHARD
        return ShardingFacts(name, shard, replicas, facts_groups)

    def comm_units(self, model: Module) -> list[FSDPUnitSpec]:
        """One :class:`~lightning_smp.accounting.comm.FSDPUnitSpec` per module that owns parameters: one all-gather
        and one reduce-scatter each, of all its parameters' padded shards together."""
        from lightning_smp.accounting.comm import FSDPUnitSpec

        specs = []
        for module, group in _param_groups(model):
            params = group.fsdp_params
            shard = group.mesh_info.shard_mesh_size
            padded = sum(p._sharded_param_data.numel() for p in params) * shard
            # only the parameters that require gradients are reduce-scattered (and all-reduced)
            reduced = sum(p._sharded_param_data.numel() for p in params if p.sharded_param.requires_grad) * shard
            gather_dtype = params[0].param_dtype or params[0].orig_dtype
            reduce_dtype = params[0].reduce_dtype or gather_dtype
            specs.append(FSDPUnitSpec(
                padded_numel=padded,
                is_root=bool(module._get_fsdp_state()._is_root),
                gather_bytes=torch.empty((), dtype=gather_dtype).element_size(),
                reduce_bytes=torch.empty((), dtype=reduce_dtype).element_size(),
                reduce_numel=reduced,
            ))
        return specs

    def step_textbook(self, model: Module, backward_passes: int, accumulation: GradientAccumulation,
                      root_gathered: bool = False) -> CommFigure | None:
        from lightning_smp.accounting.comm import accumulation_passes, fsdp_step_textbook

        facts = self.sharding(model)
        if facts is None:
            return None
        scattered, synced = accumulation_passes(accumulation, backward_passes)
        presences = fsdp2_unused.presences(group for _, group in _param_groups(model))  # the unused-parameter bitmap
        return fsdp_step_textbook(self.comm_units(model), facts.sharding_strategy, facts.shard_degree, facts.replicas,
                                  backward_passes, synced_passes=synced, reduce_scatter_passes=scattered,
                                  root_gathered=root_gathered,
                                  unused_bitmap_bytes=unused.bitmap_bytes(presences))

    # ------------------------------------------------------------------ plain PyTorch

    def patch_default_mesh(self, mesh: Callable[[], DeviceMesh | None]) -> Callable[[], None]:
        """Make ``fully_shard(module)`` calls that pass no ``mesh`` shard over ``mesh()`` (when it is not ``None``);
        return a function that undoes it. A ``mesh=`` the caller passes always wins.

        ``fully_shard`` looks its default mesh up through a module-level function at every call, so replacing that
        function reaches every caller, however it imported ``fully_shard``.
        """
        from torch.distributed.fsdp._fully_shard import _fully_shard

        original = _fully_shard._init_default_mesh

        def _init_default_mesh(*args: Any, **kwargs: Any) -> DeviceMesh:
            configured = mesh()
            return configured if configured is not None else original(*args, **kwargs)

        return replace_attribute(_fully_shard, "_init_default_mesh", _init_default_mesh,
                                 "fully_shard's default mesh")


__all__ = ["FSDP1_ONLY", "FSDP2Engine", "fsdp_modules", "wrap_targets"]
