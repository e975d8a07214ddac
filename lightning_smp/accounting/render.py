"""The one table renderer: rich tables for terminals, notebooks and logs, shared by the memory report and the
benchmarks. Plain text (for logs and tests) is the same tables rendered without colour."""

from __future__ import annotations

import io
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from lightning_smp.engines.textbook import OPS
from lightning_smp.names import BACKUP_CPU, REPLICATE_AXIS

#: Each table: (title, header, rows); every cell a string.
TableSpec = tuple[str, Sequence[str], Sequence[Sequence[str]]]


#: What a table shows for a figure the engine cannot give (it does not take the accounting role)
NOT_AVAILABLE = "n/a"


def _ratio(value: float | None, spec: str) -> str:
    return NOT_AVAILABLE if value is None else format(value, spec)


def fmt_bytes(value: float | None) -> str:
    """``1536`` -> ``"1.50 KiB"``; ``None`` (not available) -> ``"n/a"``."""
    if value is None:
        return NOT_AVAILABLE
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    return str(value)


def build_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]],
                left: Sequence[str] = ()) -> Table:
    """A rich table; columns named in ``left`` are left-aligned, numbers right-aligned."""
    table = Table(title=title)
    for column in header:
        table.add_column(column, justify="left" if column in left else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _console(width: int | None = None, file: io.StringIO | None = None) -> Console:
    if file is not None:
        return Console(file=file, width=width or 200, color_system=None, force_terminal=False)
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, width or 140))  # logs and notebooks: do not wrap every cell
    return console


def print_tables(tables: Sequence[TableSpec], left: Sequence[str] = (), width: int | None = None,
                 footer: str | None = None) -> None:
    """Print every table that has rows (and ``footer``) on the terminal or in the notebook."""
    console = _console(width)
    for title, header, rows in tables:
        if rows:
            console.print(build_table(title, header, rows, left))
    if footer:
        console.print(footer)


def tables_text(tables: Sequence[TableSpec], left: Sequence[str] = (), width: int | None = None) -> str:
    """The same tables as plain text."""
    buffer = io.StringIO()
    console = _console(width, buffer)
    for title, header, rows in tables:
        if rows:
            console.print(build_table(title, header, rows, left))
    return buffer.getvalue().rstrip("\n")


# ---------------------------------------------------------------------------------------------- the memory report


