"""``python -m lightning_smp.generate``: write what is written from the declarations of the options
(:mod:`lightning_smp.config.options`, :class:`~lightning_smp.config.keys.SMPConfig`) into the source tree, after an
option or an SMP key is added or changed:

- both strategies' constructors: their option parameters, typed and with their defaults (what static type checkers
  and IDEs read), and the options' entries of their docstrings;
- the documentation's tables: ``docs/configuration.md``'s table of the strategies' options and its table of SMP keys,
  ``docs/fault-tolerance.md``'s table of the ``fault_tolerance`` keys, ``docs/replica-sync.md``'s of the
  ``replica_sync`` keys.

A tool, not a runtime concern: nothing in the package checks these texts when it is imported (at run time the
signatures and docstrings come from the declarations themselves: :func:`lightning_smp.frontend.with_options`), and
``tests/test_how_to_add.py`` holds every generated text equal to what this writes. It prints what it rewrote and
warns of nothing.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

from lightning_smp.config.keys import IMPLEMENTED, KEY_DOCS, UNIMPLEMENTED_KEYS, SMPConfig
from lightning_smp.config.options import (
    DOC_BEGIN,
    DOC_END,
    GENERATED_BEGIN,
    GENERATED_END,
    GENERATED_IN,
    SMP_ARGUMENTS,
    StrategyOptions,
    arguments_doc,
    declarations,
    option_fields,
    option_names,
)

#: The package, and the checkout it is in (the documentation is written there).
PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent
#: Each generated table's name (between its markers) and the page that holds it.
TABLES: dict[str, Path] = {"strategy options": Path("docs") / "configuration.md",
                           "smp keys": Path("docs") / "configuration.md",
                           "fault tolerance keys": Path("docs") / "fault-tolerance.md",
                           "replica sync keys": Path("docs") / "replica-sync.md"}


def table_begin(name: str) -> str:
    return f"<!-- generated: {name} (python -m lightning_smp.generate) -->"


def table_end(name: str) -> str:
    return f"<!-- end of generated: {name} -->"


# ------------------------------------------------------------------------------------------------ constructors


def _type_source(kind: Any) -> str:
    """``kind`` (a declaration's annotation: source text, or a type built at run time) as source text."""
    if isinstance(kind, str):
        return kind
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Literal:
        return "Literal[" + ", ".join(json.dumps(a) for a in args) + "]"
    if args and (isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union):
        return " | ".join(_type_source(a) for a in args)
    return kind.__name__


def _annotation_source(declared: Field, record: type[StrategyOptions]) -> str:
    if declared.name in SMP_ARGUMENTS:  # (None: from the configuration sources, as the declarations type it)
        kind = _type_source(declared.metadata.get("parsed_as") or SMPConfig.__annotations__[declared.name])
        return kind if kind.endswith("| None") else f"{kind} | None"
    return _type_source(next(vars(k)["__annotations__"][declared.name] for k in record.__mro__
                             if declared.name in vars(k).get("__annotations__", {})))


def signature_source(indent: str, positional: Sequence[str], record: type[StrategyOptions] = StrategyOptions) -> str:
    """The option parameters of a strategy constructor as source lines (between :data:`GENERATED_BEGIN` and
    :data:`GENERATED_END`), ``positional`` (the options that are positional parameters of the Lightning base class,
    in its order) first, then ``*`` and the rest, keyword-only, each with its type and default."""
    every = {f.name: f for f in (*IMPLEMENTED, *option_fields(record))}
    defaults = {name: default for name, _, default, _ in declarations(record)}

    def line(name: str) -> str:
        default = defaults[name]
        text = json.dumps(default) if isinstance(default, str) else repr(default)
        return f"{indent}{name}: {_annotation_source(every[name], record)} = {text},"

    rest = [name for name in option_names(record) if name not in positional]
    return "\n".join([f"{indent}{GENERATED_BEGIN}", *map(line, positional), f"{indent}*,", *map(line, rest),
                      f"{indent}{GENERATED_END}"])


def docstring_source(indent: str, record: type[StrategyOptions] = StrategyOptions) -> str:
    """The options' entries of a strategy's ``Arguments:`` section, between :data:`DOC_BEGIN` and :data:`DOC_END`."""
    return "\n".join([f"{indent}{DOC_BEGIN}", arguments_doc(indent, record), f"{indent}{DOC_END}"])


def generated_part(source: str, begin: str = GENERATED_BEGIN, end: str = GENERATED_END) -> tuple[str, str]:
    """``(indent, text)``: the generated lines of ``source`` from the line ``begin`` to the line ``end``."""
    lines = source.splitlines()
    first = next(i for i, text in enumerate(lines) if text.strip() == begin)
    last = next(i for i, text in enumerate(lines) if text.strip() == end)
    indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())]
    return indent, "\n".join(lines[first:last + 1])


def write_constructors(package: Path, positional: Sequence[str],
                       record: type[StrategyOptions] = StrategyOptions) -> list[Path]:
    """Rewrite the generated option parameters and docstring entries of every module of :data:`GENERATED_IN` in
    ``package``; returns the modules changed."""
    changed = []
    for name in GENERATED_IN:
        path = package / name
        source = original = path.read_text()
        indent, old = generated_part(source)
        source = source.replace(old, signature_source(indent, positional, record))
        indent, old = generated_part(source, DOC_BEGIN, DOC_END)
        source = source.replace(old, docstring_source(indent, record))
        if source != original:
            path.write_text(source)
            changed.append(path)
    return changed


