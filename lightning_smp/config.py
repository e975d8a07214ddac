"""SMP configuration: where ``hybrid_shard_degree`` comes from when the strategy is not given one.

SageMaker SMP v2 is configured with one JSON dict, e.g. ``{"hybrid_shard_degree": 16}``. This module reads
that dict from every place a job may put it, checks it, and merges the sources with OmegaConf into one
:class:`SMPConfig`. Sources, highest precedence first:

1. the explicit constructor argument ``HybridShardFSDPStrategy(hybrid_shard_degree=...)`` (in a LightningCLI
   YAML that is ``trainer.strategy.init_args.hybrid_shard_degree``);
2. the ``smp:`` section of a LightningCLI config / command line (``lightning-smp``, ``--smp.hybrid_shard_degree``);
3. :func:`lightning_smp.init(config) <lightning_smp.plain.init>` (a dict or a JSON/YAML file);
4. the environment: ``LIGHTNING_SMP_CONFIG`` (a JSON/YAML file path or an inline JSON string), then SageMaker's
   ``SM_HP_MP_PARAMETERS`` (the JSON SageMaker sets from ``distribution={"smdistributed": {"modelparallel":
   {"parameters": {...}}}}``), so an SMP job runs unchanged;
5. the default, ``hybrid_shard_degree=0`` (native FSDP behaviour).

Sources 2 and 3 are also exported to the environment variables :data:`ENV_CLI` and :data:`ENV_INIT`, so that
every rank sees them however it is started (re-run script, fork, spawn, torchrun); they are written by
``lightning-smp`` and :func:`~lightning_smp.plain.init` and are not meant to be set by hand.

Keys SMP defines but this library does not implement are never silently ignored: a value that would change
training (``tensor_parallel_degree: 4``, ``sm_activation_offloading: true``) is an error, a harmless one
(``tensor_parallel_degree: 1``) a warning. Unknown keys are errors with a "did you mean" suggestion. Every
error is a :class:`~lightning_smp.errors.HybridShardConfigError` naming the source and the key.

Above 300 lines for a reason: the rule of every SMP v2 key (its type, when it is an error, the fix) is data
here, next to the one precedence implementation that applies them.
"""

from __future__ import annotations

import difflib
import json
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, make_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, cast, get_type_hints

from lightning_smp.degree import check_degree_setting
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.names import FSDP_VERSIONS

#: A JSON/YAML file path or an inline JSON string with the SMP config (user-facing).
ENV_CONFIG = "LIGHTNING_SMP_CONFIG"
#: Set by SageMaker from the estimator's ``smdistributed.modelparallel.parameters`` (user-facing).
ENV_SAGEMAKER = "SM_HP_MP_PARAMETERS"
#: The checked ``smp:`` section of a LightningCLI run, exported for child processes (internal).
ENV_CLI = "LIGHTNING_SMP_CLI_CONFIG"
#: The checked config of :func:`lightning_smp.init`, exported for child processes (internal).
ENV_INIT = "LIGHTNING_SMP_INIT_CONFIG"

#: Source labels, as they appear in error messages and in :func:`config_source`.
CLI_SOURCE = "LightningCLI `smp:` section"
INIT_SOURCE = "lightning_smp.init(config)"
EXPLICIT_SOURCE = "HybridShardFSDPStrategy(hybrid_shard_degree=...)"
DEFAULT_SOURCE = "default"


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
    from lightning_smp.planner.budget import parse_bytes

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
    from lightning_smp.planner.links import links_for

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


def _parse_text(text: str, where: str, yaml_ok: bool) -> Any:
    if not yaml_ok:
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise HybridShardConfigError(f"{where}: malformed JSON: {err}.") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        detail = " ".join(str(err).split())
        raise HybridShardConfigError(f"{where}: malformed YAML: {detail}.") from None


def read_config_file(path: str | os.PathLike, where: str | None = None) -> dict[str, Any]:
    """Read and check an SMP config file: JSON for ``*.json``, YAML (a superset of JSON) otherwise."""
    path = Path(path)
    label = f"config file {str(path)!r}" + (f" (from {where})" if where else "")
    if not path.is_file():
        raise HybridShardConfigError(f"{label} does not exist. Fix: pass an existing JSON or YAML file.")
    data = _parse_text(path.read_text(), label, yaml_ok=path.suffix.lower() != ".json")
    return check_config(data, label)


