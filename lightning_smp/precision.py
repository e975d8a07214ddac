"""The precision plugins of both front ends, in one place: the Trainer's :class:`HybridShardPrecision` and Fabric's
:class:`HybridShardFabricPrecision`, Lightning's FSDP plugins that autocast on the strategy's device type (theirs
hard-code ``"cuda"``), reduce FSDP1's gradients in fp32 under ``*-mixed``, and (the Trainer's) clip norms over the whole
model and check that the gradients were reduced before each step."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from lightning.fabric.plugins.precision.fsdp import FSDPPrecision as FabricFSDPPrecision
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smp.autocast import autocast_context
from lightning_smp.errors import UnsupportedOptionError

if TYPE_CHECKING:
    from lightning_smp.engines.base import Training
    from lightning_smp.engines.unused import Unreduced


def mixed_precision_config(precision: str, lightning_config: Any) -> Any:
    """FSDP1's ``MixedPrecision`` for a Lightning ``precision`` when the user passes none (shared by the Trainer's and
    Fabric's plugins): for ``"*-mixed"``, parameters gathered in the 16-bit type, gradients reduced in fp32, buffers
    and the root's inputs (the batch: targets too) left as they are, autocast casting what each operation computes
    with. DDP's numbers, and FSDP2's setting (``engines/fsdp2_options.py``). Lightning's own config
    (``lightning_config``, kept for ``"*-true"`` and ``"32-true"``) reduces in the 16-bit type and casts the root's
    inputs and the buffers, which DDP under autocast does not: pass it as ``mixed_precision=`` to keep it."""
    if "mixed" not in precision or lightning_config is None:
        return lightning_config
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=lightning_config.param_dtype, reduce_dtype=torch.float32,
                          cast_root_forward_inputs=False)


def scaler_for(scaler: Any, device_type: str) -> Any:
    """``scaler``, or a new ``ShardedGradScaler`` for ``device_type`` when it was made for another device (Lightning's
    default is CUDA's, which disables itself without CUDA). Shared by the Trainer's and Fabric's plugins."""
    if scaler is None or getattr(scaler, "_device", device_type) == device_type:
        return scaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device_type)


class _OnDeviceType:
    """What both precision plugins change of Lightning's: autocast on :attr:`device_type` (Lightning's FSDP plugins
    hard-code ``"cuda"``), and FSDP1's ``*-mixed`` config of :func:`mixed_precision_config`. Listed before the
    Lightning plugin it changes."""

    device_type: str = "cpu"
    precision: Any

    def forward_context(self) -> AbstractContextManager:
        return autocast_context(self.precision, self.device_type) or super().forward_context()  # type: ignore[misc]

    @property
    def mixed_precision_config(self) -> Any:
        return mixed_precision_config(self.precision, super().mixed_precision_config)  # type: ignore[misc]


class HybridShardPrecision(_OnDeviceType, FSDPPrecision):
    """Lightning's :class:`FSDPPrecision` with two fixes that hybrid sharding on any device needs.

    - ``*-mixed`` precision autocasts on :attr:`device_type` (the strategy's root device), where Lightning's
      plugin hard-codes ``"cuda"`` and so fails on CPU.
    - ``gradient_clip_algorithm="norm"`` clips through the engine that sharded :attr:`fsdp_module` (FSDP1:
      ``clip_grad_norm_`` on the root unit): the norm is taken once over the whole model (all shards, counted once
      across replicas), exactly as DDP's ``clip_grad_norm_`` on the full gradients. Lightning's plugin refuses
      norm clipping.

    - before every optimizer step, the engine checks that the last backward reduced the gradients
      (:class:`~lightning_smp.errors.GradientSyncError` otherwise, instead of a step that silently does nothing).
    - ``16-mixed`` gets a loss scaler for that device type (Lightning's is CUDA's, disabled without CUDA).
    - ``*-mixed`` reduces FSDP1's gradients in fp32 and leaves the batch to autocast (:func:`mixed_precision_config`).

    The strategy calls :meth:`set_device_type` when the Trainer is created and sets :attr:`fsdp_module` in ``setup``.
    """

    def __init__(self, precision: Any = "32-true", scaler: Any | None = None) -> None:
        super().__init__(precision, scaler)
        self.device_type: str = "cpu"
        self._fsdp_module: Module | None = None
        self._engine: Training | None = None
        #: ``fault_tolerance``: the average across replica groups of an optimizer's gradients, set by the strategy
        self.reduce_across_groups: Callable[[Optimizer, Unreduced | None], None] | None = None
        self._settled = False  # (fault_tolerance) whether the gradients were settled since the last backward

    @property
    def fsdp_module(self) -> Module | None:
        """The root of the sharded model, set by the strategy in ``setup``; its engine is found once, then."""
        return self._fsdp_module

    @fsdp_module.setter
    def fsdp_module(self, module: Module | None) -> None:
        from lightning_smp.engines import engine_of

        self._fsdp_module = module
        self._engine = engine_of(module) if module is not None else None

    @classmethod
    def from_plugin(cls, plugin: FSDPPrecision) -> HybridShardPrecision:
        """Same precision and scaler as ``plugin``."""
        # not through __init__: Lightning's FSDPPrecision refuses (and would drop) a scaler passed to it
        upgraded = cls(plugin.precision)
        upgraded.scaler = plugin.scaler
        return upgraded

    def set_device_type(self, device_type: str) -> None:
        """Autocast on ``device_type``; a loss scaler made for another device (Lightning's default is CUDA's, which
        disables itself on a machine without CUDA) is replaced by one for ``device_type``."""
        self.device_type = device_type
        self.scaler = scaler_for(self.scaler, device_type)


    @override
    def _after_closure(self, model: Any, optimizer: Any) -> None:  # Lightning: a ``Steppable``
        # before the optimizer sees the gradients: a last backward that ran with reduction still off would leave
        # them None or unreduced, and the step would silently do nothing (or let the replicas drift apart)
        self._settle(optimizer)
        super()._after_closure(model, optimizer)

    def _settle(self, optimizer: Optimizer) -> None:
        """Before the step, and before clipping by norm: the engine's check and DDP's ``.grad`` rule, then
        (``fault_tolerance``) the average across groups, once per backward (clipping in a manual step comes before
        ``optimizer.step()``, and must see the gradients averaged across groups, as DDP's)."""
        module, engine = self._fsdp_module, self._engine
        across = self.reduce_across_groups
        notes = None
        if module is not None and engine is not None and not (across is not None and self._settled):
            # (fault tolerance reduces the unused-parameter notes inside its commit vote: one collective fewer)
            notes = engine.settle_gradients(module, defer_unused=across is not None)
            self._settled = True
        if across is not None:  # after the group's own reduction, before clipping
            across(optimizer, notes)

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        self._settled = False  # (a new backward: its gradients are settled again before the next step or clip)
        return super().pre_backward(tensor, module)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: float | int) -> None:
        if self.reduce_across_groups is not None:
            self._settle(optimizer)  # (fault tolerance: the gradients averaged across groups are clipped, as DDP's)
        super().clip_grad_by_value(optimizer, clip_val)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float | int) -> None:
        if self.reduce_across_groups is not None:
            self._settle(optimizer)  # (fault tolerance: the norm of the gradients averaged across groups, as DDP's)
        module, engine = self._fsdp_module, self._engine
        # the optimizer's parameters, as Lightning and DDP clip (not the whole model's: another optimizer's, or a
        # trainable part that no optimizer steps, must not shrink this optimizer's gradients)
        parameters = list(self.main_params(optimizer))
        if module is None or engine is None or engine.clip_grad_norm(module, float(clip_val), parameters) is None:
            # A model the user wrapped module by module has no single root to clip over: Lightning's refusal.
            super().clip_grad_by_norm(optimizer, clip_val)


