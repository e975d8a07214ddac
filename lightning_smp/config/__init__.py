"""SMP configuration: where ``hybrid_shard_degree`` comes from when the strategy is not given one.

SageMaker SMP v2 is configured with one JSON dict, e.g. ``{"hybrid_shard_degree": 16}``. This module reads
that dict from every place a job may put it, checks it, and merges the sources with OmegaConf into one
:class:`SMPConfig`. Sources, highest precedence first:

1. the explicit constructor argument ``HybridShardFSDPStrategy(hybrid_shard_degree=...)`` (in a LightningCLI
   YAML that is ``trainer.strategy.init_args.hybrid_shard_degree``);
2. the ``smp:`` section of a LightningCLI config / command line (``lightning-smp``, ``--smp.hybrid_shard_degree``);
3. :func:`lightning_smp.init(config) <lightning_smp.plain.init>` (a dict or a JSON/YAML file);
4. the environment: ``LIGHTNING_SMP_CONFIG`` (a JSON/YAML file path or an inline JSON string), then torchft's own
   ``TORCHFT_LIGHTHOUSE``/``REPLICA_GROUP_ID``/``NUM_REPLICA_GROUPS`` (``fault_tolerance`` only), then SageMaker's
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

The value and the rule of every key: :mod:`lightning_smp.config.keys`; the sources and their merging:
:mod:`lightning_smp.config.sources`. This package's names are the public ones of both.
"""

from lightning_smp.config.keys import (
    CALIBRATE,
    KNOWN_KEYS,
    SMPConfig,
    SMPSection,
    check_boolean,
    check_config,
    check_fsdp_version,
    check_links,
    check_memory_budget,
)
from lightning_smp.config.sources import (
    CLI_SOURCE,
    ENV_CLI,
    ENV_CONFIG,
    ENV_INIT,
    ENV_SAGEMAKER,
    INIT_SOURCE,
    config_layers,
    config_source,
    configured_degree,
    load_config,
    read_config_file,
    resolve_config,
    set_cli_config,
    set_init_config,
)

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
    "check_boolean",
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
