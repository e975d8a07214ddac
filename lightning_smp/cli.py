"""``lightning-smp``: LightningCLI with the strategy names registered and an SMP ``smp:`` section.

Three ways to set the degree in a config (``lightning-smp fit --config FILE``), all with command-line overrides:

.. code-block:: yaml

    trainer:
      strategy: smp_hybrid        # a registered name ...
    smp:
      hybrid_shard_degree: 2      # ... configured by SMP's own keys (--smp.hybrid_shard_degree=4)

.. code-block:: yaml

    trainer:
      strategy:
        class_path: lightning_smp.HybridShardFSDPStrategy
        init_args:
          hybrid_shard_degree: 2  # --trainer.strategy.init_args.hybrid_shard_degree=4

Precedence: the strategy's ``init_args`` (constructor arguments) > the ``smp:`` section > ``lightning_smp.init``
> ``LIGHTNING_SMP_CONFIG`` / ``SM_HP_MP_PARAMETERS``. ``--print_config`` prints the config with
``smp.hybrid_shard_degree`` set to the degree that will run (``auto`` stays ``auto``: the planner chooses when the
model is set up; ``lightning-smp plan --config FILE`` shows its choice). The ``smp:`` section is exported to the
environment of the ranks the strategy starts (see :mod:`lightning_smp.config`).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Any, cast

from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

import lightning_smp  # noqa: F401  (registers the strategy names before parsing)
from lightning_smp.config import ENV_CLI, configured_degree, set_cli_config
from lightning_smp.config.section import add_smp_section, section_values
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.strategy import HybridShardFSDPStrategy

_PRINT_CONFIG = "--print_config"
_PRINT_FLAGS = {"skip_default": "skip_default", "skip_unset": "skip_unset", "skip_null": "skip_unset",
                "comments": "with_comments"}


class HybridShardCLI(LightningCLI):
    """:class:`~lightning.pytorch.cli.LightningCLI` plus an ``smp:`` section holding SMP v2 config keys.

    The section is checked like every other SMP source (unknown keys, wrong types and unsupported SMP
    features raise :class:`~lightning_smp.HybridShardConfigError`) and becomes the degree of every
    ``HybridShardFSDPStrategy`` that is not given one explicitly, in this process and the ranks it starts.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        add_smp_section(parser)  # (the same argument as lightning-smp plan's)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        flags, stripped = _split_print_config(args)
        if flags is None:
            super().parse_arguments(parser, args)
            self._apply_smp_section()
            return
        try:
            # with --print_config found, the arguments are a command line (see _split_print_config)
            self.config = parser.parse_args(cast(list[str], stripped))
        except SystemExit:
            # an incomplete config (e.g. no model yet): let jsonargparse print it as it is
            super().parse_arguments(parser, args)
            raise
        self._apply_smp_section()
        self._print_resolved_config(flags)

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        # the smp: section configures lightning_smp's strategies only: under another one its keys would be ignored
        smp = section_values(self._section().get("smp"))
        strategy = self.trainer.strategy
        if smp and not isinstance(strategy, HybridShardFSDPStrategy):
            raise HybridShardConfigError(
                f"the smp: section sets {', '.join(sorted(smp))}, but trainer.strategy is"
                f" {type(strategy).__name__}, not a lightning_smp strategy: those keys would be silently ignored."
                " Fix: --trainer.strategy smp_hybrid (or smp_hybrid_fsdp2, smp_hybrid_zero2; a"
                " lightning_smp.HybridShardFSDPStrategy class_path), or remove the smp: keys."
            )

    # ------------------------------------------------------------------ the smp: section

    def _section(self) -> Any:
        subcommand = self.config.get("subcommand")
        return self.config[subcommand] if subcommand else self.config

    def _apply_smp_section(self) -> None:
        section = self._section()
        smp = section_values(section.get("smp"))
        set_cli_config(smp)
        explicit = _explicit_degree(section)
        smp = smp or {}
        if explicit is not None and "hybrid_shard_degree" in smp and smp["hybrid_shard_degree"] != explicit:
            warnings.warn(
                f"trainer.strategy.init_args.hybrid_shard_degree={explicit} overrides"
                f" smp.hybrid_shard_degree={smp['hybrid_shard_degree']} (constructor arguments take precedence).",
                UserWarning,
                stacklevel=2,
            )

    def _print_resolved_config(self, flags: list[str]) -> None:
        section = self._section().clone()
        degree = configured_degree(explicit=_explicit_degree(section))
        # the keys that are set, and the degree that will run, so that the printed config reproduces the run
        section["smp"] = {**(section_values(section.get("smp")) or {}), "hybrid_shard_degree": degree}
        kwargs = {_PRINT_FLAGS[f]: True for f in flags if f}
        sys.stdout.write(self._parser(self.config.get("subcommand")).dump(section, skip_unset=False, **kwargs))
        sys.exit(0)


