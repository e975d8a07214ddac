"""The FSDP1 engine: ``torch.distributed.fsdp.FullyShardedDataParallel`` with flat parameters.

FSDP1 has no public API for what a rank stores (flat-parameter shards, their padding, the process groups of a
hybrid unit), so this module is the one place that reads FSDP1's internals (``_handle``, ``flat_param._numels``,
``_inter_node_pg``, ...). Each read is checked against the real tensors by the memory-accounting tests.
"""

from __future__ import annotations

import collections
import functools
import inspect
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.engines.base import ShardingFacts, ShardingPlan, StorageUnit
from lightning_smp.names import NO_SHARD, REPLICATE_AXIS, SHARD_AXIS

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lightning_smp.accounting.comm import CommFigure, FSDPUnitSpec


def _fsdp() -> Any:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _handles(model: Module) -> list[Any]:
    return [unit._handle for unit in _fsdp().fsdp_modules(model) if unit._handle is not None]


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


class FSDP1Engine:
    """:class:`~lightning_smp.engines.Engine` for ``FullyShardedDataParallel`` (FSDP1)."""

    name = "fsdp1"

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
        return _fsdp()(module=module, **self.wrapper_kwargs(plan))

    def wrap_context(self, plan: ShardingPlan) -> Any:
        from torch.distributed.fsdp.wrap import enable_wrap

        return enable_wrap(wrapper_cls=_fsdp(), **self.wrapper_kwargs(plan))

    def is_sharded(self, module: Module) -> bool:
        return any(isinstance(m, _fsdp()) for m in module.modules())

    def holds_shards(self, module: Module) -> bool:
        from torch.distributed.fsdp._common_utils import _is_fsdp_flattened

        return any(_is_fsdp_flattened(p) for p in module.parameters())

    # ------------------------------------------------------------------ state dicts

    def full_model_state(self, model: Module, device: torch.device) -> dict[str, Any]:
        with full_state_dict_context(model, device):
            state = model.state_dict()
        return collections.OrderedDict((k, v.detach().cpu().clone()) for k, v in state.items())

    def full_optimizer_state(
        self, model: Module, optimizer: Optimizer, device: torch.device, group: ProcessGroup | None
    ) -> dict[str, Any]:
        from torch.distributed.fsdp import OptimStateKeyType

        with full_state_dict_context(model, device):
            state = _fsdp().optim_state_dict(model, optimizer, group=group)
        if not state:
            return {}  # not the gathering rank
        # rekey by the optimizer's own parameter order (FSDP's default is model.parameters() order)
        return _fsdp().rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, model, optim=optimizer)

    def optimizer_state_by_name(self, model: Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.fsdp import OptimStateKeyType

        return _fsdp().rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, model, optim=optimizer)

    # ------------------------------------------------------------------ clipping

    def clip_grad_norm(self, model: Module, max_norm: float) -> torch.Tensor | None:
        """FSDP1's own ``clip_grad_norm_`` on the root unit, which is hybrid-aware: the norm is taken once over all
        shards (counted once across replicas), exactly as DDP's over the full gradients. ``None`` (nothing clipped)
        when ``model`` is not one root unit."""
        if not isinstance(model, _fsdp()):
            return None
        return model.clip_grad_norm_(max_norm)

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
        """The :class:`~lightning_smp.accounting.comm.FSDPUnitSpec` of every unit of ``model`` that owns parameters."""
        from lightning_smp.accounting.comm import FSDPUnitSpec

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

    def step_textbook(self, model: Module, backward_passes: int, synced_passes: int) -> CommFigure | None:
        from lightning_smp.accounting.comm import fsdp_step_textbook

        facts = self.sharding(model)
        if facts is None:
            return None
        replicas = facts.replicas
        if facts.sharding_strategy == NO_SHARD:
            replicas = _handles(model)[0].world_size
        return fsdp_step_textbook(self.comm_units(model), facts.sharding_strategy, facts.shard_degree, replicas,
                                  backward_passes, synced_passes=synced_passes)

    # ------------------------------------------------------------------ plain PyTorch

    def patch_wrapper(self, rewrite: Callable[[dict[str, Any]], Callable[[Module], None] | None]) -> Callable[[], None]:
        """Patch ``FullyShardedDataParallel.__init__`` (the only thing :func:`lightning_smp.init` changes in FSDP1)."""
        import warnings

        cls = _fsdp()
        original = cls.__init__
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs)
            after = rewrite(bound.arguments)
            original(*bound.args, **bound.kwargs)
            if after is not None:
                after(self)

        cls.__init__ = __init__

        def restore() -> None:
            if cls.__init__ is __init__:
                cls.__init__ = original
            else:
                warnings.warn("lightning_smp.shutdown(): FullyShardedDataParallel.__init__ was patched again after"
                              " lightning_smp.init(); that later patch is left in place.", UserWarning, stacklevel=3)

        return restore


__all__ = ["FSDP1Engine", "full_state_dict_context"]