class HybridShardFabricPrecision(_OnDeviceType, FabricFSDPPrecision):
    """Fabric's ``FSDPPrecision`` that autocasts on the strategy's device type (Fabric's hard-codes ``"cuda"``),
    for ``16-mixed`` scales the loss with a scaler for that device type, and for ``*-mixed`` reduces FSDP1's gradients
    in fp32 with the batch left to autocast (:func:`lightning_smp.precision.mixed_precision_config`)."""

    @classmethod
    def from_plugin(cls, plugin: FabricFSDPPrecision, device_type: str) -> HybridShardFabricPrecision:
        upgraded = cls(plugin.precision)  # type: ignore[arg-type]  # an FSDPPrecision's precision is one of its own
        upgraded.device_type = device_type
        upgraded.scaler = scaler_for(upgraded.scaler, device_type)
        return upgraded



_Plugin = TypeVar("_Plugin")


class PrecisionSlot(Generic[_Plugin]):
    """The precision-plugin property of both strategies (the Trainer's ``precision_plugin``, Fabric's ``precision``;
    stored where Lightning's own property stores it, ``_<name>``): an ``FSDPPrecision`` (``accepted``) or ``None``,
    anything else refused as Lightning's ``FSDPStrategy`` refuses it (a ``TypeError``), naming the fix; until a
    plugin of kind ``kept`` is set, ``default()``. ``upgrade`` turns Lightning's own ``FSDPPrecision`` into the front
    end's when it is set (the Trainer's; Fabric's waits for the launcher, which knows the device type)."""

    def __init__(self, accepted: type, kept: type, default: Callable[[], _Plugin], *, strategy: str, front_end: str,
                 upgrade: Callable[[Any], _Plugin] | None = None) -> None:
        self.accepted, self.kept, self.default, self.upgrade = accepted, kept, default, upgrade
        self.strategy, self.front_end = strategy, front_end
        self.attribute = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attribute = f"_{name}"

    def __get__(self, strategy: Any, owner: type | None = None) -> _Plugin:
        if strategy is None:  # read on the class (help(), hasattr): the slot itself, as a property is
            return self  # type: ignore[return-value]
        plugin = getattr(strategy, self.attribute, None)
        if not isinstance(plugin, self.kept):
            plugin = self.default()
            setattr(strategy, self.attribute, plugin)
        return plugin  # type: ignore[return-value]  # (kept is the plugin's type)

    def __set__(self, strategy: Any, plugin: Any) -> None:
        if plugin is not None and not isinstance(plugin, self.accepted):
            raise UnsupportedOptionError(
                f"{self.strategy} needs an `FSDPPrecision` plugin, found {type(plugin).__name__}. Fix: pass"
                f" `{self.front_end}(precision=...)` (e.g. '32-true', 'bf16-mixed') instead of a precision plugin, or"
                " an `FSDPPrecision`."
            )
        if self.upgrade is not None and plugin is not None and not isinstance(plugin, self.kept):
            plugin = self.upgrade(plugin)
        setattr(strategy, self.attribute, plugin)


__all__ = ["HybridShardFabricPrecision", "PrecisionSlot", "HybridShardPrecision", "mixed_precision_config", "scaler_for"]
