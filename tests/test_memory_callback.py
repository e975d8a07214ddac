"""MemorySavingsCallback: exact per-rank bytes against FSDP1's padding arithmetic, collectives against the textbook,
and the report's outputs (JSON, logger metrics, ``callback.report``) under hybrid sharding, DDP and one device."""

from __future__ import annotations

import csv
import json
import pickle
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from lightning_smp import HybridShardFSDPStrategy
from lightning_smp.accounting.memory import MEMORY_FIELDS, PEAK_FIELDS, measure_memory, shard_layout
from lightning_smp.callbacks import MemorySavingsCallback
from lightning_smp.callbacks.memory import REPORT_FILENAME
from lightning_smp.engines.fsdp1.flat import flat_param_numel
from lightning_smp.engines.textbook import FSDPUnitSpec, fsdp_step_textbook
from lightning_smp.names import (
    FULL_SHARD,
    HYBRID_SHARD,
    HYBRID_SHARD_ZERO2,
    NO_SHARD,
    OTHER_AXIS,
    REPLICATE_AXIS,
    SHARD_AXIS,
)
from tests.helpers import TinyModel, cpu_trainer, make_loader, run_distributed
from tests.oracles import floor_bytes, padding_per_rank, rank_bytes, unsharded_bytes

#: TinyModel's parameters (697 in all) as one FSDP unit (root only) or one unit per Linear layer.
ROOT_UNIT = [[n for layer in TinyModel.LAYER_NUMELS for n in layer]]
PER_LAYER = [list(layer) for layer in TinyModel.LAYER_NUMELS]
WORLD = 4


def _fit(tmp_path: Path, strategy, devices: int = WORLD, max_steps: int = 4, **kwargs) -> dict[str, list[dict]]:
    """A fork-launched fit with only the memory callback (no probe issuing its own collectives); the JSON reports."""
    torch.manual_seed(0)
    kwargs.setdefault("callbacks", [MemorySavingsCallback(print_table=False)])
    trainer = cpu_trainer(strategy, tmp_path, devices, max_steps=max_steps, **kwargs)
    trainer.fit(TinyModel(), make_loader())
    log_dir = Path(trainer.logger.log_dir) if trainer.logger else tmp_path
    return json.loads((log_dir / REPORT_FILENAME).read_text())["reports"]


def _expected_memory(units: list[list[int]], shard: int, group: int, rank: int) -> dict:
    held = rank_bytes(units, shard, rank % shard, group_size=group)  # Adam: exp_avg, exp_avg_sq, 4-byte step
    full = unsharded_bytes(units)
    unsharded_total = sum(full.values())
    padding = 2 * padding_per_rank(units, shard, group_size=group)
    total = held["params_bytes"] + held["grads_bytes"] + held["optimizer_bytes"]
    floor = floor_bytes(unsharded_total, shard, padding)
    return {
        "params_bytes": held["params_bytes"], "grads_bytes": held["grads_bytes"],
        "optimizer_bytes": held["optimizer_bytes"], "total_bytes": total,
        "unsharded_params_bytes": full["params_bytes"], "unsharded_grads_bytes": full["grads_bytes"],
        "unsharded_optimizer_bytes": full["optimizer_bytes"], "unsharded_total_bytes": unsharded_total,
        "saved_bytes": unsharded_total - total, "padding_bytes": padding, "floor_bytes": floor,
        "measured_over_floor": total / floor,
    }


