"""DiLoCo's outer loop (``lightning_smp.replica_sync``) on real process groups: the outer step is the paper's, the
groups leave every sync bit-equal (and differ between syncs), every bucket of the average is written back, fragments
sync in turn with an outer optimizer each, H = 1 with SGD is synchronous data parallelism, and FSDP2's shards sync
across the replicate axis of a (replicate, shard) mesh."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_smp import HybridShardConfigError
from lightning_smp.replica_sync import BUCKET_BYTES, OuterSync, fragment_sizes
from lightning_smp.testing import run_distributed
from tests.helpers import PARITY_BOUND

WORLD = 4
EPS = torch.finfo(torch.float32).eps


def _model() -> nn.Module:
    torch.manual_seed(0)  # every group starts from the same weights, as the strategies make them
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _digest(tensors: list[torch.Tensor]) -> str:
    return hashlib.sha1(b"".join(t.detach().contiguous().numpy().tobytes() for t in tensors)).hexdigest()


def _batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(32, 8, generator=generator), torch.randn(32, 4, generator=generator)


def _groups_of_one(rank: int, world: int, every: int, syncs: int, fragments: int, bucket_bytes: int) -> list:
    """Each rank a replica group of its own (AdamW inside, its own data); per step: the parameters before and after
    ``after_step``, the fragments it synced, and the digests of every rank's parameters."""
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer = OuterSync(model.parameters(), None, every=every, outer_lr=0.7, outer_momentum=0.9, nesterov=True,
                      fragments=fragments, bucket_bytes=bucket_bytes)
    generator = torch.Generator().manual_seed(100 + rank)
    history = []
    for _ in range(every * syncs):
        x, y = _batch(generator)
        inner.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        inner.step()
        before = [p.detach().clone() for p in model.parameters()]
        synced = outer.after_step()
        after = [p.detach().clone() for p in model.parameters()]
        digests: list[list[str]] = [[] for _ in range(world)]
        dist.all_gather_object(digests, [_digest([p]) for p in after])
        history.append((before, after, synced, digests))
    return history


def _reference(start: list[torch.Tensor], befores: list[list[torch.Tensor]], anchor_state: dict) -> list[torch.Tensor]:
    """The paper's outer step, written out (in float64): pseudo-gradient = last synced minus each group's local
    parameters, averaged over the groups; Nesterov momentum as torch's SGD (``v = mu v + g``, step ``g + mu v``)."""
    lr, mu = 0.7, 0.9
    anchor = []
    for index, synced in enumerate(start):
        g = sum(synced.double() - before[index].double() for before in befores) / len(befores)
        v = g if index not in anchor_state else mu * anchor_state[index] + g
        anchor_state[index] = v
        anchor.append(synced.double() - lr * (g + mu * v))
    return anchor


