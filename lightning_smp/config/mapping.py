"""The value of an option that is a mapping of typed keys (``fault_tolerance``, ``replica_sync``): every
configuration source may give part of it (the sources merge key by key), so each source's part is checked key by key
here, and the option's record checks the merged whole (``from_mapping``)."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

from lightning_smp.errors import HybridShardConfigError


def did_you_mean(name: Any, known: Collection[str]) -> str:
    """`` Did you mean 'x'?`` for the known name closest to a mistyped ``name`` (an SMP key, a key of a mapping
    option), or nothing when none is close."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def keys_in_words(record: type) -> str:
    """The keys of a mapping option's ``record`` as its documentation names them, from the record's fields (so that
    a key added to it is never left out): the required ones, then "and optionally" the others, each in ``...``."""

    def listed(names: list[str]) -> str:
        quoted = [f"``{name}``" for name in names]
        return " and ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)

    required = [f.name for f in fields(record) if f.default is MISSING and f.default_factory is MISSING]
    optional = [f.name for f in fields(record) if f.name not in required]
    joint = ", and optionally " if len(required) > 1 else " and optionally "
    return listed(required) + (joint + listed(optional) if optional else "")


def typed_items(value: Any, record: type, kinds: Mapping[str, tuple[type, ...]], where: str,
                example: str) -> dict[str, Any] | None:
    """``value`` (a mapping, a ``record``, or ``None``: the option is off) as a plain dict of its keys that are set,
    each of its kind in ``kinds`` (a bool is never taken for a number). Raises :class:`HybridShardConfigError` naming
    ``where`` for anything else: not a mapping (``example`` shows one), an unknown key, a value of another kind."""
    if value is None:
        return None
    if isinstance(value, record) and is_dataclass(value):
        value = {f.name: getattr(value, f.name) for f in fields(value)}
    if not isinstance(value, Mapping):
        raise HybridShardConfigError(f"{where}={value!r} is not a mapping. Fix: e.g. {where}={example}.")
    items: dict[str, Any] = {}
    for key, item in dict(value).items():
        if key not in kinds:
            raise HybridShardConfigError(
                f"{where}: unknown key {key!r}.{did_you_mean(key, kinds)} Known keys: {', '.join(kinds)}.")
        if item is None:
            continue
        allowed = kinds[key]
        if (isinstance(item, bool) and bool not in allowed) or not isinstance(item, allowed):
            raise HybridShardConfigError(
                f"{where}: {key}={item!r} ({type(item).__name__}) is not {' or '.join(k.__name__ for k in allowed)}."
            )
        items[key] = item
    return items


__all__ = ["did_you_mean", "keys_in_words", "typed_items"]