def _measured(figure: dict | None) -> dict:
    return {(a, op): (e["count"], e["bytes"]) for a, ops in (figure or {}).items() for op, e in ops.items() if e["count"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("degree", "sharding", "wrap", "fsdp_runs"),
    [
        pytest.param(2, HYBRID_SHARD, True, HYBRID_SHARD, id="degree2_per_layer"),
        pytest.param(4, HYBRID_SHARD, False, FULL_SHARD, id="degree4"),
        pytest.param(2, HYBRID_SHARD_ZERO2, True, HYBRID_SHARD_ZERO2, id="degree2_zero2"),
    ],
)
def test_exact_bytes_and_collectives_per_rank(tmp_path: Path, degree: int, sharding: str, wrap: bool,
                                              fsdp_runs: str) -> None:
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, sharding_strategy=sharding, start_method="fork",
                                       auto_wrap_policy={torch.nn.Linear} if wrap else None)
    reports = _fit(tmp_path, strategy)
    units = PER_LAYER if wrap else ROOT_UNIT
    # NO_SHARD: one rank holds everything, padded to a multiple of FSDP's group (the whole world)
    shard, group = (1, WORLD) if degree == 1 else (degree, degree)
    replicas = WORLD // degree
    for stage in ("first_step", "fit_end"):
        records = reports[stage]
        assert [r["rank"] for r in records] == list(range(WORLD))
        for rank, record in enumerate(records):
            assert (record["sharding_strategy"], record["shard_degree"], record["replicas"]) == (fsdp_runs, shard, replicas)
            expected = _expected_memory(units, shard, group, rank)
            assert {k: record[k] for k in expected} == expected
    # the first step's collectives, per axis, equal the textbook figure for these units
    specs = [FSDPUnitSpec(flat_param_numel(u, group), is_root=not wrap) for u in units]
    # ... and the one-byte-per-parameter bitmap of parameters no rank used, on each axis of more than one rank
    bitmap = sum(len(u) for u in units)
    textbook = fsdp_step_textbook(specs, fsdp_runs, shard, replicas if degree > 1 else WORLD, unused_bitmap_bytes=bitmap)
    for record in reports["first_step"]:
        measured = _measured(record["comm"])
        # nothing but FSDP communicates during the step
        assert measured == _measured(textbook)
        assert _measured(record["comm_textbook"]) == _measured(textbook)
    if degree == 2 and sharding == HYBRID_SHARD:
        # hand-checked figure: 697 parameters over 2 shards; rank 0 holds [0, 350) of the root unit...
        r0 = reports["first_step"][0]
        assert (r0["params_bytes"], r0["unsharded_params_bytes"]) == (4 * (281 + 68), 4 * 697)
        # ...and 2 all-gathers of each Linear unit (not the root) inside the shard group, in one step
        assert _measured(r0["comm"])[(SHARD_AXIS, "all_gather")] == (4, 2 * 4 * (562 + 136))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("find_unused", [None, False], ids=["default", "find_unused_parameters_false"])
def test_degree_1_holds_the_whole_model_and_sends_one_bucket_per_step(tmp_path: Path, find_unused) -> None:
    """Degree 1 runs on the DDP engine (auto_wrap_policy describes sharding only, and is set aside): every rank holds
    every parameter whole, without FSDP's padding, and a step all-reduces the gradients in DDP's one bucket (2.7 KB,
    under its 1 MB first-bucket cap) and, unless find_unused_parameters=False, its used-parameter bitmap (4 bytes a
    parameter) over all ranks."""
    unused = {} if find_unused is None else {"find_unused_parameters": find_unused}
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=1, start_method="fork", auto_wrap_policy={torch.nn.Linear},
                                       **unused)
    reports = _fit(tmp_path, strategy)
    full = unsharded_bytes(ROOT_UNIT)
    params = len(ROOT_UNIT[0])
    for stage in ("first_step", "fit_end"):
        for rank, record in enumerate(reports[stage]):
            assert record["rank"] == rank
            assert (record["sharding_strategy"], record["shard_degree"], record["replicas"]) == (NO_SHARD, 1, WORLD)
            assert {k: record[k] for k in full} == full
            assert record["padding_bytes"] == 0 and record["saved_bytes"] == 0
    bitmap = 0 if find_unused is False else 1
    expected = {(REPLICATE_AXIS, "all_reduce"): (1 + bitmap, 4 * 697 + bitmap * 4 * params)}
    for record in reports["first_step"]:
        assert _measured(record["comm"]) == _measured(record["comm_textbook"]) == expected


