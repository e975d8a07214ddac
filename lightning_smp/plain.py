"""``lightning_smp.init()``: SMP's ``torch.sagemaker.init()`` for plain PyTorch FSDP scripts.

An SMP v2 script calls ``torch.sagemaker.init(config)`` once and then wraps its model with an unchanged
``FSDP(model, sharding_strategy=..., ...)`` call; SMP makes that call shard inside groups of
``hybrid_shard_degree`` ranks. :func:`init` does the same with plain ``torch.distributed`` (e.g. under
``torchrun``)::

    dist.init_process_group("gloo")  # or "nccl"
    lightning_smp.init({"hybrid_shard_degree": 2})  # or a JSON/YAML path, or nothing: read the environment
    model = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=...)  # unchanged

FSDP2 scripts work the same way: after :func:`init`, ``fully_shard(module)`` called without ``mesh=`` shards over the
configured mesh (the 2-D ``(replicate, shard)`` mesh for ``2 <= d < world``, the 1-D shard mesh when one group is the
world, ``(world, 1)`` for degree 1); ``mesh=`` given by the caller always wins, and everything else
(``reshard_after_forward``, ``mp_policy``, ...) stays the caller's. FSDP2 has no ``sync_module_states``: seed every
rank the same, or call :func:`lightning_smp.replicas.broadcast_across_replicas` after sharding.

What is patched for FSDP1, exactly: ``torch.distributed.fsdp.FullyShardedDataParallel.__init__``, and only for
calls that pass neither ``device_mesh`` nor ``process_group``
(a user's own mesh or group always wins, and so do the nested units FSDP's auto-wrapping creates, which
inherit the root's mesh) and that run with an initialised process group and a configured degree other than 0
(0 is SMP's "native PyTorch" setting). Such a call gets:

- ``device_mesh``: the ``(replicate, shard)`` mesh of :func:`lightning_smp.resolve_layout` for the world size,
  built once on the device type of the model (``"cpu"`` under gloo) and reused by later calls;
- ``sharding_strategy``: SMP's rule, as in :class:`~lightning_smp.HybridShardFSDPStrategy`: a degree >= 2
  runs ``HYBRID_SHARD`` (``_HYBRID_SHARD_ZERO2`` if asked for), a degree equal to the world size
  ``FULL_SHARD``, degree 1 ``NO_SHARD`` over all ranks (exactly DDP);
- ``device_id=torch.device("cpu")`` when the model lives on the CPU and none was given (FSDP refuses CPU otherwise);
- replicas that start equal: global rank 0's parameters and buffers are broadcast before wrapping (what DDP
  does), or, for meta-device models, each shard is broadcast across replicas after wrapping.

:func:`shutdown` restores the original ``__init__`` and ``fully_shard``'s default mesh and forgets the configuration; calling :func:`init` twice
only replaces the configuration. The configuration is also what ``HybridShardFSDPStrategy`` reads when it is
given no degree (see :mod:`lightning_smp.config` for the precedence of sources).
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn import Module

from lightning_smp.collectives import release_process_groups_at_exit
from lightning_smp.config import configured_degree, load_config, resolve_config, set_init_config
from lightning_smp.config.keys import refuse_unacted, unacted
from lightning_smp.config.sources import TORCHFT_SOURCE, config_source
from lightning_smp.degree import Layout, resolve_layout
from lightning_smp.engines import ENGINES
from lightning_smp.engines.base import Engine
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.mesh import build_device_mesh
from lightning_smp.names import AUTO, FULL_SHARD, HYBRID_SHARD
from lightning_smp.replicas import broadcast_across_replicas, broadcast_before_wrapping

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

@dataclass
class _Session:
    """What :func:`init` patched and what the patched calls built since, until :func:`shutdown`: one per process."""

    #: undoes the patches (FSDP1's constructor, FSDP2's default mesh)
    restore: Callable[[], None]
    #: one mesh per (mesh shape, device type): building a mesh creates process groups, a collective on every rank.
    #: FSDP calls that differ only in sharding strategy (FULL_SHARD vs SHARD_GRAD_OP units) share one mesh.
    meshes: dict[tuple[tuple[int, int], str], DeviceMesh] = field(default_factory=dict)
    #: the layouts already logged
    logged: set[str] = field(default_factory=set)
    #: the planner's choice for hybrid_shard_degree="auto" (plain FSDP(...) calls), once made
    auto_degree: int | None = None


#: the session :func:`init` opened; ``None`` before it and after :func:`shutdown`
_SESSION: _Session | None = None


def init(config: Mapping[str, Any] | str | os.PathLike | None = None) -> None:
    """Configure SMP hybrid sharding for this process, like ``torch.sagemaker.init(config)``.

    Args:
        config: a dict such as ``{"hybrid_shard_degree": 2}``, a path to a JSON or YAML file, or ``None`` to
            use only the environment (``LIGHTNING_SMP_CONFIG``, then SageMaker's ``SM_HP_MP_PARAMETERS``).
            A given config takes precedence over the environment; ``HybridShardFSDPStrategy(hybrid_shard_degree=...)``
            and a LightningCLI ``smp:`` section take precedence over it.

    Patches ``FullyShardedDataParallel.__init__`` and ``fully_shard``'s default mesh as the module docstring
    describes; :func:`shutdown` undoes both.
    Call it in every process (at the top of a ``torchrun`` script); it does not start a process group.

    Raises:
        HybridShardConfigError: an unknown key, a wrong type, an unsupported SMP feature, a malformed or missing
            file. Every source is checked here, the environment too, so every rank fails the same way.
        UnsupportedOptionError: at the first plain ``FSDP(...)`` call or ``fully_shard`` call without a mesh of its
            own, a key set that only the strategies act on (``async_save``, ``fault_tolerance``: the configuration
            ``init`` gives is also a source of the strategies, which act on them). torchft's own variables are left
            to torchft.
    """
    values = load_config(config)
    set_init_config(values if config is not None else None)
    configured_degree()  # check the environment now, before any collective could hang
    _patch()
    release_process_groups_at_exit()  # as the strategies do: gloo groups left to finalization can hang or abort


def shutdown() -> None:
    """Undo :func:`init`: restore ``FullyShardedDataParallel.__init__`` and ``fully_shard``'s default mesh, and forget
    ``init``'s configuration.

    Process groups built for the meshes are left to ``torch.distributed.destroy_process_group()``. Harmless
    when :func:`init` was never called.
    """
    global _SESSION
    if _SESSION is not None:
        _SESSION.restore()
        _SESSION = None
    set_init_config(None)


def is_initialized() -> bool:
    """Whether :func:`init` has patched FSDP in this process (and :func:`shutdown` has not undone it)."""
    return _SESSION is not None


def _patch() -> None:
    global _SESSION
    if _SESSION is None:
        restores = [engine.patch_plain_calls(_PlainCalls()) for engine in ENGINES]

        def restore() -> None:
            for undo in reversed(restores):
                undo()

        _SESSION = _Session(restore)


def _session() -> _Session:
    """The open session (:func:`_rewrite` and :func:`_default_mesh` check that there is one first)."""
    if _SESSION is None:
        raise RuntimeError("lightning_smp.init() has not been called, or shutdown() has undone it")
    return _SESSION


def _mesh_for(layout: Layout, device_type: str) -> DeviceMesh:
    meshes = _session().meshes
    key = (layout.mesh_shape, device_type)
    if key not in meshes:
        meshes[key] = build_device_mesh(layout, device_type)
    return meshes[key]


class _PlainCalls:
    """:class:`~lightning_smp.engines.base.PlainCalls`: the configured degree applied to the user's own calls."""

    def rewrite(self, engine: Engine, arguments: dict[str, Any]) -> Callable[[Module], None] | None:
        return _rewrite(engine, arguments)

    def default_mesh(self, engine: Engine) -> DeviceMesh | None:
        return _default_mesh(engine)


def _default_mesh(engine: Engine) -> DeviceMesh | None:
    """The mesh a ``fully_shard`` call without ``mesh=`` gets: the configured degree's (``None``: torch's default)."""
    if _SESSION is None or not (dist.is_available() and dist.is_initialized()):
        return None  # (no session: a patch left in place after shutdown() because another came after it)
    _refuse_unacted("a plain fully_shard(...) call")
    degree = configured_degree()
    if degree == 0:
        return None
    if degree == AUTO:
        raise HybridShardConfigError(
            "hybrid_shard_degree='auto' cannot be chosen inside a plain fully_shard(...) call: fully_shard is called"
            " block by block, so no call sees the whole model. Fix: choose with"
            " lightning_smp.plan(model, world_size=..., budget_bytes=...) and configure its .degree, or pass mesh=,"
            f" or train with HybridShardFSDPStrategy(hybrid_shard_degree='auto', fsdp_version={engine.version})."
        )
    # FSDP2 has no sharding strategy to override: the degree alone decides (reshard_after_forward is the caller's)
    layout = resolve_layout(dist.get_world_size(), int(degree), HYBRID_SHARD)
    # fully_shard's own default: the accelerator's device type when there is one, else the CPU
    accelerator = torch.accelerator.current_accelerator()
    device_type = "cpu" if accelerator is None or _gloo_only() else accelerator.type
    _log_once(layout, "fully_shard(...) shards over")
    return engine.mesh_for(_mesh_for(layout, device_type), layout)


def _rewrite(engine: Engine, arguments: dict[str, Any]) -> Callable[[Module], None] | None:
    """Apply the configured degree to one FSDP call's arguments in place; return a post-wrap hook or None."""
    if _SESSION is None or not (dist.is_available() and dist.is_initialized()):
        return None
    _refuse_unacted("a plain FSDP(...) call")
    if arguments.get("device_mesh") is not None or arguments.get("process_group") is not None:
        return None
    degree = configured_degree()
    if degree == 0:
        return None
    from torch.distributed.fsdp import ShardingStrategy

    module: Module = arguments["module"]
    requested = arguments.get("sharding_strategy") or FULL_SHARD  # FSDP's own default
    device = _root_device(module, arguments.get("device_id"))
    if degree == AUTO:
        degree = _auto_degree(engine, module, arguments, requested, device)
    layout = resolve_layout(dist.get_world_size(), int(degree), requested)
    mesh = _mesh_for(layout, device.type)
    _log_once(layout)

    arguments["sharding_strategy"] = ShardingStrategy[layout.sharding_strategy]
    arguments["device_mesh"] = engine.mesh_for(mesh, layout)
    if arguments.get("device_id") is None and device.type == "cpu":
        arguments["device_id"] = device
    # DDP semantics: all replicas train from global rank 0's weights, however the ranks were seeded; units the user
    # wrapped by hand before this outer call (FSDP(layer), enable_wrap/wrap) were synced by their own call, and
    # their shards differ between ranks by design: only the rest is sent
    if broadcast_before_wrapping(module, device, is_shard=engine.is_shard_tensor):
        return None
    return lambda wrapped: broadcast_across_replicas(wrapped, mesh, device)


def _refuse_unacted(what: str) -> None:
    """The configuration's keys that only the strategies act on (``async_save``, ``fault_tolerance``: their
    declaration's ``front_ends``), refused in a plain call; torchft's own variables are left alone (a plain script
    that drives torchft itself sets them for torchft)."""
    config = resolve_config()
    refuse_unacted(config, [key for key in unacted(config, "init") if config_source(key) != TORCHFT_SOURCE], what)


def _auto_degree(engine: Engine, module: Module, arguments: dict[str, Any], requested: Any,
                 device: torch.device) -> int:
    """``hybrid_shard_degree="auto"`` in a plain ``FSDP(model, ...)`` call: planned once, from the outermost call's
    module (inner units that ``auto_wrap_policy`` wraps run inside it and reuse the choice), on every rank alike
    (:func:`~lightning_smp.planner.agree.plan_on_every_rank`)."""
    session = _session()
    if session.auto_degree is None:
        from lightning_smp.collectives import Collectives
        from lightning_smp.planner.agree import plan_on_every_rank

        # the ranks of this node, from the hosts themselves (LOCAL_WORLD_SIZE is torchrun's, not everyone's)
        hosts = Collectives.current(device).all_gather(socket.gethostname())
        local_ranks = hosts.count(socket.gethostname())
        chosen = plan_on_every_rank(
            module, configured_budget=resolve_config().memory_budget, configured_links=resolve_config().links,
            device=device, local_ranks=local_ranks,
            world_size=dist.get_world_size(), devices_per_node=local_ranks, fsdp_version=engine.version,
            auto_wrap_policy=arguments.get("auto_wrap_policy"), sharding_strategy=getattr(requested, "name", requested),
        )
        if dist.get_rank() == 0:
            log.info("lightning_smp.init: hybrid_shard_degree='auto' chose %d.\n%s", chosen.degree, chosen.text())
        session.auto_degree = chosen.degree
    return session.auto_degree


def _gloo_only() -> bool:
    """Whether the default process group runs gloo alone (``"gloo"``, not ``"cuda:nccl,cpu:gloo"``): CPU tensors."""
    return all(part.split(":")[-1] == "gloo" for part in str(dist.get_backend()).split(","))


def _root_device(module: Module, device_id: Any) -> torch.device:
    """The device FSDP will compute on, as FSDP itself would pick it."""
    if isinstance(device_id, torch.device):
        return device_id
    for tensor in module.parameters():
        if tensor.device.type not in ("cpu", "meta"):
            return tensor.device
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is None or (_gloo_only() and device_id is None):
        return torch.device("cpu")
    index = device_id if isinstance(device_id, int) else torch.accelerator.current_device_index()
    return torch.device(accelerator.type, index)


def _log_once(layout: Layout, what: str = "FSDP(...) runs") -> None:
    message = f"lightning_smp.init: {what} {layout.describe()}"
    logged = _session().logged
    if message in logged:
        return
    logged.add(message)
    if dist.get_rank() == 0:
        log.info(message)
        if layout.overridden:
            warnings.warn(layout.override_message(), UserWarning, stacklevel=4)


__all__ = ["init", "is_initialized", "shutdown"]
