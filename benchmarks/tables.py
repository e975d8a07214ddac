"""The published figures as text: the tables (printed with the library's renderer) and the markdown page."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from benchmarks.settings import Settings
from lightning_smp.accounting import render
from lightning_smp.names import FULL_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2, NO_SHARD, SHARD_GRAD_OP

#: Said next to every timing figure.
GLOO_NOTE = (
    "Timing on CPU with gloo is biased against FSDP: gloo implements reduce-scatter as a full all-reduce, and four"
    " single-threaded ranks share the cores. Bytes and counts are exact on any backend; step times from GPU nodes"
    " with NCCL (`--large`) are the ones that say how fast hybrid sharding is."
)

MIB = 1024 * 1024


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
        interval = r.get("interval")
        spread = "-" if not interval else f"{interval[0]:.3f}-{interval[1]:.3f}"
        rows.append([r["name"], _x(r["value"]), spread, target, verdict, _x(r.get("cpu_value")),
                     str(r["timed_steps"])])
    return rows


RATIO_HEADER = ["step-time ratio", "wall time", "95% over rounds", "target", "verdict", "CPU time (info)",
                "timed steps (each side)"]


def check_rows(summary: dict[str, Any]) -> list[list[str]]:
    rows = []
    for check in summary["checks"]:
        op = "==" if check["name"].startswith("traffic") or "replica bytes" in check["name"] else "<="
        rows.append([check["name"], _x(check["value"]), f"{op} {check['target']:.3f}", "met" if check["ok"] else "MISSED"])
    return rows


ACCUMULATION_HEADER = [
    "engine", "accumulation", "k", "replica MiB/step", "vs k=1", "shard MiB/step", "peak grads MiB/rank",
    "vs sharded grads", "bound (1 + 1/d)",
]


def accumulation_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The gradient-accumulation table: one row per mode and number of micro-batches."""
    return [[
        f"FSDP{r['fsdp_version']}", r["accumulation"], str(r["micro_batches"]), _mib(r["replicate_bytes"]),
        _x(r["replicate_vs_k1"], 2), _mib(r["shard_bytes"]), _mib(r["peak_grads_bytes"]),
        _x(r["grads_vs_sharded"], 2) + ("" if r["counts_match"] else " (counts differ)"), _x(r["bound"], 2),
    ] for r in summary.get("accumulation", [])]


ACCUMULATION_NOTE = (
    "*replica MiB/step*: bytes across replicas per optimizer step of k micro-batches; *peak grads*: the most gradient"
    " memory a rank holds during the step (FSDP1 no_sync: the unsharded gradient; FSDP2: the sharded gradient and its"
    " partial-reduce buffer); *vs sharded grads*: over the k=1 gradient of the same mode."
)


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
        f" {settings.rounds} times interleaved (A B C, C B A, ...), each run {settings.warmup} warm-up step(s) and"
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
        ("*wall time*: ratio of the median step times (the targets apply to it). *95% over rounds*: the central 95%"
         " of that ratio when the rounds are resampled (bootstrap, both sides together): how much of it is the"
         " rounds that happened to run. *CPU time*: the same ratio of the"
        " ranks' CPU time per step, for information; it counts work rather than waiting, so it moves less when other"
        " programs share the machine."),
        f"> {GLOO_NOTE}",
    ]
    if summary.get("accumulation"):
        parts += ["## Gradient accumulation", _markdown_table(ACCUMULATION_HEADER, accumulation_rows(summary)),
                  ACCUMULATION_NOTE]
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
            ("Gradient accumulation", ACCUMULATION_HEADER, accumulation_rows(summary)),
        ],
        left=("configuration", "FSDP", "figure", "step-time ratio", "engine", "accumulation"), width=180,
        footer=GLOO_NOTE,
    )