@pytest.mark.timeout(120)
def test_gradient_accumulation_counts_every_micro_batch(tmp_path: Path) -> None:
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork", auto_wrap_policy={torch.nn.Linear})
    reports = _fit(tmp_path, strategy, max_steps=2, accumulate_grad_batches=3)
    specs = [FSDPUnitSpec(flat_param_numel(u, 2)) for u in PER_LAYER]
    # Lightning puts the first two micro-batches under FSDP's no_sync: they gather but do not reduce
    textbook = _measured(fsdp_step_textbook(specs, HYBRID_SHARD, 2, 2, backward_passes=3, synced_passes=1,
                                            unused_bitmap_bytes=4))
    assert textbook == {
        (SHARD_AXIS, "all_gather"): (3 * 2 * 2, 3 * 2 * 4 * (562 + 136)),
        (SHARD_AXIS, "reduce_scatter"): (2, 4 * (562 + 136)),
        (SHARD_AXIS, "all_reduce"): (1, 4),  # the bitmap of 4 parameters, once per optimizer step
        (REPLICATE_AXIS, "all_reduce"): (2 + 1, 4 * (281 + 68) + 4),
    }
    for record in reports["first_step"]:
        assert record["backward_passes"] == 3 and record["step"] == 1
        measured = _measured(record["comm"])
        assert {k: v for k, v in measured.items() if k[0] != OTHER_AXIS} == textbook
        assert _measured(record["comm_textbook"]) == textbook
        # Lightning's own per-batch SIGTERM broadcast (int64, world group) of micro-batches 2 and 3
        assert {k: v for k, v in measured.items() if k[0] == OTHER_AXIS} == {(OTHER_AXIS, "broadcast"): (2, 16)}


@pytest.mark.timeout(120)
def test_json_and_logger_metrics_have_documented_keys(tmp_path: Path) -> None:
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork")
    data = {"reports": _fit(tmp_path, strategy, max_steps=6, logger=CSVLogger(tmp_path, name="run", version=0))}
    log_dir = tmp_path / "run" / "version_0"
    assert json.loads((log_dir / REPORT_FILENAME).read_text())["version"] == 1
    assert set(data["reports"]) == {"first_step", "fit_end"}
    with open(log_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    for rank in range(WORLD):
        for field in MEMORY_FIELDS:
            if field in ("peak_allocated_bytes", "peak_reserved_bytes"):
                continue  # accelerators only (None on the CPU)
            assert f"memory/rank{rank}/{field}" in columns
        for axis, op in ((SHARD_AXIS, "all_gather"), (SHARD_AXIS, "reduce_scatter"), (REPLICATE_AXIS, "all_reduce")):
            for key in ("count", "bytes", "textbook_count", "textbook_bytes", "textbook_ring_bytes"):
                assert f"comm/rank{rank}/{axis}/{op}_{key}" in columns
    logged = {row["step"]: row for row in rows if row.get("memory/rank1/params_bytes")}
    # logged at the first step and at the end of fit, with the JSON's values
    assert sorted(logged, key=int) == ["1", "6"]
    first = data["reports"]["first_step"][1]
    assert float(logged["1"]["memory/rank1/params_bytes"]) == first["params_bytes"]
    logged_bytes = float(logged["1"][f"comm/rank1/{SHARD_AXIS}/all_gather_bytes"])
    assert logged_bytes == first["comm"][SHARD_AXIS]["all_gather"]["bytes"]


def _without_peaks(reports: dict) -> dict:
    return {stage: [{k: v for k, v in r.items() if k not in PEAK_FIELDS} for r in records]
            for stage, records in reports.items()}


@pytest.mark.timeout(120)
def test_report_is_identical_on_a_second_run(tmp_path: Path) -> None:
    runs = [
        _fit(tmp_path / str(i), HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork",
                                                        auto_wrap_policy={torch.nn.Linear}))
        for i in range(2)
    ]
    assert _without_peaks(runs[0]) == _without_peaks(runs[1])
    assert all(r["peak_rss_bytes"] > 0 for r in runs[0]["fit_end"])