def load_config(config: Mapping | str | os.PathLike | None, where: str = INIT_SOURCE) -> dict[str, Any]:
    """Turn ``config`` (a dict, a JSON/YAML file path or an inline JSON string) into checked SMP values."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return check_config(dict(config), where)
    if isinstance(config, str) and config.lstrip().startswith("{"):
        return check_config(_parse_text(config, where, yaml_ok=False), where)
    if isinstance(config, (str, os.PathLike)):
        return read_config_file(config, where if where != INIT_SOURCE else None)
    raise HybridShardConfigError(
        f"{where}: config={config!r} ({_type_name(config)}) must be a dict, a path to a JSON/YAML file or a JSON string."
    )


def _file_version(name: str, raw: str) -> int | None:
    """The config file's modification time, so that editing the file (e.g. between two fits in a notebook)
    is seen although the variable stays the same."""
    if name != ENV_CONFIG or raw.lstrip().startswith("{"):
        return None
    try:
        return os.stat(raw).st_mtime_ns
    except OSError:
        return None  # reading it reports the problem


def _env_layer(name: str, raw: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
    return _env_layer_cached(name, raw, _file_version(name, raw))


@lru_cache(maxsize=32)
def _env_layer_cached(name: str, raw: str, version: int | None) -> tuple[str, tuple[tuple[str, Any], ...]]:
    # cached per value (and file version): configured_degree() runs several times per fit, warnings should not
    where = f"environment variable {name}"
    if name == ENV_CONFIG and not raw.lstrip().startswith("{"):
        return f"config file {raw!r} (from {where})", tuple(read_config_file(raw, where).items())
    return where, tuple(check_config(_parse_text(raw, where, yaml_ok=False), where).items())


def config_layers(explicit: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Every source that sets something, lowest precedence first, as ``(source label, checked values)``.

    Every source is checked, including those a higher one overrides: a broken setting is never ignored.
    """
    layers: list[tuple[str, dict[str, Any]]] = [(DEFAULT_SOURCE, asdict(SMPConfig()))]
    for name in (ENV_SAGEMAKER, ENV_CONFIG, ENV_INIT, ENV_CLI):
        raw = os.environ.get(name, "")
        if not raw.strip():
            continue
        label, values = _env_layer(name, raw)
        label = {ENV_INIT: INIT_SOURCE, ENV_CLI: CLI_SOURCE}.get(name, label)
        layers.append((label, dict(values)))
    if explicit:
        layers.append((EXPLICIT_SOURCE, check_config(explicit, EXPLICIT_SOURCE)))
    return layers


def resolve_config(explicit: dict[str, Any] | None = None) -> SMPConfig:
    """Merge every source (see the module docstring for the order) into one :class:`SMPConfig` with OmegaConf."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(SMPConfig), *(values for _, values in config_layers(explicit)))
    # to_object of a structured config is an instance of its dataclass
    return cast(SMPConfig, OmegaConf.to_object(merged))


def config_source(key: str = "hybrid_shard_degree", explicit: dict[str, Any] | None = None) -> str:
    """The label of the source whose value of ``key`` is in effect (for logs and ``--print_config``)."""
    source = DEFAULT_SOURCE
    for label, values in config_layers(explicit):
        if key in values:
            source = label
    return source


def configured_degree(explicit: int | str | None = None) -> int | str:
    """The ``hybrid_shard_degree`` in effect: ``explicit`` if not ``None``, else the highest configured source.

    ``HybridShardFSDPStrategy`` calls this at ``Trainer(...)`` and again in every rank's ``setup_environment``.
    """
    return resolve_config(None if explicit is None else {"hybrid_shard_degree": explicit}).hybrid_shard_degree


def _export(name: str, values: dict[str, Any] | None) -> None:
    if values is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = json.dumps(values, sort_keys=True)


def set_cli_config(values: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check a LightningCLI ``smp:`` section and make it the CLI source for this process and its children.

    ``None`` removes the CLI source; keys whose value is ``None`` are not set. Returns the checked values.
    """
    if values is None:
        _export(ENV_CLI, None)
        return {}
    checked = check_config({k: v for k, v in values.items() if v is not None}, CLI_SOURCE)
    _export(ENV_CLI, checked)
    return checked


def set_init_config(values: dict[str, Any] | None) -> None:
    """Make already checked ``values`` the :func:`lightning_smp.init` source (``None`` removes it)."""
    _export(ENV_INIT, values)


__all__ = [
    "CALIBRATE",
    "CLI_SOURCE",
    "ENV_CLI",
    "ENV_CONFIG",
    "ENV_INIT",
    "ENV_SAGEMAKER",
    "INIT_SOURCE",
    "KNOWN_KEYS",
    "SMPConfig",
    "SMPSection",
    "check_config",
    "check_fsdp_version",
    "check_async_save",
    "check_links",
    "check_memory_budget",
    "config_layers",
    "config_source",
    "configured_degree",
    "load_config",
    "read_config_file",
    "resolve_config",
    "set_cli_config",
    "set_init_config",
]
