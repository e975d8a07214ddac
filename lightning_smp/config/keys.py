"""The value of an SMP config: :class:`SMPConfig` (SMP v2's keys, those implemented here with SMP's defaults), the
rule of every key (its type, when it is an error, the fix) and :func:`check_config`, which applies them to one
source's dict. Where the dicts come from and how they merge: :mod:`lightning_smp.config.sources`."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, make_dataclass
from typing import Any, Literal, get_type_hints

from lightning_smp.degree import check_degree_setting
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.links import links_for
from lightning_smp.names import FSDP_VERSIONS
from lightning_smp.sizes import parse_bytes


@dataclass
class SMPConfig:
    """SMP v2's configuration keys: those this library implements with SMP's defaults, the others ``None`` (not set).

    A key this library does not implement may only hold a value that changes nothing (``tensor_parallel_degree: 1``,
    with a warning); any other value is refused by :func:`check_config`, so a resolved config never holds one.

    Attributes:
        hybrid_shard_degree: 0 (native FSDP), 1 (no sharding, DDP-like) or the number of consecutive ranks
            that shard the model together; see :mod:`lightning_smp.degree`.
            ``"auto"``: the planner chooses it when the model is set up (:mod:`lightning_smp.planner`).
        fsdp_version: this library's key (SMP has none): 1 shards with ``FullyShardedDataParallel``, 2 with
            ``fully_shard`` (see :mod:`lightning_smp.engines`).
        memory_budget: this library's key: what one rank's training may use when ``hybrid_shard_degree`` is
            ``"auto"``, in bytes (given as an int or a string such as ``"40GB"``); ``None``: the device's free memory
            (on the CPU, the available RAM divided by the ranks of the node).
        links: this library's key: what the planner of ``hybrid_shard_degree="auto"`` times the step on: a link
            preset name (``lightning_smp.planner.LINK_PRESETS``), a JSON file written by
            ``lightning_smp.planner.save_links``, or ``"calibrate"`` (measured on the job's own process groups when
            the model is set up, every rank alike); ``None``: the default preset.
        async_save: this library's key: write sharded checkpoints in the background (training goes on once the
            state is copied off the training tensors); committed by rename once every rank has written, and
            ``ModelCheckpoint``'s links, removals and logger notifications wait for that commit. See
            ``docs/checkpoints.md``.
        tensor_parallel_degree, context_parallel_degree, expert_parallel_degree: SMP's other parallelisms; only 1.
        sm_activation_offloading: SMP's activation offloading; only ``false``.
        activation_loading_horizon, fsdp_cache_flush_warnings, allow_empty_shards, random_seed: accepted and
            ignored, with a warning.
    """

    hybrid_shard_degree: int | str = 0
    fsdp_version: int = 1
    memory_budget: int | str | None = None
    links: str | None = None
    async_save: bool = False
    tensor_parallel_degree: int | None = None
    context_parallel_degree: int | None = None
    expert_parallel_degree: int | None = None
    sm_activation_offloading: bool | None = None
    activation_loading_horizon: int | None = None
    fsdp_cache_flush_warnings: bool | None = None
    allow_empty_shards: bool | None = None
    random_seed: int | None = None


def _optional_fields(cls: type, name: str, doc: str, types: Mapping[str, Any] | None = None) -> type:
    """``cls`` with every field optional and ``None`` by default: a section in which a key left out is not set.
    ``types`` narrows fields for the parser (OmegaConf, which merges :class:`SMPConfig`, knows no ``Literal``)."""
    hints = {**get_type_hints(cls), **(types or {})}
    section = make_dataclass(name, [(f.name, hints[f.name] | None, None) for f in fields(cls)])
    section.__doc__ = doc
    section.__module__ = __name__
    return section


#: The type of the LightningCLI ``smp:`` section: :class:`SMPConfig`'s keys and types, each optional, so that
#: jsonargparse checks names and types and a key left out is taken from the lower sources.
SMPSection = _optional_fields(
    SMPConfig, "SMPSection",
    "SMP v2 config keys for the LightningCLI `smp:` section (see SMPConfig); a key left out is not set here.",
    {"hybrid_shard_degree": int | Literal["auto"]},
)


def _check_hybrid_shard_degree(value: Any, where: str) -> int | str:
    try:
        return check_degree_setting(value)
    except HybridShardConfigError as err:
        raise HybridShardConfigError(f"{where}: {err}") from None


def check_memory_budget(value: Any, parameter: str = "memory_budget") -> int | None:
    """``value`` in bytes (``None`` stays ``None``: the device's free memory is used)."""
    return None if value is None else parse_bytes(value, parameter)


def _check_memory_budget(value: Any, where: str) -> int | None:
    try:
        return check_memory_budget(value)
    except HybridShardConfigError as err:
        raise HybridShardConfigError(f"{where}: {err}") from None


#: The ``links`` value that measures the links on the running job.
CALIBRATE = "calibrate"


def check_links(value: Any, parameter: str = "links") -> str | None:
    """``value`` if the planner can time on it: ``None``, :data:`CALIBRATE`, a link preset's name or a readable JSON
    file of ``Links``."""
    if value is None or value == CALIBRATE:
        return value
    if not isinstance(value, str):
        raise HybridShardConfigError(
            f"{parameter}={value!r} ({_type_name(value)}) is not a link preset, a JSON file or {CALIBRATE!r}. Fix:"
            f" pass one of those as a string."
        )
    try:
        links_for(value)
    except HybridShardConfigError as err:
        raise HybridShardConfigError(f"{parameter}={value!r}: {err} Or {CALIBRATE!r}.") from None
    return value


def _check_links(value: Any, where: str) -> str | None:
    try:
        return check_links(value)
    except HybridShardConfigError as err:
        raise HybridShardConfigError(f"{where}: {err}") from None


def check_fsdp_version(value: Any, parameter: str = "fsdp_version") -> int:
    """``value`` as an ``int`` if it names an engine: 1 (``FullyShardedDataParallel``) or 2 (``fully_shard``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in FSDP_VERSIONS:
        raise HybridShardConfigError(
            f"{parameter}={value!r} is not an FSDP version. Valid values: {', '.join(map(str, FSDP_VERSIONS))}"
            " (1: FullyShardedDataParallel, 2: fully_shard). Fix: pass 1 or 2."
        )
    return int(value)


def _check_fsdp_version(value: Any, where: str) -> int:
    try:
        return check_fsdp_version(value)
    except HybridShardConfigError as err:
        raise HybridShardConfigError(f"{where}: {err}") from None


def check_async_save(value: Any, parameter: str = "async_save") -> bool:
    """``value`` if it is a boolean (a string such as ``"yes"`` is refused: it would be truthy whatever it says)."""
    if not isinstance(value, bool):
        raise HybridShardConfigError(
            f"{parameter}={value!r} ({_type_name(value)}) is not a boolean. Fix: pass true or false."
        )
    return value


def _check_async_save(value: Any, where: str) -> bool:
    try:
        return check_async_save(value)
    except HybridShardConfigError as err:
        raise HybridShardConfigError(f"{where}: {err}") from None


#: The implemented keys and their checks (return the normalised value; raise ``HybridShardConfigError`` naming
#: ``where``).
IMPLEMENTED_KEYS: dict[str, Callable[[Any, str], Any]] = {
    "hybrid_shard_degree": _check_hybrid_shard_degree,
    "fsdp_version": _check_fsdp_version,
    "memory_budget": _check_memory_budget,
    "links": _check_links,
    "async_save": _check_async_save,
}


@dataclass(frozen=True)
class _Unimplemented:
    """An SMP v2 key this library does not implement: its type, and when a value would change training."""

    kind: type
    changes_training: Callable[[Any], bool]
    why: str
    fix: str
    minimum: int = 0
    #: how to silence the warning for a harmless value
    silence: str = "remove it"


_NO_TP = "this library implements SMP's sharded data parallelism only (no tensor, context or expert parallelism)"

#: Every other key of SMP v2's core-feature config, and what happens when it is given.
UNIMPLEMENTED_KEYS: dict[str, _Unimplemented] = {
    "tensor_parallel_degree": _Unimplemented(
        int, lambda v: v > 1, _NO_TP, "remove it or set it to 1 (use SMP itself for tensor parallelism)", minimum=1
    ),
    "context_parallel_degree": _Unimplemented(
        int, lambda v: v > 1, _NO_TP, "remove it or set it to 1 (use SMP itself for context parallelism)", minimum=1
    ),
    "expert_parallel_degree": _Unimplemented(
        int, lambda v: v > 1, _NO_TP, "remove it or set it to 1 (use SMP itself for expert parallelism)", minimum=1
    ),
    "sm_activation_offloading": _Unimplemented(
        bool,
        lambda v: v,
        "SMP's activation offloading is not implemented, so activations would stay in device memory",
        "remove it, or use activation_checkpointing_policy of HybridShardFSDPStrategy to save activation memory",
    ),
    "activation_loading_horizon": _Unimplemented(
        int, lambda v: False, "it only tunes SMP's activation offloading, which is not implemented", "remove it",
        minimum=1,
    ),
    "fsdp_cache_flush_warnings": _Unimplemented(
        bool, lambda v: False, "SMP's CUDA cache-flush warnings are not implemented", "remove it"
    ),
    "allow_empty_shards": _Unimplemented(
        bool, lambda v: False, "FSDP1 pads flat parameters, so shards are never empty", "remove it"
    ),
    "random_seed": _Unimplemented(
        int,
        lambda v: False,
        "it seeds SMP's tensor/expert-parallel modules, which do not exist here",
        "remove it",
        silence="remove it and seed with lightning.seed_everything() instead",
    ),
}

KNOWN_KEYS = (*IMPLEMENTED_KEYS, *UNIMPLEMENTED_KEYS)
if set(KNOWN_KEYS) != {f.name for f in fields(SMPConfig)}:  # one list of keys: the dataclass and the rules agree
    raise RuntimeError("lightning_smp.config: SMPConfig's fields and the key rules differ")


def _type_name(value: Any) -> str:
    return "boolean" if isinstance(value, bool) else type(value).__name__


def _check_unimplemented(key: str, value: Any, where: str) -> None:
    rule = UNIMPLEMENTED_KEYS[key]
    if rule.kind is bool:
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= rule.minimum
    if not ok:
        expected = "true or false" if rule.kind is bool else f"an integer >= {rule.minimum}"
        raise HybridShardConfigError(
            f"{where}: {key}={value!r} ({_type_name(value)}) is not valid; SMP expects {expected}."
        )
    if rule.changes_training(value):
        raise HybridShardConfigError(
            f"{where}: {key}={value!r} is not supported: {rule.why}. Fix: {rule.fix}."
        )
    warnings.warn(f"{where}: {key}={value!r} is ignored: {rule.why}. To silence this warning: {rule.silence}.",
                  UserWarning, stacklevel=3)


def check_config(values: Any, where: str) -> dict[str, Any]:
    """Check an SMP config dict from ``where``; return only the keys this library implements.

    Raises:
        HybridShardConfigError: not a mapping, an unknown key (with a "did you mean"), a wrong type, or an
            SMP feature whose value would change training. Harmless unimplemented keys only warn.
    """
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise HybridShardConfigError(
            f"{where}: the SMP config must be a mapping such as {{\"hybrid_shard_degree\": 2}}, got"
            f" {_type_name(values)} {values!r}."
        )
    checked: dict[str, Any] = {}
    for key, value in values.items():
        if key in IMPLEMENTED_KEYS:
            checked[key] = IMPLEMENTED_KEYS[key](value, where)
        elif key in UNIMPLEMENTED_KEYS:
            _check_unimplemented(key, value, where)
        else:
            close = difflib.get_close_matches(str(key), KNOWN_KEYS, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise HybridShardConfigError(
                f"{where}: unknown SMP config key {key!r}.{hint} Known keys: {', '.join(KNOWN_KEYS)}."
            )
    return checked


__all__ = [
    "CALIBRATE",
    "IMPLEMENTED_KEYS",
    "KNOWN_KEYS",
    "UNIMPLEMENTED_KEYS",
    "SMPConfig",
    "SMPSection",
    "check_async_save",
    "check_config",
    "check_fsdp_version",
    "check_links",
    "check_memory_budget",
]