@pytest.mark.timeout(120)
def test_under_lightning_ddp(tmp_path: Path) -> None:
    reports = _fit(tmp_path, DDPStrategy(start_method="fork"), devices=2)
    full = unsharded_bytes(ROOT_UNIT)
    for record in reports["first_step"]:
        # the DDP engine reads a DistributedDataParallel model, whoever built it: nothing sharded
        assert record["strategy"] == "DDPStrategy" and record["sharding_strategy"] == NO_SHARD
        assert (record["params_bytes"], record["grads_bytes"], record["optimizer_bytes"]) == (
            full["params_bytes"], full["grads_bytes"], full["optimizer_bytes"])
        assert record["saved_bytes"] == 0 and record["measured_over_floor"] == 1.0
        # one bucket: all 697 gradients all-reduced once across the two replicas
        assert _measured(record["comm"])[(REPLICATE_AXIS, "all_reduce")] == (1, 4 * 697)
        assert _measured(record["comm_textbook"]) == {(REPLICATE_AXIS, "all_reduce"): (1, 4 * 697)}


class _WideModel(TinyModel):
    """3.4 MB of gradients, more than DDP's 1 MB first-bucket cap: estimating from the caps says two buckets,
    while DDP on gloo all-reduces them in one. Only DDP knows, so the textbook reads the count from DDP."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 40_000), torch.nn.Tanh(), torch.nn.Linear(40_000, 4))


@pytest.mark.parametrize(("stage", "comm_step", "buckets"), [("first_step", 1, 1), ("fit_end", 3, 1)])
def test_ddp_textbook_uses_the_real_bucket_count(tmp_path: Path, stage: str, comm_step: int, buckets: int) -> None:
    torch.manual_seed(0)
    callback = MemorySavingsCallback(print_table=False, comm_step=comm_step)
    trainer = cpu_trainer(DDPStrategy(start_method="fork"), tmp_path, 2, max_steps=3, callbacks=[callback])
    trainer.fit(_WideModel(), make_loader())
    for record in json.loads((tmp_path / REPORT_FILENAME).read_text())["reports"][stage]:
        measured = _measured(record["comm"])[(REPLICATE_AXIS, "all_reduce")]
        assert measured[0] == buckets
        assert _measured(record["comm_textbook"]) == {(REPLICATE_AXIS, "all_reduce"): measured}


class _DispatchStackProbe(Callback):
    def __init__(self) -> None:
        self.depths: list[int] = []

    def on_train_batch_start(self, *args) -> None:
        self.depths.append(torch._C._len_torch_dispatch_stack())


@pytest.mark.parametrize("count", [True, False], ids=["counting", "off"])
def test_single_device_report_in_python(tmp_path: Path, count: bool) -> None:
    torch.manual_seed(0)
    callback = MemorySavingsCallback(count_communication=count, print_table=True)
    probe = _DispatchStackProbe()
    trainer = cpu_trainer("auto", tmp_path, 1, max_steps=3, callbacks=[callback, probe])
    trainer.fit(TinyModel(), make_loader())
    # a counting mode is installed for the first optimizer step only, and never when off
    assert probe.depths == ([1, 0, 0] if count else [0, 0, 0])
    assert [r["stage"] for r in callback.report] == ["fit_end"] and set(callback.reports) == {"first_step", "fit_end"}
    record = callback.report[0]
    full = unsharded_bytes(ROOT_UNIT)
    assert record["total_bytes"] == record["unsharded_total_bytes"] == sum(full.values())
    assert record["comm_textbook"] is None
    assert (record["comm"] is not None) == count and not _measured(record["comm"])
    assert pickle.loads(pickle.dumps(callback)).report == callback.report
    assert json.loads((tmp_path / REPORT_FILENAME).read_text())["reports"]["fit_end"] == callback.report


def _raw_fsdp_full_shard(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(TinyModel(), device_id=torch.device("cpu"), use_orig_params=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    return {"layout": shard_layout(model), **measure_memory(model, [optimizer])}


@pytest.mark.timeout(60)
def test_measures_plain_fsdp_without_lightning() -> None:
    """The path Lightning's own FSDPStrategy takes: FSDP units on the default group, no mesh."""
    for rank, record in enumerate(run_distributed(_raw_fsdp_full_shard, 2)):
        assert record["layout"] == (FULL_SHARD, 2, 1)
        expected = _expected_memory(ROOT_UNIT, 2, 2, rank)
        assert {k: record[k] for k in expected} == expected


