"""Weight sync between ranks (``lightning_smp.replicas``): what every rank holds after a bucketed broadcast."""

from __future__ import annotations

import torch
from torch import nn

from lightning_smp import replicas
from lightning_smp.degree import resolve_layout
from lightning_smp.mesh import build_device_mesh
from lightning_smp.names import HYBRID_SHARD
from tests.helpers import run_distributed


class Mixed(nn.Module):
    """Parameters and buffers of several dtypes and layouts, different on every rank."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(7, 5, generator=gen))
        self.low = nn.Parameter(torch.randn(33, generator=gen).to(torch.bfloat16))
        self.empty = nn.Parameter(torch.empty(0))
        self.register_buffer("steps", torch.randint(0, 1000, (3,), generator=gen))
        self.register_buffer("transposed", torch.randn(4, 6, generator=gen).t())  # not contiguous


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _broadcast_in_small_buckets(rank: int, world_size: int) -> tuple[dict, dict]:
    replicas.BROADCAST_BUCKET_BYTES = 64  # several buckets, each mixing dtypes
    module = Mixed(seed=rank)
    before = _state(module)
    replicas.broadcast_module_state(module, torch.device("cpu"), src=0)
    assert module.transposed.stride() == (1, 6)  # written in place, layout kept
    return before, _state(module)


def test_broadcast_module_state_gives_every_rank_rank_0s_tensors():
    results = run_distributed(_broadcast_in_small_buckets, 3)
    rank0_before = results[0][0]
    assert not torch.equal(results[1][0]["weight"], rank0_before["weight"])  # the ranks did start differently
    for _, after in results:
        assert after.keys() == rank0_before.keys()
        for key, value in rank0_before.items():
            assert after[key].dtype == value.dtype
            assert torch.equal(after[key], value), key


def _across_replicas(rank: int, world_size: int) -> dict:
    replicas.BROADCAST_BUCKET_BYTES = 100
    mesh = build_device_mesh(resolve_layout(world_size, 2, HYBRID_SHARD), "cpu")  # shard groups [0, 1], [2, 3]
    module = Mixed(seed=rank)
    replicas.broadcast_across_replicas(module, mesh, torch.device("cpu"))
    return _state(module)


def test_broadcast_across_replicas_copies_each_shard_from_replica_0():
    states = run_distributed(_across_replicas, 4)
    seeds = [Mixed(seed=r) for r in range(4)]
    for rank, state in enumerate(states):
        # parameters come from the rank holding the same shard index in replica 0 (rank 2 <- 0, rank 3 <- 1)
        source = seeds[rank % 2]
        assert torch.equal(state["weight"], source.weight.detach())
        assert torch.equal(state["low"], source.low.detach())
        # buffers are not sharded: global rank 0's everywhere
        assert torch.equal(state["steps"], seeds[0].steps)
        assert torch.equal(state["transposed"], seeds[0].transposed)


def _before_wrapping(rank: int, world_size: int) -> tuple[bool, bool, float]:
    with torch.device("meta"):
        on_meta = nn.Linear(2, 2)
    skipped = replicas.broadcast_before_wrapping(on_meta, torch.device("cpu"))  # nothing sent: no rank waits
    full = nn.Linear(2, 2)
    nn.init.constant_(full.weight, float(rank))
    synced = replicas.broadcast_before_wrapping(full, torch.device("cpu"))
    return skipped, synced, full.weight.sum().item()


def test_broadcast_before_wrapping_skips_meta_models():
    assert run_distributed(_before_wrapping, 2) == [(False, True, 0.0), (False, True, 0.0)]
