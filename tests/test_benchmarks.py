"""The benchmark harness: its plan and arithmetic (pure), ``--large`` built on CPU, and one tiny real run.

No timing is asserted anywhere: step times are only counted, never compared.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks.cli import report_only, run
from benchmarks.figures import (
    round_interval,
    slowest_rank_steps,
    steps_by_round,
    summarise,
    timing_ratios,
    traffic,
)
from benchmarks.settings import (
    LARGE_MODEL,
    QUICK_MODEL,
    ConfigSpec,
    build_accumulation_configs,
    build_configs,
    interleaved,
    parse_args,
    quick_settings,
    settings_from_args,
    settings_from_dict,
)
from benchmarks.tables import GLOO_NOTE
from benchmarks.workloads import BenchGPT, make_model, plain_mixed_precision
from lightning_smp import HybridShardConfigError
from lightning_smp.demo import Block
from lightning_smp.engines.fsdp1.flat import flat_param_numel
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
from tests.oracles import rank_bytes

WORLD4_NAMES = [
    "smp_hybrid d=1 find_unused_parameters=False", "ddp", "smp_hybrid_fsdp2 d=1 find_unused_parameters=False",
    "smp_hybrid d=1", "ddp find_unused_parameters=True", "smp_hybrid_fsdp2 d=1", "lightning_fsdp",
    "torch_hsdp d=1", "smp_hybrid_zero2 d=1", "torch_fsdp2 d=1",
    "torch_hsdp d=2", "smp_hybrid d=2", "smp_hybrid d=2 +memory callback", "smp_hybrid_zero2 d=2",
    "torch_fsdp2 d=2", "smp_hybrid_fsdp2 d=2",
    "torch_hsdp d=4", "smp_hybrid d=4", "smp_hybrid_zero2 d=4", "torch_fsdp2 d=4", "smp_hybrid_fsdp2 d=4",
]
#: the accumulation runs of 4 ranks: at degree 2, k = 1, 2, 4 for each mode
WORLD4_ACCUMULATION = [f"{kind} d=2 {mode} k={k}" for kind, mode in (
    ("smp_hybrid", "no_sync"), ("smp_hybrid", "every_micro_batch"), ("smp_hybrid_fsdp2", "defer_all_reduce"))
    for k in (1, 2, 4)]


# ---------------------------------------------------------------------------------------------- the plan


def test_quick_mode_runs_every_peer_and_every_valid_degree():
    configs = build_configs(quick_settings())
    assert [c.name for c in configs] == WORLD4_NAMES
    assert [c.name for c in build_accumulation_configs(quick_settings())] == WORLD4_ACCUMULATION
    assert build_accumulation_configs(quick_settings(only=("ddp",))) == []
    strategies = {c.name: c.sharding_strategy(4) for c in configs}
    assert strategies["smp_hybrid d=2"] == strategies["torch_hsdp d=2"] == HYBRID_SHARD
    assert strategies["smp_hybrid_zero2 d=2"] == HYBRID_SHARD_ZERO2
    assert strategies["smp_hybrid d=1"] == strategies["torch_hsdp d=1"] == NO_SHARD
    assert strategies["smp_hybrid_fsdp2 d=2"] == strategies["torch_fsdp2 d=2"] == HYBRID_SHARD
    assert {c.fsdp_version for c in configs if "fsdp2" in c.kind} == {2}
    assert strategies["smp_hybrid d=4"] == strategies["torch_hsdp d=4"] == FULL_SHARD
    assert strategies["smp_hybrid_zero2 d=4"] == SHARD_GRAD_OP
    assert strategies["lightning_fsdp"] == FULL_SHARD and strategies["ddp"] == "DDP"


@pytest.mark.parametrize(
    ("world", "degrees", "callback_degree"),
    [pytest.param(8, [1, 2, 4, 8], 4, id="8r"), pytest.param(6, [1, 2, 3, 6], 3, id="6r"),
     pytest.param(2, [1, 2], 2, id="2r")],
)
def test_degrees_follow_the_world_size(world, degrees, callback_degree):
    configs = build_configs(quick_settings(world_size=world))
    assert sorted({c.degree for c in configs if c.kind == "smp_hybrid"}) == degrees
    assert [c.degree for c in configs if c.memory_callback] == [callback_degree]


def test_interleaving_alternates_configurations_and_reverses_every_other_round():
    a, b, c = ConfigSpec("ddp"), ConfigSpec("smp_hybrid", 2), ConfigSpec("smp_hybrid", 4)
    assert interleaved([a, b, c], 3) == [(0, a), (0, b), (0, c), (1, c), (1, b), (1, a), (2, a), (2, b), (2, c)]


def test_the_runs_of_every_targeted_ratio_are_neighbours():
    settings = quick_settings()
    configs = build_configs(settings)
    names = [c.name for c in configs]
    # the ratios the report checks against a target, as figures.timing_ratios builds them
    timed = {c.name: {"degree": c.degree, "step_ms": 1.0, "step_cpu_ms": 1.0, "timed_steps": 1} for c in configs}
    targeted = [r for r in timing_ratios(settings, timed) if r["target"] is not None]
    assert len(targeted) == 7  # degree 1 against DDP (2 engines x 2 settings), two wrapper overheads, the callback
    for ratio in targeted:
        assert abs(names.index(ratio["numerator"]) - names.index(ratio["denominator"])) == 1, ratio["name"]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [pytest.param(["--degrees", "3"], r"^hybrid_shard_degree=3\b.*\bworld_size=4\b", id="bad-degree"),
     pytest.param(["--only", "smp_hybrid d=3"], "--only", id="unknown-name"),
     pytest.param(["--steps", "0"], "--steps=0", id="no-steps"),
     pytest.param(["--warmup", "2"], "--warmup=2", id="short-warmup"),
     pytest.param(["--world-size", "1"], "--world-size=1", id="one-rank"),
     pytest.param(["--dim", "30"], "--dim=30", id="dim-vs-heads")],
)
def test_bad_command_lines_fail_before_anything_runs(argv, fragment):
    with pytest.raises(HybridShardConfigError, match=fragment):
        settings_from_args(parse_args(argv))


def test_model_size_formula_matches_the_real_model():
    for size in (QUICK_MODEL, LARGE_MODEL):
        with torch.device("meta"):
            model = BenchGPT(size.vocab_size, size.dim, size.layers, size.heads, size.block_size)
        assert sum(p.numel() for p in model.parameters()) == size.parameter_count()


def test_large_mode_builds_its_configuration_on_cpu():
    settings = settings_from_args(parse_args(["--large"]), launcher_world_size=16)
    assert (settings.mode, settings.backend, settings.precision, settings.accelerator) == ("large", "nccl", "bf16-mixed", "gpu")
    assert 0.95e9 < settings.model.parameter_count() < 1.1e9
    assert settings.steps * settings.rounds >= 20
    configs = build_configs(settings)
    assert sorted({c.degree for c in configs if c.kind == "smp_hybrid"}) == [1, 2, 4, 8, 16]
    assert [c.degree for c in configs if c.memory_callback] == [8]
    mp = plain_mixed_precision(settings)
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    assert settings_from_dict(json.loads(json.dumps(settings.as_dict()))) == settings


# ---------------------------------------------------------------------------------------------- the arithmetic


def _comm(**axes: dict[str, tuple[int, int]]) -> dict:
    return {axis: {op: {"count": c, "bytes": b} for op, (c, b) in ops.items()} for axis, ops in axes.items()}


def test_traffic_figures():
    record = {
        "comm": _comm(shard={"all_gather": (9, 900), "reduce_scatter": (5, 500)}, replicate={"all_reduce": (5, 250)},
                      other={"all_reduce": (0, 0)}),
        "comm_textbook": _comm(shard={"all_gather": (9, 900), "reduce_scatter": (5, 500)}, replicate={"all_reduce": (5, 250)}),
        "group_sizes": {SHARD_AXIS: 2, REPLICATE_AXIS: 4},
    }
    figures = traffic(record)
    assert (figures["shard_bytes"], figures["replicate_bytes"], figures["other_bytes"]) == (1400, 250, 0)
    assert figures["traffic_ratio"] == 1.0 and figures["counts_match"]
    assert figures["collectives_by_group_size"] == {"2": 14, "4": 5}
    # an extra collective the formula does not know: ratio and counts both say so
    record["comm"][OTHER_AXIS]["all_reduce"] = {"count": 1, "bytes": 165}
    figures = traffic(record)
    assert figures["traffic_ratio"] == pytest.approx(1815 / 1650) and not figures["counts_match"]
    assert figures["collectives_by_group_size"] == {"2": 14, "4": 5, OTHER_AXIS: 1}


def _record(config: str, rank: int, round_index: int, times: list[float], total: int = 100) -> dict:
    return {
        "config": config, "rank": rank, "round": round_index, "step_times": times,
        "step_cpu_times": [t / 2 for t in times], "sharding_strategy": HYBRID_SHARD,
        "memory": {"total_bytes": total, "params_bytes": 40, "grads_bytes": 20, "optimizer_bytes": 40,
                   "unsharded_total_bytes": 200, "padding_bytes": 0.0, "floor_bytes": 100.0,
                   "measured_over_floor": total / 100, "shard_degree": 2},
        "comm": _comm(shard={"all_gather": (1, 8)}), "comm_textbook": _comm(shard={"all_gather": (1, 8)}),
        "group_sizes": {SHARD_AXIS: 2}, "peak_rss_bytes": 1000 + round_index, "start_rss_bytes": 900, "threads": 1,
    }


def test_step_time_is_the_median_of_the_slowest_rank_over_rounds():
    records = [_record("a", 0, 0, [1.0, 5.0]), _record("a", 1, 0, [2.0, 3.0]), _record("a", 0, 1, [4.0, 1.0]),
               _record("a", 1, 1, [1.0, 1.0])]
    assert slowest_rank_steps(records) == [2.0, 5.0, 4.0, 1.0]
    assert slowest_rank_steps(records, "step_cpu_times") == [0.75, 2.0, 1.25, 0.5]  # CPU time: mean over ranks


def test_the_interval_of_a_ratio_resamples_whole_rounds_of_both_sides_together():
    rounds = {r: [0.1 * (1 + r), 0.1 * (1 + r)] for r in range(6)}  # the machine drifts from round to round
    # both sides drift alike (they ran in the same rounds): resampling rounds together keeps their ratio exact
    assert round_interval(rounds, {r: [t / 2 for t in steps] for r, steps in rounds.items()}) == (2.0, 2.0)
    slow_once = {r: [t * (1.5 if r == 3 else 1.0) for t in steps] for r, steps in rounds.items()}
    low, high = round_interval(slow_once, rounds)
    # one slow round of six moves the median only in resamples that draw it often: the low end stays at 1
    assert low == 1.0 and 1.0 < high <= 1.5 * (1 + 1e-12)
    assert round_interval(slow_once, rounds) == (low, high)  # a fixed seed: the same records, the same interval
    assert round_interval({0: [1.0], 1: [1.0]}, {0: [1.0], 1: [1.0]}) is None  # two rounds say nothing of spread
    records = [_record("a", rank, r, [0.1 * (r + 1), 0.2]) for rank in range(2) for r in range(3)]
    assert steps_by_round(records) == {0: [0.1, 0.2], 1: [0.2, 0.2], 2: [0.30000000000000004, 0.2]}


def test_summary_ratios_and_targets():
    settings = quick_settings(world_size=4, degrees=(2,), only=("torch_hsdp d=2", "smp_hybrid d=2",
                                                                "smp_hybrid d=2 +memory callback"))
    records = []
    for round_index in range(2):
        records += [_record("torch_hsdp d=2", r, round_index, [0.100, 0.100]) for r in range(2)]
        records += [_record("smp_hybrid d=2", r, round_index, [0.102, 0.102], total=101) for r in range(2)]
        records += [_record("smp_hybrid d=2 +memory callback", r, round_index, [0.105, 0.105]) for r in range(2)]
    summary = summarise(settings, records)
    ratios = {r["name"]: r for r in summary["ratios"]}
    wrapper = ratios["wrapper overhead d=2: smp_hybrid / plain-torch HSDP"]
    assert wrapper["value"] == pytest.approx(1.02) and wrapper["ok"] and wrapper["timed_steps"] == 4
    assert wrapper["cpu_value"] == pytest.approx(1.02)
    assert wrapper["interval"] is None  # two rounds
    callback = ratios["memory callback overhead d=2: on / off"]
    assert callback["value"] == pytest.approx(0.105 / 0.102) and callback["ok"] is False
    checks = {c["name"]: c for c in summary["checks"]}
    assert checks["memory measured / floor"]["value"] == pytest.approx(1.01) and checks["memory measured / floor"]["ok"]
    assert checks["traffic measured / formula"]["ok"]
    config = next(c for c in summary["configs"] if c["name"] == "smp_hybrid d=2")
    assert [f["peak_rss_bytes"] for f in config["ranks"]] == [1001, 1001]  # the peak over rounds
    assert config["stable_across_rounds"]


# ---------------------------------------------------------------------------------------------- one tiny run


def _units(model: torch.nn.Module) -> list[list[int]]:
    """Element counts of the original parameters of every FSDP unit (root first), in FSDP's flattening order."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = [p.numel() for p in model.parameters() if id(p) not in in_blocks]
    return [root] + [[p.numel() for p in b.parameters()] for b in blocks]