class _ValidatedTinyModel(TinyModel):
    def validation_step(self, batch, batch_idx) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("comm_step", "root_gathers"), [(1, 0), (2, 1)], ids=["after_sanity_check", "steady"])
def test_comm_step_after_validation(tmp_path: Path, comm_step: int, root_gathers: int) -> None:
    """FSDP1 keeps the root unit gathered after the sanity check's no-grad forward: step 1 skips its all-gather, and
    the textbook figure of that step says so."""
    torch.manual_seed(0)
    trainer = cpu_trainer(
        HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork"), tmp_path, WORLD, max_steps=3,
        num_sanity_val_steps=1, limit_val_batches=1,
        callbacks=[MemorySavingsCallback(comm_step=comm_step, print_table=False)],
    )
    trainer.fit(_ValidatedTinyModel(), make_loader(), make_loader(samples=8))
    reports = json.loads((tmp_path / REPORT_FILENAME).read_text())["reports"]
    padded = flat_param_numel(ROOT_UNIT[0], 2)
    for first, end in zip(reports["first_step"], reports["fit_end"]):
        assert (first["comm"] is None) == (comm_step > 1)
        measured = _measured(end["comm"])
        assert measured.get((SHARD_AXIS, "all_gather"), (0, 0)) == (root_gathers, root_gathers * 4 * padded)
        assert measured[(SHARD_AXIS, "reduce_scatter")] == (1, 4 * padded)
        # the textbook knows it too: a step right after a forward without backward skips the root's all-gather
        assert _measured(end["comm_textbook"]).get((SHARD_AXIS, "all_gather"), (0, 0)) == measured.get(
            (SHARD_AXIS, "all_gather"), (0, 0))
        assert end["comm_mismatch"] == []


def test_comm_step_must_be_positive() -> None:
    from lightning_smp import HybridShardConfigError

    with pytest.raises(HybridShardConfigError, match="comm_step=0"):
        MemorySavingsCallback(comm_step=0)


def test_an_engine_without_the_accounting_role_is_reported_as_not_available(monkeypatch):
    """Accounting is an optional role of an engine: the report of a model whose engine does not take it says "n/a"
    where only the engine could answer, and nothing fails."""
    from lightning_smp.accounting import memory, render
    from lightning_smp.engines import ENGINES
    from lightning_smp.engines.base import Accounting

    assert all(isinstance(engine, Accounting) for engine in ENGINES)  # every engine of the package takes it

    class TrainingOnly:  # the protocol's training members would be here; none of the accounting ones
        name = "training-only"

    model = TinyModel()
    monkeypatch.setattr(memory, "engine_of", lambda module: TrainingOnly())
    record = measure_memory(model, [])
    assert record["shard_degree"] is None and all(record[f] is None for f in MEMORY_FIELDS if f not in PEAK_FIELDS)
    assert memory.textbook(model, 1) is None and memory.comm_groups(model) == {}
    assert memory.no_sync_extra_bytes(model) == 0 and memory.gradient_bytes(model) is None
    record.update(rank=0, stage="manual", step=0, strategy="TrainingOnly", comm=None, comm_textbook=None,
                  peak_allocated_bytes=None, peak_reserved_bytes=None, peak_rss_bytes=1 << 20)
    text = render.format_report([record])
    assert "sharding n/a" in text and text.count(render.NOT_AVAILABLE) >= 8