def memory_rows(records: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and one row per rank of the memory table."""
    header = ["rank", "params", "grads", "optimizer", "total", "unsharded", "saved", "floor", "measured/floor", "peak"]
    # host memory of background checkpoint saves (async_save), a column only where they run
    staging = any(r.get("checkpoint_staging_bytes") is not None for r in records)
    if staging:
        header.append("ckpt staging")
    # replica_sync's outer loop (the synced copy and the outer momentum), a column only where it runs
    outer = any(r.get("replica_sync_bytes") is not None for r in records)
    if outer:
        header.append("replica sync")
    rows = []
    for r in records:
        peak = r["peak_allocated_bytes"] if r["peak_allocated_bytes"] is not None else r["peak_rss_bytes"]
        rows.append([
            str(r["rank"]), fmt_bytes(r["params_bytes"]), fmt_bytes(r["grads_bytes"]), fmt_bytes(r["optimizer_bytes"]),
            fmt_bytes(r["total_bytes"]), fmt_bytes(r["unsharded_total_bytes"]),
            f"{fmt_bytes(r['saved_bytes'])} ({_ratio(r['saved_ratio'], '.1%')})", fmt_bytes(r["floor_bytes"]),
            _ratio(r["measured_over_floor"], ".3f"), fmt_bytes(peak),
            *([fmt_bytes(r.get("checkpoint_staging_bytes") or 0)] if staging else []),
            *([fmt_bytes(r.get("replica_sync_bytes") or 0)
               + (f" ({BACKUP_CPU})" if r.get("replica_sync_backup") == BACKUP_CPU else "")]
              if outer else []),
        ])
    return header, rows


#: Marks a measured count that differs from the textbook count on an axis the textbook covers.
MISMATCH_MARK = "≠"


def comm_mismatches(record: dict) -> list[tuple[str, str]]:
    """``(axis, op)`` pairs whose measured count differs from the textbook count, on the axes the textbook covers
    (the ``"other"`` axis holds Lightning's own reductions, which no textbook predicts)."""
    measured, book = record.get("comm") or {}, record.get("comm_textbook") or {}
    if not measured or not book:
        return []
    sync = record.get("replica_sync")
    if sync:  # (replica_sync: the replicate axis's all-reduces are the sync's, in the counted step or not)
        crossed = sync.get("crossed_in_step", {"all_reduce": sync.get("all_reduces_in_step", 0)})
        crossing = {op: {"count": crossed.get(op, 0)} for op in ("all_reduce", "all_gather", "other")}
        book = {**book, REPLICATE_AXIS: {**book.get(REPLICATE_AXIS, {}), **crossing}}
    return [(axis, op) for axis, ops in book.items() for op in OPS
            if measured.get(axis, {}).get(op, {"count": 0})["count"] != ops.get(op, {"count": 0})["count"]]


def comm_rows(records: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows (rank, axis, operation) of the communication table; none when nothing was counted or
    expected. Where a textbook figure exists, an operation it does not list counts 0 (e.g. Lightning's own
    world-group reductions on the ``"other"`` axis); "-" means no figure at all (one device) or nothing counted.
    A measured count that differs from the textbook's is marked :data:`MISMATCH_MARK`."""
    header = ["rank", "axis", "op", "count", "bytes", "textbook count", "textbook bytes", "ring bytes/rank"]
    rows = []
    for r in records:
        measured, book = r.get("comm") or {}, r.get("comm_textbook") or {}
        mismatched = set(comm_mismatches(r))
        sync = r.get("replica_sync")
        if sync and sync["groups"] > 1:
            # (replica_sync: the replicate axis's one all-reduce per sync, amortised over its window; the counted
            # step shows it only if it synced)
            m = measured.get(REPLICATE_AXIS, {}).get("all_reduce", {"count": 0, "bytes": 0})
            count = str(m["count"]) + (f" {MISMATCH_MARK}" if (REPLICATE_AXIS, "all_reduce") in mismatched else "")
            rows.append([str(r["rank"]), REPLICATE_AXIS, f"all_reduce (a sync, every {sync['every']} steps)",
                         count if measured else "-", fmt_bytes(m["bytes"]) if measured else "-",
                         f"1 per {sync['every']} steps", fmt_bytes(sync["bytes"]),
                         f"{fmt_bytes(sync['ring_bytes'])} ({fmt_bytes(sync['ring_bytes'] // sync['every'])}/step)"])
        for axis in dict.fromkeys([*measured, *book]):
            for op in OPS:
                if sync and axis == REPLICATE_AXIS and op == "all_reduce":
                    continue  # (the sync's row above)
                m = measured.get(axis, {}).get(op, {"count": 0, "bytes": 0})
                t = book.get(axis, {}).get(op) or ({"count": 0, "bytes": 0, "ring_bytes": 0} if book else None)
                if not m["count"] and not (t and t["count"]):
                    continue
                count = f"{m['count']} {MISMATCH_MARK}" if (axis, op) in mismatched else str(m["count"])
                rows.append([
                    str(r["rank"]), axis, op, count if measured else "-",
                    fmt_bytes(m["bytes"]) if measured else "-", str(t["count"]) if t else "-",
                    fmt_bytes(t["bytes"]) if t else "-", fmt_bytes(t["ring_bytes"]) if t else "-",
                ])
    return header, rows


def comm_title(records: Sequence[dict]) -> str:
    """The communication table's title: micro-batches and accumulation mode of the step, and what the mark means
    when a count is marked."""
    r0 = records[0]
    mode = f", {r0['gradient_accumulation']}" if r0.get("gradient_accumulation") else ""
    marked = f"; {MISMATCH_MARK}: measured differs from the textbook" if any(map(comm_mismatches, records)) else ""
    return f"Collectives per rank in one optimizer step ({r0.get('backward_passes', 1)} micro-batch(es){mode}){marked}"


def report_tables(records: Sequence[dict]) -> list[TableSpec]:
    """The memory table and the communication table of one report."""
    r0 = records[0]
    strategy = f"{r0['strategy']} ({r0['engine']})" if r0.get("engine") else r0["strategy"]
    sync = r0.get("replica_sync")
    if r0["shard_degree"] is None:  # an engine without the accounting role
        where = f"{strategy}, sharding {NOT_AVAILABLE}"
    elif sync:  # (the engine shards inside each replica group; the groups are the replicate axis, synced apart)
        where = (f"{strategy}, {sync['groups']} replica group(s) x {r0['shard_degree']} shard(s),"
                 f" {r0['sharding_strategy'] or 'no sharding'} inside each; {sync['describe']}")
    else:
        where = (f"{strategy}, {r0['sharding_strategy'] or 'no sharding'}, {r0['replicas']} replica(s) x"
                 f" {r0['shard_degree']} shard(s)")
    return [
        (f"Memory per rank at {r0['stage']} (step {r0['step']}): {where}", *memory_rows(records)),
        (comm_title(records), *comm_rows(records)),
    ]


def format_report(records: Sequence[dict]) -> str:
    """The report as plain text: a memory table and a communication table."""
    return tables_text(report_tables(records), left=("axis", "op"))


def print_report(records: Sequence[dict]) -> None:
    """Print the report's tables with rich."""
    print_tables(report_tables(records), left=("axis", "op"))


__all__ = [
    "build_table",
    "MISMATCH_MARK",
    "comm_mismatches",
    "comm_title",
    "comm_rows",
    "fmt_bytes",
    "format_report",
    "memory_rows",
    "print_report",
    "print_tables",
    "report_tables",
    "tables_text",
]
