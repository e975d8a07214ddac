"""Where an SMP config comes from: the layered sources (defaults, SageMaker's and this library's environment
variables, :func:`lightning_smp.init`, the LightningCLI ``smp:`` section, the constructor argument), each read and
checked, merged with OmegaConf in their precedence (:mod:`lightning_smp.config`), and exported to the environment
for the ranks a job starts."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

from lightning_smp.config.fault_tolerance import ENV_GROUP, ENV_GROUPS, ENV_LIGHTHOUSE, torchft_environment
from lightning_smp.config.keys import SMPConfig, _type_name, check_config
from lightning_smp.errors import HybridShardConfigError

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
#: torchft's own variables, a source of ``fault_tolerance`` (:func:`~lightning_smp.config.fault_tolerance.torchft_environment`)
TORCHFT_SOURCE = f"environment variables {ENV_LIGHTHOUSE}, {ENV_GROUP}, {ENV_GROUPS}"

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


def config_layers(explicit: dict[str, Any] | None = None,
                  cli: Mapping[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Every source that sets something, lowest precedence first, as ``(source label, checked values)``; ``cli``: a
    command line's ``smp:`` section in place of the one a LightningCLI run exports (``lightning-smp plan`` reads its
    own, and no other run's).

    Every source is checked, including those a higher one overrides: a broken setting is never ignored.
    """
    layers: list[tuple[str, dict[str, Any]]] = [(DEFAULT_SOURCE, asdict(SMPConfig()))]
    torchft = torchft_environment()
    for name in (ENV_SAGEMAKER, TORCHFT_SOURCE, ENV_CONFIG, ENV_INIT, ENV_CLI):
        if name == TORCHFT_SOURCE:
            if torchft is not None:
                layers.append((TORCHFT_SOURCE, check_config({"fault_tolerance": torchft}, TORCHFT_SOURCE)))
            continue
        if name == ENV_CLI and cli is not None:
            layers.append((CLI_SOURCE, check_config(dict(cli), CLI_SOURCE)))
            continue
        raw = os.environ.get(name, "")
        if not raw.strip():
            continue
        label, values = _env_layer(name, raw)
        label = {ENV_INIT: INIT_SOURCE, ENV_CLI: CLI_SOURCE}.get(name, label)
        layers.append((label, dict(values)))
    if explicit:
        layers.append((EXPLICIT_SOURCE, check_config(explicit, EXPLICIT_SOURCE)))
    return layers


def resolve_config(explicit: dict[str, Any] | None = None, cli: Mapping[str, Any] | None = None) -> SMPConfig:
    """Merge every source (see the module docstring for the order) into one :class:`SMPConfig` with OmegaConf;
    ``cli``: as :func:`config_layers` takes it."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(SMPConfig),
                             *(values for _, values in config_layers(explicit, cli)))
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
    "CLI_SOURCE",
    "DEFAULT_SOURCE",
    "ENV_CLI",
    "ENV_CONFIG",
    "ENV_INIT",
    "ENV_SAGEMAKER",
    "EXPLICIT_SOURCE",
    "INIT_SOURCE",
    "TORCHFT_SOURCE",
    "config_layers",
    "config_source",
    "configured_degree",
    "load_config",
    "read_config_file",
    "resolve_config",
    "set_cli_config",
    "set_init_config",
]
