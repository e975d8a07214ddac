"""Every field of every record the library hands a user is documented where the user reads about it, each list
derived from the code (the records' dataclass fields, a report's real keys, the strategy properties the memory
callback reads), so that a field added without its documentation fails here."""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import fields
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

import lightning_smp
from lightning_smp.callbacks import memory as memory_callback
from lightning_smp.config.fault_tolerance import FaultTolerance
from lightning_smp.config.keys import IMPLEMENTED, KEY_DOCS
from lightning_smp.config.replica_sync import ReplicaSync
from lightning_smp.planner.result import DegreePlan, Plan

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: the SMP keys whose value is a mapping, and the record that holds it (test_every_mapping_option_is_listed_here
#: fails for one not listed)
MAPPING_OPTIONS = {"fault_tolerance": FaultTolerance, "replica_sync": ReplicaSync}


def _table_names(text: str, header: str) -> list[str]:
    """The names in the first column of the Markdown table whose header row starts with ``header`` (each in
    backticks; ``*`` stands for any part of a name)."""
    rows = []
    for line in text[text.index(header):].splitlines()[2:]:  # (after the header and its rule)
        if not line.startswith("|"):
            break
        rows.append(line)
    return [name for row in rows for name in re.findall(r"`([\w*]+)`", row.split("|")[1])]


def _rst_table_names(doc: str) -> list[str]:
    """The names in the first column of the reStructuredText table of ``doc`` (each in double backticks; a cell
    ends at two spaces, and a line that starts with spaces continues the cells above)."""
    border = next(line for line in doc.splitlines() if line.startswith("===="))
    table = doc[doc.index(border) + len(border):doc.rindex(border)]
    return [name for line in table.splitlines() if line[:1] not in ("", " ")
            for name in re.findall(r"``([\w*]+)``", re.split(r"\s{2,}", line, maxsplit=1)[0])]


def _undocumented(names: list[str], documented: list[str]) -> list[str]:
    return [name for name in names if not any(fnmatch(name, pattern) for pattern in documented)]


def test_the_table_readers_find_what_they_read():
    text = "intro\n| field | meaning |\n|---|---|\n| `a`, `b_*_c` | x `not_me` |\n| `d` | y |\n\nafter `e`\n"
    assert _table_names(text, "| field |") == ["a", "b_*_c", "d"]
    assert _undocumented(["a", "b_x_c", "d", "e"], ["a", "b_*_c", "d"]) == ["e"]
    doc = "Fields:\n\n=====  ====\n``a``, ``b``  x ``no``\n``c``  y\n=====  ====\n"
    assert _rst_table_names(doc) == ["a", "b", "c"]


def test_every_mapping_option_is_listed_here():
    assert sorted(f.name for f in IMPLEMENTED if str(f.type).startswith("dict")) == sorted(MAPPING_OPTIONS)


@pytest.mark.parametrize("option", sorted(MAPPING_OPTIONS))
def test_every_key_of_a_mapping_option_is_in_its_documentation_and_the_configuration_tables(option):
    """The option's declared documentation (the strategies' docstrings, `--smp.help`) and both tables of
    docs/configuration.md name every key of its record (replica_sync's once lacked ``backup``)."""
    page = (DOCS / "configuration.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith(f"| `{option}` |")]
    assert len(rows) == 2  # the strategies' options, and SMP's keys
    for key in (f.name for f in fields(MAPPING_OPTIONS[option])):
        assert f"``{key}``" in KEY_DOCS[option], key
        assert all(f"`{key}`" in row for row in rows), key


def _memory_record() -> dict:
    """A real record of the memory report (one process), with the optional parts that exist under options set."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    (record,) = lightning_smp.memory_report(model, [optimizer], print_table=False, checkpoint_staging_bytes=0,
                                            replica_sync_bytes=0, replica_sync_backup="device")
    return record


def test_every_field_of_a_memory_report_record_is_documented_in_both_places():
    """docs/memory-report.md's "Record fields" table and the callback's docstring (help(MemorySavingsCallback)) each
    name every key of a record."""
    keys = sorted(_memory_record())
    page = (DOCS / "memory-report.md").read_text()
    assert _undocumented(keys, _table_names(page, "| field | meaning |")) == []
    assert _undocumented(keys, _rst_table_names(memory_callback.__doc__ or "")) == []


def _read_from_the_strategy() -> list[str]:
    """The names the memory callback reads from the strategy (``getattr(strategy, "name", ...)``)."""
    tree = ast.parse(inspect.getsource(memory_callback))
    return sorted({node.args[1].value for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                   and isinstance(node.args[0], ast.Name) and node.args[0].id == "strategy"
                   and isinstance(node.args[1], ast.Constant)})


def test_every_strategy_property_the_memory_report_reads_is_public_and_documented():
    """What the report reads of a strategy is a documented property of both strategies, named in the docs."""
    from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy

    names = _read_from_the_strategy()
    assert {"replica_sync_bytes", "replica_sync_backup", "checkpoint_staging_bytes"} <= set(names)
    pages = " ".join(path.read_text() for path in DOCS.glob("*.md"))
    for name in names:
        for strategy in (lightning_smp.HybridShardFSDPStrategy, FabricStrategy):
            attribute = inspect.getattr_static(strategy, name)
            assert isinstance(attribute, property) and inspect.getdoc(attribute), (strategy, name)
        assert f"strategy.{name}`" in pages or f"`{name}`" in pages, name


@pytest.mark.parametrize("record", [Plan, DegreePlan], ids=lambda record: record.__name__)
def test_every_field_of_the_plan_is_documented(record):
    """docs/planner.md's tables of the plan's fields (what `--json` writes) name every field of Plan and
    DegreePlan, and DegreePlan's docstring each of its own."""
    page = (DOCS / "planner.md").read_text()
    names = [f.name for f in fields(record)]
    assert _undocumented(names, _table_names(page, f"| field of `{record.__name__}` |")) == []
    if record is DegreePlan:
        assert [name for name in names if not re.search(rf"\b{name}\b", record.__doc__ or "")] == []