def _split_print_config(args: ArgsType) -> tuple[list[str] | None, ArgsType]:
    """Remove ``--print_config[=flags]`` from command-line ``args``; return its flags (None: not given)."""
    if args is not None and not isinstance(args, (list, tuple)):
        return None, args  # a dict or Namespace: no command line
    argv = list(sys.argv[1:] if args is None else args)
    for i, arg in enumerate(argv):
        if arg == _PRINT_CONFIG or arg.startswith(_PRINT_CONFIG + "="):
            flags = arg.partition("=")[2].split(",")
            unknown = [f for f in flags if f and f not in _PRINT_FLAGS]
            if unknown:
                return None, args  # jsonargparse reports it
            return flags, argv[:i] + argv[i + 1:]
    return None, args


def _explicit_degree(section: Any) -> int | None:
    """``trainer.strategy.init_args.hybrid_shard_degree`` when the strategy is a ``HybridShardFSDPStrategy``."""
    strategy = section.get("trainer", {}).get("strategy") if hasattr(section, "get") else None
    class_path = getattr(strategy, "class_path", None) if not isinstance(strategy, (str, type(None))) else None
    if not class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if not (isinstance(cls, type) and issubclass(cls, HybridShardFSDPStrategy)):
        return None
    init_args = getattr(strategy, "init_args", None)
    return None if init_args is None else init_args.get("hybrid_shard_degree")


#: The subcommands beside the Trainer's (LightningCLI's ``fit``, ``validate``, ``test``, ``predict``): name, what it does,
#: and its entry point (``module:function`` taking the remaining arguments).
OWN_SUBCOMMANDS = {
    "plan": ("choose hybrid_shard_degree from the model and the memory budget, without training",
             "lightning_smp.planner.cli:main"),
    "lighthouse": ("run the lighthouse of fault-tolerant replica groups (fault_tolerance=)",
                   "lightning_smp.fault_tolerance.lighthouse:main"),
}


def overview() -> str:
    """What ``lightning-smp --help`` says first: every subcommand."""
    rows = [("fit, validate, test, predict", "the Lightning Trainer's (LightningCLI), with the typed smp: section"),
            *((name, what) for name, (what, _) in OWN_SUBCOMMANDS.items())]
    names = ",".join(["fit", "validate", "test", "predict", *OWN_SUBCOMMANDS])
    return (f"usage: lightning-smp {{{names}}} ...\n\nsubcommands (add one, then --help, for its arguments):\n"
            + "".join(f"  {name:<30} {what}\n" for name, what in rows) + "\n")


def main(args: ArgsType = None) -> None:
    """Entry point of ``lightning-smp`` and ``python -m lightning_smp``: ``fit``, ``validate``, ``test``, ``predict``,
    ``plan`` (:mod:`lightning_smp.planner.cli`: choose the degree without training) and ``lighthouse``
    (:mod:`lightning_smp.fault_tolerance.lighthouse`)."""
    argv = list(sys.argv[1:] if args is None else args) if args is None or isinstance(args, (list, tuple)) else None
    if argv and argv[0] in OWN_SUBCOMMANDS:
        module, _, function = OWN_SUBCOMMANDS[argv[0]][1].partition(":")
        getattr(importlib.import_module(module), function)(argv[1:])
        return
    if argv is not None and (not argv or argv[0] in ("-h", "--help")):
        sys.stdout.write(overview())  # then LightningCLI's own help, of the Trainer's subcommands
    previous = os.environ.get(ENV_CLI)
    try:
        HybridShardCLI(args=args)
    except HybridShardConfigError as err:
        sys.exit(f"lightning-smp: error: {err}")
    finally:
        # the section is this run's; do not leak it into whatever runs next in the process
        if previous is None:
            os.environ.pop(ENV_CLI, None)
        else:
            os.environ[ENV_CLI] = previous


__all__ = ["OWN_SUBCOMMANDS", "HybridShardCLI", "main", "overview"]
