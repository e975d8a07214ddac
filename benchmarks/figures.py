"""From per-rank records to the published figures: per-rank memory and traffic, per-configuration step times,
the ratios and the checks against :data:`TARGETS`.

All pure functions of the records (no processes), so the arithmetic is tested on its own.

Definitions:

- **model state** of a rank: parameters + gradients + optimizer state it holds, measured from the real tensors;
  **floor** = unsharded model state / shard degree + FSDP padding per rank (padding is shown separately);
- **traffic** of one optimizer step: logical bytes of the collectives per mesh axis (``shard`` = inside the shard
  group, ``replicate`` = across replicas, ``other`` = any other group), measured / textbook formula over all axes,
  and whether every (axis, operation) count equals the formula's;
- **collectives by group size**: calls per step grouped by the size of the process group (the latency proxy);
- **gradient accumulation** (one round, bytes and memory only): for k micro-batches per optimizer step, the bytes
  across replicas and inside the shard group, and the most gradient memory a rank holds during the step (measured
  after every backward), for FSDP1 ``no_sync``, FSDP1 reducing every micro-batch and FSDP2's deferred all-reduce;
- **step time** of a configuration: for every timed step the slowest rank's time, then the median over all timed
  steps of all rounds; ratios are ratios of those medians (targets apply to them), shown with the 95% interval
  of the same ratio over resamples of the rounds (:func:`round_interval`: how much of it is the rounds that
  happened to run). The same ratio of per-step
  CPU time (mean over ranks) is shown for information: it measures work rather than waiting, so it moves much less
  when other programs share the cores.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.settings import ConfigSpec, Settings, build_configs, hybrid_degree
from lightning_smp.names import FULL_SHARD, NO_SHARD, OTHER_AXIS, REPLICATE_AXIS, SHARD_AXIS

#: Targets the suite checks on every run (name -> bound, all "at most" except traffic which is "equal").
TARGETS = {
    "memory measured / floor": 1.01,
    "traffic measured / formula": 1.000,
    "wrapper overhead: smp_hybrid / plain-torch HSDP": 1.03,
    "wrapper overhead: smp_hybrid_fsdp2 / plain-torch fully_shard HSDP": 1.03,
    "memory callback overhead: on / off": 1.02,
    "degree 1 (the DDP engine) / Lightning DDP, like for like": 1.05,
    "FSDP2 deferred all-reduce: replica bytes k=4 / k=1": 1.00,
    "FSDP2 deferred all-reduce: peak gradient memory / ((1 + 1/d) x sharded gradient)": 1.00,
}


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
    return [t for steps in steps_by_round(records, key).values() for t in steps]


def steps_by_round(records: Sequence[dict[str, Any]], key: str = "step_times") -> dict[int, list[float]]:
    """:func:`slowest_rank_steps`, by round."""
    by_round: dict[int, list[list[float]]] = {}
    for record in records:
        by_round.setdefault(record.get("round", 0), []).append(record.get(key) or [])
    pick = max if key == "step_times" else (lambda values: sum(values) / len(values))
    return {r: [pick(times) for times in zip(*by_round[r])] for r in sorted(by_round)}


#: resamples of :func:`round_interval` (its seed is fixed: the same records give the same interval)
RESAMPLES = 2000


def round_interval(numerator: dict[int, list[float]], denominator: dict[int, list[float]],
                   coverage: float = 0.95) -> tuple[float, float] | None:
    """How far the ratio of median step times moves with the rounds that happened to run: the central ``coverage``
    of the ratio over bootstrap resamples of the rounds (``None`` with fewer than 3 rounds).

    Rounds are the unit resampled, not steps: the steps of one run share its processes and the machine's state, so
    they are not independent; the two sides of a ratio ran in the same rounds and are resampled together (paired).
    """
    rounds = sorted(set(numerator) & set(denominator))
    if len(rounds) < 3:
        return None
    rng = random.Random(0)
    ratios = []
    for _ in range(RESAMPLES):
        picked = [rng.choice(rounds) for _ in rounds]
        a = statistics.median(t for r in picked for t in numerator[r])
        b = statistics.median(t for r in picked for t in denominator[r])
        ratios.append(a / b)
    ratios.sort()
    tail = (1 - coverage) / 2
    return ratios[int(tail * (RESAMPLES - 1))], ratios[int((1 - tail) * (RESAMPLES - 1))]


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
        "steps_by_round": steps_by_round(records),
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
    # JSON keys are strings: a summary read back from quick.json has string rounds
    interval = round_interval(*({int(r): v for r, v in c.get("steps_by_round", {}).items()} for c in (a, b)))
    return {
        "name": name, "numerator": numerator, "denominator": denominator, "value": value, "cpu_value": cpu,
        "interval": None if interval is None else list(interval), "target": target,
        "timed_steps": timed, "ok": None if target is None or value is None else value <= target,
    }


def timing_ratios(settings: Settings, configs: dict[str, dict]) -> list[dict[str, Any]]:
    """The step-time ratios the report publishes, with targets where the project sets one."""
    degrees = sorted({c["degree"] for c in configs.values() if c["degree"] is not None})
    main = hybrid_degree(settings.world_size, degrees)
    ratios = []
    if 1 in degrees:
        # nothing sharded runs on the DDP engine, under either fsdp_version: as fast as Lightning's DDP with the same
        # find_unused_parameters (the engine's default, True, takes a model with unused parameters; DDP's, False,
        # does not, and saves a graph traversal and an all-reduce per step)
        target = TARGETS["degree 1 (the DDP engine) / Lightning DDP, like for like"]
        for kind in ("smp_hybrid", "smp_hybrid_fsdp2"):
            ratios += [
                _ratio(f"{kind} d=1 / Lightning DDP, both find_unused_parameters=True", configs, f"{kind} d=1",
                       "ddp find_unused_parameters=True", target),
                _ratio(f"{kind} d=1 / Lightning DDP, both find_unused_parameters=False", configs,
                       f"{kind} d=1 find_unused_parameters=False", "ddp", target),
            ]
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
    for degree in degrees:
        hybrid = 1 < degree < settings.world_size
        label = "plain fully_shard HSDP" if hybrid else f"plain fully_shard {NO_SHARD if degree == 1 else FULL_SHARD}"
        target = TARGETS["wrapper overhead: smp_hybrid_fsdp2 / plain-torch fully_shard HSDP"] if hybrid else None
        ratios.append(_ratio(f"wrapper overhead d={degree}: smp_hybrid_fsdp2 / {label}", configs,
                             f"smp_hybrid_fsdp2 d={degree}", f"torch_fsdp2 d={degree}", target))
        ratios.append(_ratio(f"smp_hybrid_fsdp2 d={degree} / smp_hybrid d={degree} (FSDP2 / FSDP1)", configs,
                             f"smp_hybrid_fsdp2 d={degree}", f"smp_hybrid d={degree}"))
    return [r for r in ratios if r is not None]


def summarise_accumulation(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, k) of the accumulation runs: the largest per-rank figures, and each against k=1 and
    against the sharded gradient (the k=1 gradient of the same mode, padding included)."""
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for record in records:
        if record.get("micro_batches") is not None:
            runs.setdefault((record["kind"], record["accumulation"], record["micro_batches"]), []).append(record)
    rows = []
    for (kind, mode, k), ranks in runs.items():
        base = runs.get((kind, mode, 1), ranks)
        sharded = max(r["grads_bytes"] for r in base)
        replicate = max(r["replicate_bytes"] for r in ranks)
        replicate_once = max(r["replicate_bytes"] for r in base)
        degree = ranks[0]["degree"]
        rows.append({
            "kind": kind, "fsdp_version": 2 if kind.endswith("fsdp2") else 1, "accumulation": mode,
            "micro_batches": k, "degree": degree,
            "replicate_bytes": replicate, "shard_bytes": max(r["shard_bytes"] for r in ranks),
            "replicate_vs_k1": replicate / replicate_once if replicate_once else None,
            "peak_grads_bytes": max(r["grads_bytes"] for r in ranks), "sharded_grads_bytes": sharded,
            "grads_vs_sharded": max(r["grads_bytes"] for r in ranks) / sharded if sharded else None,
            "bound": 1 + 1 / degree, "counts_match": all(not r["comm_mismatch"] for r in ranks),
        })
    return sorted(rows, key=lambda r: (r["fsdp_version"], r["accumulation"], r["micro_batches"]))


def accumulation_checks(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The FSDP2 targets of the accumulation table, at the largest k."""
    deferred = [r for r in rows if r["fsdp_version"] == 2 and r["micro_batches"] == max(r["micro_batches"] for r in rows)]
    checks = []
    for row in deferred:
        name = "FSDP2 deferred all-reduce: replica bytes k=4 / k=1"
        checks.append({"name": name, "value": row["replicate_vs_k1"], "target": TARGETS[name],
                       "ok": row["replicate_vs_k1"] is not None and round(row["replicate_vs_k1"], 3) == 1.0})
        name = "FSDP2 deferred all-reduce: peak gradient memory / ((1 + 1/d) x sharded gradient)"
        value = None if row["grads_vs_sharded"] is None else row["grads_vs_sharded"] / row["bound"]
        checks.append({"name": name, "value": value, "target": TARGETS[name], "ok": value is not None and value <= 1.0})
    return checks


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
    accumulation = summarise_accumulation(records)
    checks += accumulation_checks(accumulation) if accumulation else []
    return {"configs": list(configs.values()), "ratios": ratios, "checks": checks, "accumulation": accumulation}
