"""The results files of a run: ``<mode>.json`` (settings, machine, summary, every record), ``<mode>.md`` and the
plot; the figures come from :mod:`benchmarks.figures`, their text from :mod:`benchmarks.tables` and the plot from
:mod:`benchmarks.plot`."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.figures import TARGETS
from benchmarks.plot import plot_memory
from benchmarks.settings import Settings
from benchmarks.tables import GLOO_NOTE, to_markdown


def _nonzero(comm: dict | None) -> dict | None:
    if comm is None:
        return None
    kept = {axis: {op: e for op, e in ops.items() if e.get("count") or e.get("bytes")} for axis, ops in comm.items()}
    return {axis: ops for axis, ops in kept.items() if ops}


def _compact(record: dict[str, Any]) -> dict[str, Any]:
    """A record without its all-zero collective entries (absent means zero everywhere in this module)."""
    return {**record, "comm": _nonzero(record.get("comm")), "comm_textbook": _nonzero(record.get("comm_textbook"))}


def write_results(summary: dict[str, Any], records: Sequence[dict[str, Any]], settings: Settings,
                  machine: dict[str, Any], command: str, out: Path, plot: bool = True) -> dict[str, Path]:
    """Write ``<mode>.json``, ``<mode>.md`` and the plot into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    plot_name = None
    if plot:
        plot_name = "memory_by_degree.png" if settings.mode == "quick" else f"memory_by_degree_{settings.mode}.png"
        paths["png"] = plot_memory(summary, settings, out / plot_name)
    paths["json"] = out / f"{settings.mode}.json"
    payload = {
        "version": 1, "command": command, "machine": machine, "settings": settings.as_dict(),
        "parameters": settings.model.parameter_count(), "targets": TARGETS, "note": GLOO_NOTE, **summary,
        "records": [_compact(r) for r in records],
    }
    paths["json"].write_text(json.dumps(payload, indent=1, default=str) + "\n")
    paths["md"] = out / f"{settings.mode}.md"
    paths["md"].write_text(to_markdown(summary, settings, machine, command, plot_name))
    return paths


def write_small_results(output: Path, result: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """A one-table benchmark's end: print ``render(result)`` and write it to ``output`` with ``.md``, every figure
    with ``.json``; returns ``result``."""
    text = render(result)
    print(text)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(result, indent=1))
    output.with_suffix(".md").write_text("```\n" + text + "\n```\n")
    return result