@pytest.mark.parametrize("bucket_bytes", [BUCKET_BYTES, 64], ids=["one_bucket", "many_buckets"])
def test_the_outer_step_is_the_paper_s_and_the_groups_leave_each_sync_equal(bucket_bytes):
    every, syncs = 3, 3
    runs = run_distributed(_groups_of_one, WORLD, every, syncs, 1, bucket_bytes)
    synced = [p.detach().clone() for p in _model().parameters()]
    momentum: dict = {}
    for step in range(every * syncs):
        befores = [run[step][0] for run in runs]
        afters = [run[step][1] for run in runs]
        digests = runs[0][step][3]
        if (step + 1) % every:
            assert runs[0][step][2] == [] and all(torch.equal(a, b) for a, b in zip(befores[0], afters[0]))
            assert digests[0] != digests[1]  # between syncs every group trains on its own data
            continue
        assert all(run[step][2] == [0] for run in runs)
        assert digests == [digests[0]] * WORLD  # bit-equal on every rank
        expected = _reference(synced, befores, momentum)
        # the ring's sum of WORLD terms is the float64 sum to WORLD ulps of the largest term; the step scales it by
        # lr (1 + mu) and adds one rounding of the anchor; momentum carries earlier errors on, at most 1/(1 - mu)
        for got, want, *parts in zip(afters[0], expected, *befores):
            term = max(float((p.double() - want).abs().max()) for p in parts) + float(want.abs().max())
            bound = (WORLD * 0.7 * 1.9 / 0.1 * (step // every + 1) + 2) * EPS * term
            assert float((got.double() - want).abs().max()) <= bound
        synced = afters[0]


def _sgd_groups(rank: int, world: int, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """H = 1, inner SGD without momentum, outer SGD lr 1 without momentum; beside it on every rank, synchronous data
    parallelism by hand (the gradients averaged over the world, the same SGD step)."""
    model, reference = _model(), _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    synchronous = torch.optim.SGD(reference.parameters(), lr=0.05)
    outer = OuterSync(model.parameters(), None, every=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = _batch(generator)
        for net, optimizer in ((model, inner), (reference, synchronous)):
            optimizer.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
        for p in reference.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        inner.step()
        synchronous.step()
        outer.after_step()
    return [p.detach() for p in model.parameters()], [p.detach() for p in reference.parameters()]


def test_every_step_with_sgd_is_synchronous_data_parallelism():
    for got, want in run_distributed(_sgd_groups, WORLD, 8):
        assert max(float((a - b).abs().max()) for a, b in zip(got, want)) <= PARITY_BOUND


def _fsdp2_groups(rank: int, world: int, every: int, fragments: int) -> list:
    """2 replica groups of 2 ranks, FSDP2 inside each (``fully_shard`` on the mesh's shard axis: nothing crosses the
    groups between syncs), the outer loop across the replicate axis; per step: the fragments synced and, per
    parameter, whether this rank's shard equals its replicate peer's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer = OuterSync(model.parameters(), mesh.get_group("replicate"), every=every, fragments=fragments)
    generator = torch.Generator().manual_seed(100 + rank)
    steps = []
    for _ in range(2 * every):
        x, y = _batch(generator)
        inner.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        inner.step()
        synced = outer.after_step()
        shards = [p.to_local().detach().clone() for p in model.parameters()]
        peers: list[list[torch.Tensor]] = [[] for _ in range(2)]
        dist.all_gather_object(peers, shards, group=mesh.get_group("replicate"))
        steps.append((synced, [bool(torch.equal(a, b)) for a, b in zip(*peers)]))
    return steps


def test_fsdp2_shards_sync_across_the_replicate_axis_fragment_by_fragment():
    # 4 parameters (128, 16, 64 and 4 elements) in 2 fragments of about half the elements (the first weight; the
    # rest), every 2 steps each, in turn
    assert fragment_sizes([128, 16, 64, 4], 2) == [1, 3]
    for steps in run_distributed(_fsdp2_groups, WORLD, 2, 2):
        assert [synced for synced, _ in steps] == [[0], [1], [0], [1]]
        assert [equal for _, equal in steps] == [[True, False, False, False], [False, True, True, True]] * 2


def _resumed(rank: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Six steps at H = 4 straight through, and the same with the outer loop's state saved after step 3 and loaded
    into a new one (the model and the inner optimizer carried over as a checkpoint would)."""
    results = []
    for resume in (False, True):
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        outer = OuterSync(model.parameters(), None, every=4)
        generator = torch.Generator().manual_seed(100 + rank)
        for step in range(6):
            if resume and step == 3:
                state = outer.state_dict()
                outer = OuterSync(model.parameters(), None, every=4)  # it would snapshot today's (unsynced) weights
                outer.load_state_dict(state)
            x, y = _batch(generator)
            inner.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            inner.step()
            outer.after_step()
        results.append([p.detach() for p in model.parameters()])
    return results[0], results[1]


def test_the_outer_state_resumes_mid_window_exactly():
    for straight, resumed in run_distributed(_resumed, 2):
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_fragments_are_contiguous_balanced_and_never_empty():
    assert fragment_sizes([10, 10, 10, 10], 2) == [2, 2]
    assert fragment_sizes([100, 1, 1, 1], 2) == [1, 3]
    assert fragment_sizes([5, 5, 30], 3) == [1, 1, 1]
    with pytest.raises(HybridShardConfigError, match="fragments=4 for 3 parameters"):
        fragment_sizes([1, 1, 1], 4)
    with pytest.raises(HybridShardConfigError, match="every=5 is not a multiple of fragments=2.*Fix: every=4"):
        OuterSync(_model().parameters(), None, every=5, fragments=2)
    with pytest.raises(HybridShardConfigError, match="every=0 is not a number of steps"):
        OuterSync(_model().parameters(), None, every=0)
