"""From per-rank records to the published figures: summary, ratios against targets, table, JSON, markdown, plot.

All pure functions of the records (no processes), so the arithmetic is tested on its own.

Definitions:

- **model state** of a rank: parameters + gradients + optimizer state it holds, measured from the real tensors;
  **floor** = unsharded model state / shard degree + FSDP padding per rank (padding is shown separately);
- **traffic** of one optimizer step: logical bytes of the collectives per mesh axis (``shard`` = inside the shard
  group, ``replicate`` = across replicas, ``other`` = any other group), measured / textbook formula over all axes,
  and whether every (axis, operation) count equals the formula's;
- **collectives by group size**: calls per step grouped by the size of the process group (the latency proxy);
- **step time** of a configuration: for every timed step the slowest rank's time, then the median over all timed
  steps of all rounds; ratios are ratios of those medians (targets apply to them). The same ratio of per-step
  CPU time (mean over ranks) is shown for information: it measures work rather than waiting, so it moves much less
  when other programs share the cores.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.settings import ConfigSpec, Settings, build_configs, hybrid_degree
from lightning_smp.accounting import render
from lightning_smp.names import (
    FULL_SHARD,
    HYBRID_SHARD,
    HYBRID_SHARD_ZERO2,
    NO_SHARD,
    OTHER_AXIS,
    REPLICATE_AXIS,
    SHARD_AXIS,
    SHARD_GRAD_OP,
)

#: Targets the suite checks on every run (name -> bound, all "at most" except traffic which is "equal").
TARGETS = {
    "memory measured / floor": 1.01,
    "traffic measured / formula": 1.000,
    "wrapper overhead: smp_hybrid / plain-torch HSDP": 1.03,
    "memory callback overhead: on / off": 1.02,
}

#: Said next to every timing figure.
GLOO_NOTE = (
    "Timing on CPU with gloo is biased against FSDP: gloo implements reduce-scatter as a full all-reduce, and four"
    " single-threaded ranks share the cores. Bytes and counts are exact on any backend; step times from GPU nodes"
    " with NCCL (`--large`) are the ones that say how fast hybrid sharding is."
)

MIB = 1024 * 1024


# ---------------------------------------------------------------------------------------------- per-rank figures


def traffic(record: dict[str, Any]) -> dict[str, Any]:
    """Traffic figures of one rank's measured step: bytes per axis, ratio to the formula, counts by group size."""
    measured = record.get("comm") or {}
    book = record.get("comm_textbook") or {}
    sizes = record.get("group_sizes") or {}

    def axis_bytes(source: dict, axis: str) -> int:
        return int(sum(entry["bytes"] for entry in source.get(axis, {}).values()))

    def total(source: dict) -> int:
        return sum(axis_bytes(source, axis) for axis in source)

    counts_match = all(
        measured.get(axis, {}).get(op, {}).get("count", 0) == book.get(axis, {}).get(op, {}).get("count", 0)
        for axis in {*measured, *book}
        for op in {*measured.get(axis, {}), *book.get(axis, {})}
    )
    by_size: dict[str, int] = {}
    for axis, ops in measured.items():
        calls = sum(entry["count"] for entry in ops.values())
        if calls:
            key = str(sizes.get(axis, axis))
            by_size[key] = by_size.get(key, 0) + calls
    measured_total, book_total = total(measured), total(book)
    if book_total:
        ratio: float | None = measured_total / book_total
    else:
        ratio = 1.0 if measured_total == 0 else None  # no formula (one device) or traffic the formula misses
    return {
        "shard_bytes": axis_bytes(measured, SHARD_AXIS),
        "replicate_bytes": axis_bytes(measured, REPLICATE_AXIS),
        "other_bytes": axis_bytes(measured, OTHER_AXIS),
        "shard_textbook_bytes": axis_bytes(book, SHARD_AXIS),
        "replicate_textbook_bytes": axis_bytes(book, REPLICATE_AXIS),
        "traffic_ratio": ratio,
        "counts_match": counts_match,
        "collectives_by_group_size": dict(sorted(by_size.items(), key=lambda kv: (not kv[0].isdigit(), kv[0].zfill(6)))),
    }


