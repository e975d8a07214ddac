"""The command line's ``smp:`` section: one argument, typed from the declarations, for every command that takes SMP
keys (``lightning-smp fit``/``validate``/``test``/``predict``, LightningCLI's, and ``lightning-smp plan``), and its
values as the library checks them.

jsonargparse merges the section's sources in their order: a config file's ``smp:``, then ``--smp "{...}"`` and
``--smp.KEY VALUE`` (``--smp.replica_sync.every 20`` sets one key of a mapping). A value it cannot type as
:class:`~lightning_smp.config.keys.SMPSection` (an unknown key, a value of another type) reaches
:func:`~lightning_smp.config.keys.check_config` as it was given, which refuses it with the library's error: the
source, the key, the value, a "did you mean" and the fix, the same from every command and every source.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_smp.config.keys import IMPLEMENTED, UNIMPLEMENTED_KEYS, SMPSection, check_config
from lightning_smp.config.sources import CLI_SOURCE
from lightning_smp.errors import HybridShardConfigError

#: The argument's type: the section typed from the declarations, else (a value it refuses) the mapping as given, for
#: :func:`section_values` to refuse with the library's error rather than jsonargparse's usage text.
SECTION_TYPE = SMPSection | dict[str, Any] | None


def section_help() -> str:
    """The ``--smp`` argument's help: how to give it, and every key it takes (from the declarations)."""
    return ("SMP config keys (docs/configuration.md), over the config file's smp: section: a mapping"
            " (--smp \"{hybrid_shard_degree: 2, replica_sync: {every: 20}}\") or one key at a time (--smp.KEY VALUE;"
            " --smp.replica_sync.every 20 sets one key of a mapping); --smp.help documents each. Keys: "
            + ", ".join(f.name for f in IMPLEMENTED)
            + f"; SMP's keys this library does not implement (harmless values only): {', '.join(UNIMPLEMENTED_KEYS)}.")


def add_smp_section(parser: Any) -> None:
    """Add ``--smp`` (the section) to a jsonargparse ``parser``."""
    parser.add_argument("--smp", type=SECTION_TYPE, default=None, help=section_help())


def section_values(parsed: Any, where: str = CLI_SOURCE) -> dict[str, Any] | None:
    """The keys a parsed section sets (a jsonargparse ``Namespace``, the ``SMPSection`` instantiated from one, or the
    mapping jsonargparse could not type), as given; ``None`` without a section. A mapping it could not type is
    refused here with :func:`~lightning_smp.config.keys.check_config`'s error (:class:`HybridShardConfigError`)."""
    if parsed is None:
        return None
    if isinstance(parsed, Mapping):  # (what SMPSection refused: check_config says why)
        check_config(parsed, where)
        raise HybridShardConfigError(
            f"{where}: {dict(parsed)!r} is not a section of SMP keys as the command line types them. Fix: give each"
            " key its documented type (see --help)."
        )
    values = parsed.as_dict() if hasattr(parsed, "as_dict") else vars(parsed)
    return {key: value for key, value in values.items() if value is not None}


__all__ = ["SECTION_TYPE", "add_smp_section", "section_help", "section_values"]
