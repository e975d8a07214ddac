"""Collective accounting: per-axis counts and bytes from real gloo collectives, textbook formulas, no side effects."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_smp.accounting.counter import CommCounter
from lightning_smp.degree import resolve_layout
from lightning_smp.engines.textbook import FSDPUnitSpec, fsdp_step_textbook, ring_bytes
from lightning_smp.mesh import build_device_mesh
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
from tests.helpers import fit_and_record, run_distributed


@pytest.mark.parametrize(
    ("op", "size", "n", "expected"),
    [
        pytest.param("all_gather", 1000, 4, 750, id="ag_4"),
        pytest.param("reduce_scatter", 1000, 2, 500, id="rs_2"),
        pytest.param("all_reduce", 1000, 4, 1500, id="ar_4"),
        pytest.param("all_reduce", 1000, 1, 0, id="ar_alone"),
    ],
)
def test_ring_bytes(op: str, size: int, n: int, expected: float) -> None:
    assert ring_bytes(op, size, n) == expected


def _nonzero(figure: dict) -> dict:
    return {
        (axis, op): (entry["count"], entry["bytes"])
        for axis, ops in figure.items() for op, entry in ops.items() if entry["count"]
    }


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        # root unit (20 elements): 1 all-gather; non-root (100): 2; one reduce-scatter each; 1/2 all-reduce each
        pytest.param(HYBRID_SHARD, {(SHARD_AXIS, "all_gather"): (3, 4 * 20 + 2 * 4 * 100),
                                    (SHARD_AXIS, "reduce_scatter"): (2, 4 * 120),
                                    (REPLICATE_AXIS, "all_reduce"): (2, 4 * 60)}, id="hybrid"),
        pytest.param(HYBRID_SHARD_ZERO2, {(SHARD_AXIS, "all_gather"): (2, 4 * 120),
                                          (SHARD_AXIS, "reduce_scatter"): (2, 4 * 120),
                                          (REPLICATE_AXIS, "all_reduce"): (2, 4 * 60)}, id="hybrid_zero2"),
        pytest.param(FULL_SHARD, {(SHARD_AXIS, "all_gather"): (3, 4 * 20 + 2 * 4 * 100),
                                  (SHARD_AXIS, "reduce_scatter"): (2, 4 * 120)}, id="full_shard"),
        pytest.param(SHARD_GRAD_OP, {(SHARD_AXIS, "all_gather"): (2, 4 * 120),
                                     (SHARD_AXIS, "reduce_scatter"): (2, 4 * 120)}, id="shard_grad_op"),
        pytest.param(NO_SHARD, {(REPLICATE_AXIS, "all_reduce"): (2, 4 * 120)}, id="no_shard"),
    ],
)
def test_fsdp_textbook_per_unit(strategy: str, expected: dict) -> None:
    units = [FSDPUnitSpec(padded_numel=20, is_root=True), FSDPUnitSpec(padded_numel=100)]
    once = fsdp_step_textbook(units, strategy, shard=2, replicate=2)
    assert _nonzero(once) == expected
    # gradient accumulation: every micro-batch gathers, reduce-scatters and all-reduces again
    twice = fsdp_step_textbook(units, strategy, shard=2, replicate=2, backward_passes=2)
    assert _nonzero(twice) == {k: (2 * c, 2 * b) for k, (c, b) in expected.items()}
    # ring bytes: (n-1)/n of the payload inside a group of 2, 2(n-1)/n for all-reduce
    for (axis, op), (_, size) in expected.items():
        assert once[axis][op]["ring_bytes"] == size * (1.0 if op == "all_reduce" else 0.5)


def _count_on_mesh(rank: int, world_size: int) -> tuple:
    layout = resolve_layout(world_size, 2)
    mesh = build_device_mesh(layout, "cpu")
    shard, replicate = mesh.get_group(SHARD_AXIS), mesh.get_group(REPLICATE_AXIS)
    counter = CommCounter(mesh)
    before = torch._C._len_torch_dispatch_stack()
    with counter:
        inside = torch._C._len_torch_dispatch_stack()
        x = torch.full((6,), float(rank))
        gathered = [torch.empty(6) for _ in range(2)]
        dist.all_gather(gathered, x, group=shard)                      # shard: 48 bytes gathered
        out = torch.empty(3)
        dist.reduce_scatter_tensor(out, torch.ones(6), group=shard)    # shard: 24 bytes reduced
        dist.all_reduce(x, group=replicate)                            # replicate: 24 bytes
        dist.all_reduce(torch.ones(10, dtype=torch.float64))           # world group: "other", 80 bytes
        dist.broadcast(torch.ones(5), src=0)                           # world group: "other"
    after = torch._C._len_torch_dispatch_stack()
    # collectives after exit are not counted
    dist.all_reduce(x, group=replicate)
    return counter.counts(), (before, inside, after), x.tolist(), out.tolist()


@pytest.mark.timeout(60)
def test_counter_attributes_collectives_to_mesh_axes() -> None:
    results = run_distributed(_count_on_mesh, 4)
    for rank, (counts, stack, x, out) in enumerate(results):
        assert stack == (0, 1, 0)  # nothing installed outside the counter
        got = {(a, op): (e["count"], e["bytes"]) for a, ops in counts.items() for op, e in ops.items() if e["count"]}
        assert got == {
            (SHARD_AXIS, "all_gather"): (1, 48),
            (SHARD_AXIS, "reduce_scatter"): (1, 24),
            (REPLICATE_AXIS, "all_reduce"): (1, 24),
            (OTHER_AXIS, "all_reduce"): (1, 80),
            (OTHER_AXIS, "broadcast"): (1, 20),
        }
        # results are those of the uncounted collectives: replicas r and r+2 summed, twice
        assert x == [2.0 * (rank % 2 + rank % 2 + 2)] * 6
        assert out == [2.0] * 3


def _count_dtensor_collectives(rank: int, world_size: int) -> tuple:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = build_device_mesh(resolve_layout(world_size, 2), "cpu")
    full = torch.arange(8, dtype=torch.float32)
    sharded = distribute_tensor(full, mesh, [Replicate(), Shard(0)])  # rows 4 apiece inside each shard group
    with CommCounter(mesh) as counter:
        gathered = sharded.full_tensor()                           # shard: one functional all-gather, 32 bytes
        summed = sharded.redistribute(mesh, [Replicate(), Shard(0)])  # already so: no collective
        total = torch.distributed.tensor.DTensor.from_local(
            torch.ones(3), mesh, [Replicate(), Shard(0)]).sum().full_tensor()  # a partial sum, all-reduced
    return counter.counts(), gathered.tolist(), summed.to_local().tolist(), float(total)


@pytest.mark.timeout(60)
def test_counter_counts_functional_collectives_by_group_name() -> None:
    """DTensor's collectives (``full_tensor()``, the state dict API under FSDP2) are functional collectives: they name
    their group by its name and are counted on that axis, as the c10d ones are."""
    for rank, (counts, gathered, summed, total) in enumerate(run_distributed(_count_dtensor_collectives, 4)):
        got = {(a, op): (e["count"], e["bytes"]) for a, ops in counts.items() for op, e in ops.items() if e["count"]}
        assert got == {(SHARD_AXIS, "all_gather"): (1, 32), (SHARD_AXIS, "all_reduce"): (1, 4)}, (rank, got)
        assert gathered == [float(i) for i in range(8)]
        assert summed == [float(i) for i in range(4 * (rank % 2), 4 * (rank % 2) + 4)]
        assert total == 6.0  # 3 ones on each of the 2 ranks of the shard group


@pytest.mark.timeout(120)
def test_counting_does_not_change_training(tmp_path) -> None:
    from lightning_smp import HybridShardFSDPStrategy
    from lightning_smp.callbacks import MemorySavingsCallback

    runs = []
    for count in (False, True):
        callback = MemorySavingsCallback(count_communication=count, print_table=False, filename=None)
        strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork", auto_wrap_policy={torch.nn.Linear})
        _, _, records = fit_and_record(strategy, tmp_path / str(count), devices=4, max_steps=4, callbacks=[callback])
        runs.append(records)
    for off, on in zip(*runs):
        assert off["losses"] == on["losses"]
        assert all(torch.equal(a, b) for a, b in zip(off["shards"], on["shards"]))