@pytest.mark.slow  # every configuration of the benchmark: a scenario matrix
@pytest.mark.timeout(240)
def test_tiny_run_measures_every_configuration_on_every_rank(tmp_path: Path):
    names = ("ddp", "lightning_fsdp", "torch_hsdp d=2", "smp_hybrid d=2", "smp_hybrid d=2 +memory callback",
             "smp_hybrid_zero2 d=2", "torch_fsdp2 d=2", "smp_hybrid_fsdp2 d=2")
    accumulation = ("smp_hybrid d=2 no_sync k=1", "smp_hybrid d=2 no_sync k=4",
                    "smp_hybrid_fsdp2 d=2 defer_all_reduce k=1", "smp_hybrid_fsdp2 d=2 defer_all_reduce k=4")
    args = parse_args(["--dim", "16", "--layers", "2", "--rounds", "1", "--warmup", "3", "--steps", "2",
                       "--batch-size", "2", "--only", *names, *accumulation])
    settings = settings_from_args(args)
    result = run(settings, tmp_path, echo=False)
    records, summary = result["records"], result["summary"]
    runs = [n for n in (*names, *accumulation)]
    assert sorted((r["config"], r["rank"]) for r in records) == sorted((n, r) for n in runs for r in range(4))
    accumulated = {(row["accumulation"], row["micro_batches"]): row for row in summary["accumulation"]}
    # FSDP2 crosses the replicas once per optimizer step whatever k is, and its gradients stay sharded
    assert accumulated[("defer_all_reduce", 4)]["replicate_vs_k1"] == 1.0
    assert accumulated[("defer_all_reduce", 4)]["grads_vs_sharded"] <= 1.5
    # FSDP1's no_sync crosses once too, but holds the unsharded gradient (about twice the shard at degree 2)
    assert accumulated[("no_sync", 4)]["replicate_vs_k1"] == 1.0 and accumulated[("no_sync", 4)]["grads_vs_sharded"] > 1.8
    assert all(row["counts_match"] for row in summary["accumulation"])
    checks = {c["name"]: c for c in summary["checks"]}
    assert checks["FSDP2 deferred all-reduce: replica bytes k=4 / k=1"]["ok"]
    assert checks["FSDP2 deferred all-reduce: peak gradient memory / ((1 + 1/d) x sharded gradient)"]["ok"]
    records = [r for r in records if r["config"] in names]
    for record in records:
        assert len(record["step_times"]) == len(record["step_cpu_times"]) == 2 and record["threads"] == 1

    # exact bytes from the real tensors, against FSDP1's flat-parameter arithmetic
    with torch.device("meta"):
        m = settings.model
        meta_model = BenchGPT(m.vocab_size, m.dim, m.layers, m.heads, m.block_size)
        units = _units(meta_model)
        shapes = [tuple(p.shape) for p in meta_model.parameters()]
    n_params, n_tensors = sum(map(sum, units)), sum(map(len, units))
    for record in records:
        memory = record["memory"]
        if record["config"] == "ddp":
            expected = {"params_bytes": 4 * n_params, "grads_bytes": 4 * n_params,
                        "optimizer_bytes": 8 * n_params + 4 * n_tensors}
        elif record["config"].startswith("smp_hybrid_fsdp2"):
            # FSDP2: each parameter's dim-0 chunk, padded to ceil(rows / 2) rows; AdamW state of the unpadded chunk
            position = record["rank"] % 2
            chunk = [(math.ceil(s[0] / 2), max(0, min(math.ceil(s[0] / 2), s[0] - position * math.ceil(s[0] / 2))),
                      math.prod(s[1:])) for s in shapes]
            padded = sum(rows * rest for rows, _, rest in chunk)
            local = sum(rows * rest for _, rows, rest in chunk)
            expected = {"params_bytes": 4 * padded, "grads_bytes": 4 * padded,
                        "optimizer_bytes": 8 * local + 4 * n_tensors}
        elif record["config"].startswith("smp_hybrid"):
            expected = rank_bytes(units, shard_size=2, shard_rank=record["rank"] % 2)
            expected.pop("padding_bytes")
        else:
            continue
        assert {k: memory[k] for k in expected} == expected, record["config"]

    configs = {c["name"]: c for c in summary["configs"]}
    for name, config in configs.items():
        if "fsdp2" not in name:
            # FSDP2 splits each parameter by torch.chunk: with this tiny model's odd sizes the first rank of a shard
            # group holds more optimizer state than the average (its exact bytes are checked above)
            assert config["max_measured_over_floor"] <= 1.01, name
        assert config["traffic_ratios"] == [1.0] and config["counts_match"], name
    sizes = {name: set(configs[name]["ranks"][0]["collectives_by_group_size"]) for name in configs}
    assert sizes["smp_hybrid d=2"] == sizes["torch_hsdp d=2"] == {"2"}
    # the strategy sends exactly what plain fully_shard and FSDP1 HSDP send, per axis, and the one-byte-per-parameter
    # bitmap that finds parameters no rank used (an all-reduce on each axis per optimizer step)
    bitmap = sum(1 for _ in make_model(settings).parameters())
    for axis in ("shard_bytes", "replicate_bytes"):
        assert configs["smp_hybrid_fsdp2 d=2"]["ranks"][0][axis] == configs["torch_fsdp2 d=2"]["ranks"][0][axis] + bitmap
    assert sizes["lightning_fsdp"] == sizes["ddp"] == {"4"}
    hybrid = configs["smp_hybrid d=2"]["ranks"][0]
    assert hybrid["shard_bytes"] == configs["torch_hsdp d=2"]["ranks"][0]["shard_bytes"] + bitmap
    # HYBRID_SHARD per unit: all-gathers of the padded flat parameter (two for non-root units) and one
    # reduce-scatter inside the shard group, one all-reduce of the half-sized gradient shard across replicas
    padded = [flat_param_numel(u, 2) for u in units]
    assert hybrid["shard_bytes"] == sum(4 * n * (2 if i == 0 else 3) for i, n in enumerate(padded)) + bitmap
    assert hybrid["replicate_bytes"] == sum(4 * n // 2 for n in padded) + bitmap

    paths = result["paths"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory_by_degree.png", "quick.json", "quick.md"]
    assert set(paths) == {"png", "json", "md"}
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = paths["md"].read_text()
    assert GLOO_NOTE in markdown and "wrapper overhead d=2: smp_hybrid / plain-torch HSDP" in markdown
    assert "memory callback overhead d=2: on / off" in markdown
    payload = json.loads(paths["json"].read_text())
    assert len(payload["records"]) == len(runs) * 4 and payload["parameters"] == settings.model.parameter_count()
    assert "## Gradient accumulation" in markdown

    # the published page is a pure function of the JSON
    again = tmp_path / "again"
    report_only(paths["json"], again, echo=False)
    assert (again / "quick.md").read_text() == markdown
    assert json.loads((again / "quick.json").read_text()) == payload


# ---------------------------------------------------------------------------------------------- make bench-async


def test_async_checkpoint_benchmark_runs_and_reports(tmp_path: Path) -> None:
    """A tiny real run of ``make bench-async``: every row, the staging of the writing ranks only, the verdicts."""
    from benchmarks.async_checkpoint import TARGET, main

    result = main(["--width", "64", "--layers", "2", "--steps", "4", "--every", "2", "--output",
                   str(tmp_path / "async")])
    rows = result["rows"]
    assert [(r["fsdp_version"], r["async_save"]) for r in rows] == [(1, False), (1, True), (2, False), (2, True)]
    for row in rows:
        assert len(row["blocked_each_s"]) == 2 and row["final_wait_s"] >= 0
        # degree 2 on 4 ranks: ranks 0 and 1 write (and stage) the two shards, 2 and 3 hold the same ones
        if row["async_save"]:
            assert row["staged_bytes"][2:] == [0, 0] and min(row["staged_bytes"][:2]) > 0
        else:
            assert row["staged_bytes"] == [0, 0, 0, 0]
    assert [v["fsdp_version"] for v in result["verdicts"]] == [1, 2]
    assert all(v["target"] == TARGET and v["met"] == (v["ratio"] <= TARGET) for v in result["verdicts"])
    saved = json.loads((tmp_path / "async.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    assert "background blocked / blocking blocked" in (tmp_path / "async.md").read_text()


# -------------------------------------------------------------------------------------------- make bench-buffers


def test_buffer_sync_benchmark_runs_and_reports(tmp_path: Path) -> None:
    """A tiny real run of ``make bench-buffers``: both engines, both settings per round, the bytes broadcast."""
    from benchmarks.buffer_sync import main

    result = main(["--width", "16", "--layers", "2", "--batch", "4", "--steps", "3", "--rounds", "1", "--output",
                   str(tmp_path / "buffers")])
    # two BatchNorm1d(16): running mean and variance (16 fp32 each) and the int64 step count
    assert result["buffer_bytes_per_step"] == 2 * (2 * 16 * 4 + 8)
    assert [e["fsdp_version"] for e in result["engines"]] == [1, 2]
    assert all(e["rounds"] == 1 and e["on_s"] > 0 and e["off_s"] > 0 for e in result["engines"])
    assert json.loads((tmp_path / "buffers.json").read_text())["engines"] == json.loads(json.dumps(result["engines"]))
    assert "on / off" in (tmp_path / "buffers.md").read_text()


# ---------------------------------------------------------------------------------------------- make bench-guard


def test_guard_sync_benchmark_runs_and_reports(tmp_path: Path) -> None:
    """A tiny real run of ``make bench-guard``: both reductions timed on every call, each round in turn."""
    from benchmarks.guard_sync import VARIANTS, main

    result = main(["--params", "8", "--width", "16", "--compute", "1", "--calls", "2", "--rounds", "2", "--output",
                   str(tmp_path / "guard")])
    assert result["calls"] == {variant: 4 for variant in VARIANTS}
    assert all(result["median_ms"][variant] > 0 for variant in VARIANTS)
    assert result["ratio_min"] <= result["world_over_per_axis"] <= result["ratio_max"]
    assert json.loads((tmp_path / "guard.json").read_text())["median_ms"] == result["median_ms"]
    assert "world / per axis" in (tmp_path / "guard.md").read_text()


@pytest.mark.parametrize(("cut", "mended", "healed", "expected"), [
    (1.5, 3.0, 6.5, (3.0, 1.5)),  # (the partition's wait 1 -> 4; the heal's step 5 -> 8 waited 1.5 s before it)
    (1.5, 3.0, 5.5, (3.0, 2.5)),
    (1.5, 3.0, 2.5, (3.0, 0.0)),  # (a heal begun before the link came back: the partition's, not set apart)
    (5.5, 6.0, 6.5, (3.0, 0.0)),  # (no step recorded between the cut and the heal: one wait, not set apart)
    (1.5, 3.0, None, (3.0, 0.0)),
])
def test_the_partition_sweep_sets_the_heal_s_transfer_apart_only_after_the_partition_s_own_wait(cut, mended, healed,
                                                                                           expected):
    from benchmarks.fault_tolerance import _survivor_waits

    assert _survivor_waits([0.0, 1.0, 4.0, 5.0, 8.0, 9.0], cut, mended, healed) == expected


def test_the_fault_benchmark_reports_every_figure_it_names(tmp_path, monkeypatch):
    """make bench-fault's report, from a result shaped as a run gives it: the table side by side, the targets, the
    plot; and without the cluster harness it says why instead of running."""
    from benchmarks import fault_tolerance as bench

    timeline = {"group 0": [(0.5 * i, i) for i in range(1, 40)], "group 1": [(0.5 * i, i) for i in range(1, 10)]}
    result = {
        "settings": {"rate": "100mbit", "width": 64, "heartbeat_timeout": 2.0, "restart_after": 10.0,
                     "checkpoint_every": 10, "collective_timeout": 10.0, "rounds": 2, "crossing_width": 4096,
                     "trials": 2},
        "fault_tolerance": {"recovery_s": 2.1, "heal_s": 4.9, "steps_lost": 0, "bit_equal": True,
                            "healed_at_step": 30, "kill_s": 5.0, "restart_s": 15.0, "timeline": timeline},
        "baseline": {"recovery_s": 19.0, "steps_lost": 5, "resumed_from_step": 10, "kill_s": 5.0, "restart_s": 25.0,
                     "job_ended_s": 10.5, "timeline": {"one job": timeline["group 0"]}},
        "overhead": {"overhead_ratio": 1.02, "overhead_ratios": [1.01, 1.03], "step_s_ft": 0.061,
                     "step_s_plain": 0.06, "first_step_s_ft": 0.3, "first_step_s_plain": 0.25},
        "in_crossing": {"vanish": [{"recovery_s": 2.2}, {"recovery_s": 2.3}], "kill": [{"recovery_s": 2.0},
                                                                                       {"recovery_s": 2.1}]},
        "parity": {"max_abs_difference": 6e-8, "parity_bound": 7.2e-5, "steps": 30, "groups_bit_equal": True},
    }
    text = bench.markdown(result)
    assert "| time from the kill to the next committed step | 2.10 s (target <= 7 s) | 19.00 s |" in text
    assert "| committed steps lost | 0 (target 0) | 5 (resumed from step 10) |" in text
    assert "**1.020** (target <= 1.05); rounds: 1.010, 1.030; the medians of all their steps: 61.0 ms" in text
    assert "(link down, then killed): to the next committed step | 2.20, 2.30 s (target <= 7 s) |" in text
    assert "| a node killed inside the crossing: to the next committed step | 2.00, 2.10 s (target <= 7 s) |" in text
    assert "| 6.0e-08 after 30 steps (parity bound 7.2e-05); groups bit-equal: True |" in text
    rows = [{"mode": "syncs", "landing": "heal", "round": 0, "factor": 1.3, "cut_s": 2.6, "landed_s": 0.01,
             "survivor_gap_s": 3.5, "bound_s": 3.4, "within": False, "step_s": 0.25, "window_s": 1.4, "heals": 1, "heal_s": 1.2, "heal_gap_s": 1.9,
             "rejoined_s": 0.9}]
    result["partitions"] = {"rows": rows, "every": 5, "factors": [1.3], "landings": {"heal": [1.3]},
                            "totals": {"steps": {"split": [], "cuts": 0}, "syncs": {"split": [], "cuts": 1}}}
    text = bench.markdown(result)
    assert "| syncs | heal | 1.3 | 2.60 s | 0.01 s | 3.50 s (3.40) **over** | 1.90 s (1.20 s) | 1 | 0.90 s |" in text
    assert "divergent syncs: **0** over 1 cuts (target 0)" in text
    bench.plot(result, tmp_path / "fault.png")
    assert (tmp_path / "fault.png").stat().st_size > 10_000
    monkeypatch.setattr("lightning_smp.testing.cluster.netadmin_problem", lambda: "needs root")
    assert bench.main(["--out", str(tmp_path / "none")]) == 1
    assert not (tmp_path / "none").exists()


def test_the_semi_sync_benchmark_reports_every_figure_it_names(tmp_path, monkeypatch):
    """make bench-semi-sync's report from records shaped as its runs write them: the amortised step and the bytes per
    step from the marks (validation taken out), the loss at equal samples, the time to the synchronous final loss
    (linear between validations), the targets, the plot; without the cluster harness it says why."""
    from benchmarks import semi_sync as bench

    def record(step_s: float, sent_per_step: int, losses: list[float], every: int, held: float = 0.0) -> dict:
        marks = [(i * step_s, i * sent_per_step) for i in range(len(losses) * every + 1)]
        validations = [{"step": (i + 1) * every, "train_s": (i + 1) * every * step_s, "val_loss": loss}
                       for i, loss in enumerate(losses)]
        rank = {"marks": marks, "validations": validations, "validating_s": 0.0, "validation_bytes": 0, "node": 0,
                "sync_held_s": held, "syncs": 2}
        return {"ranks": [rank, {**rank, "node": 1}], "local_params": 1000}

    sync = bench.summarize(bench.Row("sync", None), record(1.0, 1000, [3.0, 2.0], 10), 8, "100mbit")
    semi = bench.summarize(bench.Row("H=20", 20, defaults=True), record(0.25, 50, [3.5, 2.5, 1.5, 1.0], 10), 8,
                           "100mbit")
    overlapped = bench.summarize(bench.Row("H=20 overlapped", 20, keys={"delay": 4}),
                                 record(0.21, 50, [3.5, 2.5, 1.5, 1.0], 10), 8, "100mbit")
    int8 = bench.summarize(bench.Row("H=20 int8", 20, keys={"delay": 4, "compress": "int8"}),
                           record(0.21, 10, [3.5, 2.51, 1.5, 1.0], 10, held=0.4), 8, "100mbit")
    auto = bench.summarize(bench.Row("auto", "auto", keys={"delay": "auto"}), record(0.2, 20, [3.0, 2.02], 10), 8,
                           "100mbit")
    auto["schedule"] = {"every": 8, "delay": 3, "origin": 10}
    never = bench.summarize(bench.Row("never", bench.NEVER), record(0.2, 0, [5.0, 5.0], 10), 8, "100mbit")
    assert (sync["step_s"], sync["bytes_per_step"], sync["steps"]) == (1.0, 2000.0, 20)  # both nodes' counters
    assert (int8["delay"], int8["compress"], int8["defaults"], semi["defaults"]) == (4, "int8", False, True)
    assert bench.loss_at(semi["curve"], 20) == 2.5 and semi["curve"][0]["samples"] == 80
    assert bench.seconds_to(semi["curve"], 2.0) == pytest.approx(6.25)  # halfway between 5 s (2.5) and 7.5 s (1.5)
    assert bench.seconds_to(semi["curve"], 0.5) is None
    rows = [sync, semi, overlapped, int8, auto, never]
    for row in rows:
        row["val_loss"] = bench.loss_at(row["curve"], 20) if row["every"] != bench.NEVER else None
        row["seconds_to_sync_final_loss"] = bench.seconds_to(row["curve"], 2.0)
        row["seeds"], row["val_loss_spread"] = 1, None
    # two seeds: each against the synchronous run of its seed, the worse one checked
    sync["seeds"], sync["val_loss_spread"], sync["seed_losses"] = 2, 0.01, [2.0, 2.01]
    semi["seeds"], semi["val_loss_spread"], semi["seed_losses"] = 2, 0.3, [2.5, 2.8]
    checks = {c["name"]: c for c in bench.targets(rows, 20)}
    assert checks["H=20: bytes per step <= synchronous / H (+10 %)"]["value"] == pytest.approx(100 / 1e6)
    worse = checks["H=20: validation loss over synchronous at equal samples (the worse seed)"]
    assert worse["value"] == pytest.approx((2.8 / 2.01 - 1) * 100) and worse["target"] == 2.0  # (the defaults)
    # overlap against the blocking defaults at its H, compression against the overlapped float32 row
    assert checks["H=20 overlapped: validation loss over H=20 (overlap)"]["value"] == pytest.approx(0.0)
    # compressed: 20 bytes per step on the link against 0.3 x 2000 / 20
    assert checks["H=20 int8: bytes per step <= 0.3 x synchronous / H"]["value"] == pytest.approx(20 / 1e6)
    assert checks["H=20 int8: bytes per step <= 0.3 x synchronous / H"]["target"] == pytest.approx(30 / 1e6)
    assert checks["H=20 int8: step / compute bound"]["value"] == pytest.approx(1.05)
    cost = checks["H=20 int8: validation loss over H=20 overlapped (compression)"]
    assert cost["value"] == pytest.approx(0.4) and cost["target"] == 1.0 and cost["ok"]
    assert checks["auto: validation loss over synchronous at equal samples"]["value"] == pytest.approx(1.0)
    assert checks["auto: step / compute bound"]["ok"]
    assert auto["seconds_to_sync_final_loss"] is None  # (2.02 at its last validation: not reached)
    fastest = checks["time to the synchronous final loss, synchronous / the fastest row (H=20 overlapped)"]
    assert fastest["value"] == pytest.approx(20 / overlapped["seconds_to_sync_final_loss"]) and not fastest["ok"]
    result = {"args": {"rate": "100mbit", "dim": 8, "layers": 1, "block": 4, "lr": 0.1, "batch": 2,
                       "val_windows": 4, "val_every": 10}, "corpus": {"python": "3", "stdlib_files": 1, "bytes": 10,
                                                                       "sha1": "0" * 40},
              "params": 1000, "steps": 20, "sync_final_loss": 2.0, "compute_bound_step_s": 0.2, "rows": rows,
              "seconds": 60.0, "checks": list(checks.values())}
    text = bench.markdown(result)
    assert "| H=20 | 0.250 | 1.25 x | 0.0 | 0.000 | 2.5000 | +25.00 % | 2: 0.3000 | 6.2 |" in text
    assert "| sync | 1.000 | 5.00 x | 0.0 | 0.002 | 2.0000 | +0.00 % | 2: 0.0100 | 20.0 |" in text
    assert "| never | 0.200 | 1.00 x | 0.0 | 0.000 | n/a | n/a | 1 | n/a |" in text
    assert "| H=20 int8 | 0.210 | 1.05 x | 10.0 | 0.000 |" in text  # (0.4 s held over 40 steps)
    bench.write(result, tmp_path)
    assert (tmp_path / "semi_sync.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "semi_sync.json").read_text())["compute_bound_step_s"] == 0.2
    monkeypatch.setattr("lightning_smp.testing.cluster.netadmin_problem", lambda: "needs root")
    assert bench.main(["--out", str(tmp_path / "none")]) == 2
    assert not (tmp_path / "none").exists()
