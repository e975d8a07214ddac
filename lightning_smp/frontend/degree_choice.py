"""Both front ends' ``hybrid_shard_degree="auto"``: the planner run on every rank from the real model when it is set
up, its table logged, the mesh of the chosen degree built; and the warnings about the degree and the planner's keys.
What chooses is :meth:`lightning_smp.core.HybridShardCore.choose_degree` (:mod:`lightning_smp.planner`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module

from lightning_smp.core import HybridShardCore
from lightning_smp.degree import Layout


class DegreeChoice:
    """Mixin of :class:`~lightning_smp.frontend.HybridShardFrontEnd`: the degree's choice and its warnings."""

    core: HybridShardCore
    _activation_checkpointing_kwargs: dict[str, Any]  # Lightning's FSDP strategies, Trainer's and Fabric's alike
    _warned_override = False
    #: the planner's options already warned about (each once: a user who set two hears of both)
    _warned_unused: frozenset[str] = frozenset()

    _set_up_mesh: Callable[[int, int, str], Layout | None]  # HybridShardFrontEnd's
    _checkpoint_activations: Callable[[Module], None]  # HybridShardFrontEnd's

    def _warn_override_once(self, layout: Layout | None) -> None:
        if layout is not None and layout.overridden and not self._warned_override:
            self._warned_override = True
            rank_zero_warn(layout.override_message())
        config = self.core.config  # from any source
        for key, value in (("memory_budget", config.memory_budget), ("links", config.links)):
            if value is not None and not self.core.auto and key not in self._warned_unused:
                self._warned_unused = self._warned_unused | {key}
                rank_zero_warn(f"{key}={value} is used only with hybrid_shard_degree='auto';"
                               f" hybrid_shard_degree={self.core.configured_degree} is in effect. Fix: drop {key},"
                               " or set hybrid_shard_degree='auto'.")

    def _choose_degree(self, module: Module, *, num_nodes: int, devices: int, device: torch.device, precision: str,
                       micro_batches: int, optimizers: Sequence[Any] = (), training: bool = True) -> None:
        """``hybrid_shard_degree="auto"``: plan on every rank from the real model (before it is sharded; its
        ``example_input_array`` traced, with the strategy's activation checkpointing), log the table, then build the
        mesh of the chosen degree."""
        if not self.core.auto or self.core.chosen is not None:
            return
        chosen = self.core.choose_degree(
            module, num_nodes=num_nodes, devices=devices, device=device, precision=precision,
            example_input=getattr(module, "example_input_array", None),
            checkpoint=self._checkpoint_activations if self._activation_checkpointing_kwargs else None,
            micro_batches=micro_batches, optimizer=self._optimizer_for_plan(module, optimizers), training=training)
        rank_zero_info(f"{type(self).__name__}: hybrid_shard_degree='auto' chose {chosen.degree}.\n{chosen.text()}")
        if chosen.activation_checkpointing:
            # nothing fitted without it: the planner checkpointed the FSDP units (auto_wrap_policy's classes), and
            # so does the sharding that follows
            classes = tuple(self.core.engine_options["auto_wrap_policy"])
            self._activation_checkpointing_kwargs = {"check_fn": lambda submodule: isinstance(submodule, classes)}
        layout = self._set_up_mesh(num_nodes, devices, device.type)
        if layout is not None:
            self._warn_override_once(layout)

    def _optimizer_for_plan(self, module: Module, optimizers: Sequence[Any] = ()) -> Any:
        """The optimizer the planner assumes: the one given, else the LightningModule's ``configure_optimizers``
        (best effort: it may need what does not exist yet), else AdamW, saying so."""
        from lightning_smp.planner import optimizer_name

        try:
            return optimizer_name(optimizers[0] if optimizers else module)
        except Exception as err:  # noqa: BLE001  # a user hook run early, or an optimizer without a known layout
            rank_zero_warn(f"hybrid_shard_degree='auto': the planner could not read the optimizer ({err}); it"
                           " assumes AdamW (two state tensors per parameter).")
            return "adamw"


__all__ = ["DegreeChoice"]