def lightning_positional() -> tuple[str, ...]:
    """The options that are positional parameters of Lightning's FSDP strategies (Trainer's and Fabric's alike), in
    their order: the strategies keep their place, as drop-in replacements."""
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDP
    from lightning.pytorch.strategies import FSDPStrategy as TrainerFSDP

    names = set(option_names())
    found = {tuple(p.name for p in inspect.signature(base.__init__).parameters.values()
                   if p.name in names and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
             for base in (TrainerFSDP, FabricFSDP)}
    if len(found) != 1:
        raise RuntimeError(f"Lightning's FSDP strategies take different positional options: {found}")
    return found.pop()


# ------------------------------------------------------------------------------------------------ the tables


_ROLE = re.compile(r":(?:class|mod|func|meth|data|attr):`~?([^`]+)`")


def markdown(text: str) -> str:
    """A declaration's documentation (reStructuredText roles and literals) as Markdown in a table cell."""
    text = _ROLE.sub(lambda m: f"`{m.group(1).rsplit('.', 1)[-1] if m.group(0).count('~') else m.group(1)}`", text)
    return text.replace("``", "`").replace("|", "\\|")


def options_table(record: type[StrategyOptions] = StrategyOptions) -> str:
    """Every option a strategy takes beyond Lightning's own arguments: its name, where it acts
    (:data:`~lightning_smp.names.ActsIn`), type, default and meaning."""
    rows = ["| option | set by | acts in | type | default | what it does |", "|---|---|---|---|---|---|"]
    every = {f.name: f for f in (*IMPLEMENTED, *option_fields(record))}
    for name, _, default, doc in declarations(record):
        kind = _annotation_source(every[name], record).replace("|", "or")
        source = "the argument, or any configuration source" if name in SMP_ARGUMENTS else "the argument"
        acts_in = ", ".join(every[name].metadata["acts_in"]).replace("_", " ")
        rows.append(f"| `{name}` | {source} | {acts_in} | `{kind}` | `{default!r}` | {markdown(doc)} |")
    return "\n".join(rows)


def keys_table() -> str:
    """Every key of SMP v2's config: implemented here (the front ends that act on it) or not (what a value does)."""
    rows = ["| key | front ends that act on it | what it does |", "|---|---|---|"]
    for declared in fields(SMPConfig):
        name = declared.name
        acting = () if name in UNIMPLEMENTED_KEYS else declared.metadata["front_ends"]
        where = ", ".join(_FRONT_ENDS[end] for end in acting) or "(not implemented)"
        rows.append(f"| `{name}` | {where} | {markdown(KEY_DOCS[name])} |")
    return "\n".join(rows)


_FRONT_ENDS = {"trainer": "the Trainer's strategy", "fabric": "Fabric's", "init": "`init()`"}


def attribute_docs(record: type) -> dict[str, str]:
    """The entries of the ``Attributes:`` section of ``record``'s (Google-style) docstring, by name, each on one
    line."""
    doc = inspect.getdoc(record) or ""
    entries: dict[str, str] = {}
    for line in doc.split("Attributes:\n", 1)[-1].splitlines():
        entry = re.match(r" {4}(\w+): (.*)", line)
        if entry:
            entries[entry.group(1)] = entry.group(2)
        elif line.startswith(" " * 8) and entries:
            entries[next(reversed(entries))] += " " + line.strip()
        else:
            break
    return entries


def record_table(record: type) -> str:
    """The keys of an option whose value is a mapping, from its record (a dataclass whose docstring's
    ``Attributes:`` say what each means): name, type, default and meaning."""
    meanings = attribute_docs(record)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for declared in fields(record):
        default = "(required)" if declared.default is MISSING else f"`{declared.default!r}`"
        kind = _type_source(declared.type).replace("|", "or")
        rows.append(f"| `{declared.name}` | `{kind}` | {default} | {markdown(meanings[declared.name])} |")
    return "\n".join(rows)


def fault_tolerance_table() -> str:
    """The keys of ``fault_tolerance=`` (:class:`~lightning_smp.config.fault_tolerance.FaultTolerance`)."""
    from lightning_smp.config.fault_tolerance import FaultTolerance

    return record_table(FaultTolerance)


def replica_sync_table() -> str:
    """The keys of ``replica_sync=`` (:class:`~lightning_smp.config.replica_sync.ReplicaSync`)."""
    from lightning_smp.config.replica_sync import ReplicaSync

    return record_table(ReplicaSync)


def table(name: str) -> str:
    return {"strategy options": options_table, "smp keys": keys_table,
            "fault tolerance keys": fault_tolerance_table, "replica sync keys": replica_sync_table}[name]()


def write_tables(checkout: Path) -> list[Path]:
    """Rewrite every generated table (:data:`TABLES`) under ``checkout``; returns the pages changed."""
    changed = []
    for page in dict.fromkeys(TABLES.values()):
        path = checkout / page
        text = original = path.read_text()
        for name in (name for name, where in TABLES.items() if where == page):
            begin, end = table_begin(name), table_end(name)
            start, stop = text.index(begin) + len(begin), text.index(end)
            text = text[:start] + "\n" + table(name) + "\n" + text[stop:]
        if text != original:
            path.write_text(text)
            changed.append(path)
    return changed


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_smp.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, default=CHECKOUT, help="the source tree (default: this package's)")
    args = parser.parse_args(argv)
    changed = [*write_constructors(args.checkout / "lightning_smp", lightning_positional()),
               *write_tables(args.checkout)]
    print("\n".join(f"rewrote {path}" for path in changed) or "everything written from the declarations is current")


if __name__ == "__main__":
    main()


__all__ = [
    "TABLES",
    "attribute_docs",
    "fault_tolerance_table",
    "record_table",
    "replica_sync_table",
    "docstring_source",
    "generated_part",
    "keys_table",
    "lightning_positional",
    "main",
    "markdown",
    "options_table",
    "signature_source",
    "table",
    "table_begin",
    "table_end",
    "write_constructors",
    "write_tables",
]