def rank_figures(record: dict[str, Any]) -> dict[str, Any]:
    """The published figures of one rank of one run."""
    mem = record["memory"]
    peak = record.get("peak_allocated_bytes")
    return {
        "rank": record["rank"],
        "model_state_bytes": mem["total_bytes"],
        "params_bytes": mem["params_bytes"],
        "grads_bytes": mem["grads_bytes"],
        "optimizer_bytes": mem["optimizer_bytes"],
        "unsharded_bytes": mem["unsharded_total_bytes"],
        "padding_bytes": mem["padding_bytes"],
        "floor_bytes": mem["floor_bytes"],
        "measured_over_floor": mem["measured_over_floor"],
        "shard_degree": mem["shard_degree"],
        **traffic(record),
        "step_ms": 1000 * statistics.median(record["step_times"]) if record["step_times"] else None,
        "peak_rss_bytes": record.get("peak_rss_bytes"),
        "start_rss_bytes": record.get("start_rss_bytes"),
        "peak_allocated_bytes": peak,
        "threads": record.get("threads"),
    }


# ---------------------------------------------------------------------------------------------- per configuration


def slowest_rank_steps(records: Sequence[dict[str, Any]], key: str = "step_times") -> list[float]:
    """For every round and timed step, the slowest rank's step time (seconds), in order.

    ``key="step_cpu_times"``: the same for CPU time, averaged over the ranks instead (CPU time is per process work,
    not a wait for the slowest rank).
    """
    by_round: dict[int, list[list[float]]] = {}
    for record in records:
        by_round.setdefault(record.get("round", 0), []).append(record.get(key) or [])
    steps: list[float] = []
    for round_index in sorted(by_round):
        ranks = by_round[round_index]
        pick = max if key == "step_times" else (lambda values: sum(values) / len(values))
        steps += [pick(times) for times in zip(*ranks)]
    return steps


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (0.0, 0.0)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def summarise_config(spec: ConfigSpec, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One configuration: per-rank figures (memory and traffic of the first round, peak RSS over all rounds) and
    the step time over all rounds."""
    first_round = min(r.get("round", 0) for r in records)
    ranks = [rank_figures(r) for r in sorted(records, key=lambda r: r["rank"]) if r.get("round", 0) == first_round]
    for figures in ranks:
        peaks = [r.get("peak_rss_bytes") or 0 for r in records if r["rank"] == figures["rank"]]
        figures["peak_rss_bytes"] = max(peaks)
        figures["step_ms"] = 1000 * statistics.median(
            [t for r in records if r["rank"] == figures["rank"] for t in r["step_times"]] or [0.0]
        )
    # memory and traffic must not depend on the round: they are exact counts of the same computation
    stable = all(
        rank_figures(r)["model_state_bytes"] == ranks[r["rank"]]["model_state_bytes"]
        and rank_figures(r)["shard_bytes"] == ranks[r["rank"]]["shard_bytes"]
        and rank_figures(r)["replicate_bytes"] == ranks[r["rank"]]["replicate_bytes"]
        for r in records
    )
    steps = slowest_rank_steps(records)
    q1, q3 = _quartiles(steps)
    median = statistics.median(steps) if steps else None
    cpu_steps = slowest_rank_steps(records, "step_cpu_times")
    return {
        "name": spec.name,
        "kind": spec.kind,
        "degree": spec.degree,
        "memory_callback": spec.memory_callback,
        "sharding_strategy": records[0]["sharding_strategy"],
        "ranks": ranks,
        "rounds": len({r.get("round", 0) for r in records}),
        "timed_steps": len(steps),
        "step_ms": None if median is None else 1000 * median,
        "step_iqr_ms": [1000 * q1, 1000 * q3],
        "step_cpu_ms": 1000 * statistics.median(cpu_steps) if cpu_steps else None,
        "max_measured_over_floor": max(f["measured_over_floor"] for f in ranks),
        "traffic_ratios": sorted({f["traffic_ratio"] for f in ranks}, key=lambda v: (v is None, v or 0)),
        "counts_match": all(f["counts_match"] for f in ranks),
        "stable_across_rounds": stable,
    }


def _ratio(name: str, configs: dict[str, dict], numerator: str, denominator: str,
           target: float | None = None) -> dict[str, Any] | None:
    if numerator not in configs or denominator not in configs:
        return None
    a, b = configs[numerator], configs[denominator]
    value = a["step_ms"] / b["step_ms"] if a["step_ms"] and b["step_ms"] else None
    cpu = a["step_cpu_ms"] / b["step_cpu_ms"] if a.get("step_cpu_ms") and b.get("step_cpu_ms") else None
    timed = min(a["timed_steps"], b["timed_steps"])
    return {
        "name": name, "numerator": numerator, "denominator": denominator, "value": value, "cpu_value": cpu,
        "target": target,
        "timed_steps": timed, "ok": None if target is None or value is None else value <= target,
    }


def timing_ratios(settings: Settings, configs: dict[str, dict]) -> list[dict[str, Any]]:
    """The step-time ratios the report publishes, with targets where the project sets one."""
    degrees = sorted({c["degree"] for c in configs.values() if c["degree"] is not None})
    main = hybrid_degree(settings.world_size, degrees)
    ratios = []
    for degree in degrees:
        # the target is set for hybrid sharding; degree 1 (NO_SHARD) and degree = world (FULL_SHARD) are shown too
        hybrid = 1 < degree < settings.world_size
        label = "plain-torch HSDP" if hybrid else f"plain-torch {NO_SHARD if degree == 1 else FULL_SHARD}"
        target = TARGETS["wrapper overhead: smp_hybrid / plain-torch HSDP"] if hybrid else None
        ratios.append(_ratio(f"wrapper overhead d={degree}: smp_hybrid / {label}", configs,
                             f"smp_hybrid d={degree}", f"torch_hsdp d={degree}", target))
    if main is not None:
        ratios += [
            _ratio(f"memory callback overhead d={main}: on / off", configs, f"smp_hybrid d={main} +memory callback",
                   f"smp_hybrid d={main}", TARGETS["memory callback overhead: on / off"]),
            _ratio(f"smp_hybrid d={main} / DDP", configs, f"smp_hybrid d={main}", "ddp"),
            _ratio(f"smp_hybrid d={main} / Lightning FULL_SHARD", configs, f"smp_hybrid d={main}", "lightning_fsdp"),
        ]
    world = settings.world_size
    if main != world:
        ratios.append(_ratio(f"smp_hybrid d={world} / Lightning FULL_SHARD (both FULL_SHARD)", configs,
                             f"smp_hybrid d={world}", "lightning_fsdp"))
    ratios += [_ratio(f"smp_hybrid_zero2 d={d} / smp_hybrid d={d}", configs, f"smp_hybrid_zero2 d={d}",
                      f"smp_hybrid d={d}") for d in degrees]
    return [r for r in ratios if r is not None]


def summarise(settings: Settings, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Everything the report publishes, from all records of a run."""
    configs: dict[str, dict] = {}
    for spec in build_configs(settings):
        mine = [r for r in records if r["config"] == spec.name]
        if mine:
            configs[spec.name] = summarise_config(spec, mine)
    ratios = timing_ratios(settings, configs)
    floors = [c["max_measured_over_floor"] for c in configs.values()]
    traffic_values = [v for c in configs.values() for v in c["traffic_ratios"]]
    checks = [
        {"name": "memory measured / floor", "value": max(floors) if floors else None,
         "target": TARGETS["memory measured / floor"], "ok": bool(floors) and max(floors) <= TARGETS["memory measured / floor"]},
        {"name": "traffic measured / formula", "value": traffic_values[-1] if len(set(traffic_values)) == 1 else None,
         "target": TARGETS["traffic measured / formula"],
         "ok": bool(traffic_values) and all(v is not None and round(v, 3) == 1.0 for v in traffic_values)
         and all(c["counts_match"] for c in configs.values())},
    ]
    checks += [{"name": r["name"], "value": r["value"], "target": r["target"], "ok": r["ok"]}
               for r in ratios if r["target"] is not None]
    return {"configs": list(configs.values()), "ratios": ratios, "checks": checks}


# ---------------------------------------------------------------------------------------------- presentation


def _mib(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value / MIB:.{digits}f}"


def _x(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _sizes(by_size: dict[str, int]) -> str:
    return ", ".join(f"{n}x{size}" if size.isdigit() else f"{n} {size}" for size, n in by_size.items()) or "-"


RANK_HEADER = [
    "configuration", "FSDP", "rank", "state MiB", "floor MiB", "state/floor", "padding B", "shard MiB/step",
    "replica MiB/step", "traffic/formula", "calls x group", "step ms", "peak RSS MiB",
]

SUMMARY_HEADER = [
    "configuration", "FSDP", "state MiB/rank", "state/floor (max)", "shard MiB/step", "replica MiB/step",
    "traffic/formula", "calls x group", "step ms (median, IQR)", "vs DDP", "peak RSS MiB/rank",
]

#: Short names of FSDP's sharding strategies for the tables.
SHORT_STRATEGY = {HYBRID_SHARD_ZERO2: "HYBRID_ZERO2", HYBRID_SHARD: "HYBRID", SHARD_GRAD_OP: SHARD_GRAD_OP,
                  FULL_SHARD: FULL_SHARD, NO_SHARD: NO_SHARD, "DDP": "(DDP)"}


def has_cuda_peaks(summary: dict[str, Any]) -> bool:
    """Whether the run measured CUDA memory (``--large`` on GPUs): the tables then get a "peak CUDA" column."""
    return any(f.get("peak_allocated_bytes") is not None for c in summary["configs"] for f in c["ranks"])


def rank_header(summary: dict[str, Any]) -> list[str]:
    return RANK_HEADER + (["peak CUDA alloc MiB"] if has_cuda_peaks(summary) else [])


def summary_header(summary: dict[str, Any]) -> list[str]:
    return SUMMARY_HEADER + (["peak CUDA alloc MiB/rank"] if has_cuda_peaks(summary) else [])


def rank_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The per-configuration-and-rank table (one row per rank)."""
    cuda = has_cuda_peaks(summary)
    rows = []
    for c in summary["configs"]:
        for f in c["ranks"]:
            rows.append([
                c["name"], SHORT_STRATEGY.get(c["sharding_strategy"], c["sharding_strategy"]), str(f["rank"]), _mib(f["model_state_bytes"]), _mib(f["floor_bytes"]),
                _x(f["measured_over_floor"]), f"{f['padding_bytes']:.0f}", _mib(f["shard_bytes"]),
                _mib(f["replicate_bytes"]), _x(f["traffic_ratio"]) + ("" if f["counts_match"] else " (counts differ)"),
                _sizes(f["collectives_by_group_size"]), _x(f["step_ms"], 1), _mib(f["peak_rss_bytes"], 0),
            ] + ([_mib(f["peak_allocated_bytes"], 0)] if cuda else []))
    return rows


def summary_rows(summary: dict[str, Any]) -> list[list[str]]:
    """One row per configuration: ranges over ranks where ranks differ."""
    ddp = next((c for c in summary["configs"] if c["kind"] == "ddp"), None)
    cuda = has_cuda_peaks(summary)
    rows = []

    def span(values: Iterable[float], fmt: Any) -> str:
        values = list(values)
        lo, hi = min(values), max(values)
        return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"

    for c in summary["configs"]:
        ranks = c["ranks"]
        vs_ddp = c["step_ms"] / ddp["step_ms"] if ddp and ddp["step_ms"] and c["step_ms"] else None
        q1, q3 = c["step_iqr_ms"]
        traffic_text = ", ".join(_x(v) for v in c["traffic_ratios"]) + ("" if c["counts_match"] else " (counts differ)")
        rows.append([
            c["name"], SHORT_STRATEGY.get(c["sharding_strategy"], c["sharding_strategy"]), span((f["model_state_bytes"] for f in ranks), _mib),
            _x(c["max_measured_over_floor"]), span((f["shard_bytes"] for f in ranks), _mib),
            span((f["replicate_bytes"] for f in ranks), _mib), traffic_text,
            _sizes(ranks[0]["collectives_by_group_size"]), f"{_x(c['step_ms'], 1)} ({q1:.1f}-{q3:.1f})",
            _x(vs_ddp, 2), span((f["peak_rss_bytes"] for f in ranks), lambda v: _mib(v, 0)),
        ] + ([span((f["peak_allocated_bytes"] or 0 for f in ranks), lambda v: _mib(v, 0))] if cuda else []))
    return rows


def ratio_rows(summary: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in summary["ratios"]:
        verdict = "-" if r["ok"] is None else ("met" if r["ok"] else "MISSED")
        target = "-" if r["target"] is None else f"<= {r['target']:.2f}"
        rows.append([r["name"], _x(r["value"]), target, verdict, _x(r.get("cpu_value")), str(r["timed_steps"])])
    return rows


RATIO_HEADER = ["step-time ratio", "wall time", "target", "verdict", "CPU time (info)", "timed steps (each side)"]


def check_rows(summary: dict[str, Any]) -> list[list[str]]:
    rows = []
    for check in summary["checks"]:
        op = "==" if check["name"].startswith("traffic") else "<="
        rows.append([check["name"], _x(check["value"]), f"{op} {check['target']:.3f}", "met" if check["ok"] else "MISSED"])
    return rows


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def describe_settings(settings: Settings, parameters: int) -> str:
    m = settings.model
    return (
        f"TinyGPT ({parameters / 1e6:.2f} M parameters: {m.layers} blocks of width {m.dim}, {m.heads} heads, vocabulary"
        f" {m.vocab_size}, sequences of {m.block_size}), AdamW, batch {settings.batch_size} per rank, precision"
        f" {settings.precision}, {settings.world_size} ranks ({settings.backend}); every configuration run"
        f" {settings.rounds} times interleaved (A B C ... A B C ...), each run {settings.warmup} warm-up step(s) and"
        f" {settings.steps} timed steps; memory and traffic measured on the last warm-up step."
    )


def describe_machine(machine: dict[str, Any]) -> str:
    gpu = ", ".join(machine.get("gpus") or []) or "no GPU"
    load = machine.get("load_average")
    load_text = f"; 1-minute load average {load[0]:.2f} at the start" if load else ""
    end = machine.get("load_average_end")
    load_text += f", {end[0]:.2f} at the end" if load and end else ""
    return (
        f"{machine.get('cpu_count')} CPU cores ({machine.get('cpu_model') or 'unknown CPU'}), {gpu}; Python"
        f" {machine.get('python')}, torch {machine.get('torch')}, lightning {machine.get('lightning')}{load_text}."
    )


def to_markdown(summary: dict[str, Any], settings: Settings, machine: dict[str, Any], command: str,
                plot_name: str | None = None) -> str:
    """The results page: command, machine, settings, the summary, the targets, the ratios and the per-rank table."""
    parts = [
        f"# lightning_smp benchmarks ({settings.mode} mode)",
        f"Command: `{command}`  \nMachine: {describe_machine(machine)}  \nDate: {machine.get('date')}",
        describe_settings(settings, summary.get("parameters", settings.model.parameter_count())),
        "## Per configuration",
        _markdown_table(summary_header(summary), summary_rows(summary)),
        ("*state*: model state (parameters + gradients + AdamW state) a rank holds, measured from the real tensors;"
        " *floor*: unsharded state / shard degree + FSDP padding (padding per rank in the table at the end)."
        " *shard* / *replica MiB/step*: logical bytes of the collectives of one optimizer step inside the shard"
        " group / across replicas (all-gather: gathered size; reduce-scatter: input size; all-reduce: tensor size);"
        " *traffic/formula*: measured bytes over the textbook formula, with every (axis, operation) call count"
        " equal to the formula's unless marked; *calls x group*: collectives per step by process-group size (the"
        " latency proxy). *step ms*: for every timed step the slowest rank's time, median over all rounds (IQR in"
        " brackets)."),
        "## Targets",
        _markdown_table(["figure", "value", "target", "verdict"], check_rows(summary)),
        "## Step-time ratios",
        _markdown_table(RATIO_HEADER, ratio_rows(summary)),
        ("*wall time*: ratio of the median step times (the targets apply to it). *CPU time*: the same ratio of the"
        " ranks' CPU time per step, for information; it counts work rather than waiting, so it moves less when other"
        " programs share the machine."),
        f"> {GLOO_NOTE}",
    ]
    if plot_name:
        parts.append(f"![model-state bytes per rank by degree]({plot_name})")
    parts += ["## Per configuration and rank", _markdown_table(rank_header(summary), rank_rows(summary))]
    return "\n\n".join(parts) + "\n"


def print_tables(summary: dict[str, Any], settings: Settings) -> None:
    """Print the per-rank table, the targets and the ratios with the library's table renderer."""
    render.print_tables(
        [
            (f"Per configuration and rank ({settings.mode} mode, {settings.world_size} ranks)", rank_header(summary),
             rank_rows(summary)),
            ("Targets", ["figure", "value", "target", "verdict"], check_rows(summary)),
            ("Step-time ratios", RATIO_HEADER, ratio_rows(summary)),
        ],
        left=("configuration", "FSDP", "figure", "step-time ratio"), width=180, footer=GLOO_NOTE,
    )


def plot_memory(summary: dict[str, Any], settings: Settings, path: Path) -> Path:
    """Draw per-rank model-state memory by degree (``smp_hybrid``, ZeRO-2, plain-torch HSDP, the floor, DDP and
    Lightning FULL_SHARD for reference) into ``path`` (PNG, matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in summary["configs"] if not c["memory_callback"]]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    styles = {"smp_hybrid": ("o", -0.12), "smp_hybrid_zero2": ("s", 0.0), "torch_hsdp": ("^", 0.12)}
    degrees = sorted({c["degree"] for c in configs if c["degree"] is not None})
    positions = {d: i for i, d in enumerate(degrees)}
    for kind, (marker, offset) in styles.items():
        xs, ys = [], []
        for c in configs:
            if c["kind"] != kind:
                continue
            for f in c["ranks"]:
                xs.append(positions[c["degree"]] + offset + 0.02 * (f["rank"] - (settings.world_size - 1) / 2))
                ys.append(f["model_state_bytes"] / MIB)
        if xs:
            ax.scatter(xs, ys, marker=marker, s=22, label=f"{kind} (each rank)", zorder=3)
    floors = {}
    for c in configs:
        if c["kind"] == "smp_hybrid":
            floors[c["degree"]] = max(f["floor_bytes"] for f in c["ranks"]) / MIB
    if floors:
        xs = [positions[d] for d in sorted(floors)]
        ax.plot(xs, [floors[d] for d in sorted(floors)], "k--", lw=1, label="floor: unsharded / degree + padding")
    for kind, style, label in (("ddp", ":", "DDP (each rank)"), ("lightning_fsdp", "-.", "Lightning FULL_SHARD")):
        ref = next((c for c in configs if c["kind"] == kind), None)
        if ref:
            ax.axhline(max(f["model_state_bytes"] for f in ref["ranks"]) / MIB, ls=style, lw=1, color="grey", label=label)
    ax.set_xticks(range(len(degrees)), [str(d) for d in degrees])
    ax.set_xlabel("hybrid_shard_degree")
    ax.set_ylabel("model state per rank (MiB)\nparameters + gradients + AdamW state")
    ax.set_title(f"Model state per rank by degree ({settings.world_size} ranks, {settings.model.parameter_count() / 1e6:.2f} M parameters)",
                 fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


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
