"""The FSDP2 engine (``fsdp_version=2``, ``fully_shard``) as real multi-process runs: what each rank holds and sends,
equality with DDP, and gradient accumulation that keeps gradients sharded and crosses replicas once per step.

The bodies that FSDP1 shares (accumulation modes, feature parity) are parametrized over the engine.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import GradientSyncError, HybridShardFSDPStrategy, MemorySavingsCallback, resolve_layout
from lightning_smp.engines import FSDP2Engine
from lightning_smp.names import (
    DEFER_ALL_REDUCE,
    EVERY_MICRO_BATCH,
    FULL_SHARD,
    HYBRID_SHARD,
    HYBRID_SHARD_ZERO2,
    NO_SHARD,
    NO_SYNC,
    REPLICATE_AXIS,
    SHARD_AXIS,
)
from tests.helpers import (
    BACKENDS,
    GLOO_TIMEOUT,
    TinyModel,
    accelerator_for,
    cpu_trainer,
    fit_and_record,
    make_loader,
    process_group_backend_for,
    require_devices,
)

TOL = 1e-5
WORLD = 4


def _state(model: torch.nn.Module) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _chunk_rows(rows: int, shard: int, rank: int) -> int:
    """Rows of dim 0 that ``rank`` of a shard group holds: ``torch.chunk``'s split, FSDP2's placement ``Shard(0)``."""
    chunk = math.ceil(rows / shard)
    return max(0, min(chunk, rows - rank * chunk))


@lru_cache(maxsize=None)
def ddp_reference(model_key: str, accelerator: str = "cpu", **trainer_kwargs: Any) -> tuple[list[float], dict]:
    """DDP on the same model, data and global batch: the loss curve and the final weights."""
    with TemporaryDirectory() as folder:
        torch.manual_seed(0)
        model = MODELS[model_key]()
        _, model, records = fit_and_record(DDPStrategy(start_method="fork"), Path(folder), WORLD, model=model,
                                           accelerator=accelerator, train_loader=LOADERS[model_key](),
                                           **dict(trainer_kwargs))
    return records[0]["losses"], _state(model)


# ---------------------------------------------------------------------------------------- models


class LoRABlock(torch.nn.Module):
    """A frozen base projection with a trainable low-rank update (most weights ``requires_grad=False``)."""

    def __init__(self, width: int, rank: int = 2) -> None:
        super().__init__()
        self.base = torch.nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = torch.nn.Linear(width, rank, bias=False)
        self.up = torch.nn.Linear(rank, width, bias=False)
        torch.nn.init.normal_(self.up.weight, std=0.1)  # LoRA starts B at zero; nonzero so both factors train

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.up(self.down(x))) + x


class FeatureModel(L.LightningModule):
    """Tied input/output embeddings, frozen LoRA bases, blocks for wrapping and activation checkpointing."""

    VOCAB, WIDTH = 11, 12

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(self.VOCAB, self.WIDTH)
        self.blocks = torch.nn.Sequential(LoRABlock(self.WIDTH), LoRABlock(self.WIDTH))
        self.head = torch.nn.Linear(self.WIDTH, self.VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return torch.nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


def token_loader(samples: int = 64, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, FeatureModel.VOCAB, (samples, 6), generator=g)
    return DataLoader(TensorDataset(tokens, tokens.roll(1, dims=1)), batch_size=batch_size)


MODELS = {"tiny": TinyModel, "features": FeatureModel}
LOADERS = {"tiny": make_loader, "features": token_loader}


def _fit(strategy: HybridShardFSDPStrategy, folder: Path, key: str = "tiny", **trainer_kwargs: Any):
    torch.manual_seed(0)
    return fit_and_record(strategy, folder, WORLD, model=MODELS[key](), train_loader=LOADERS[key](), **trainer_kwargs)


# ---------------------------------------------------------------------------------------- the degree rules


FSDP2_CONFIGS = [
    pytest.param(1, HYBRID_SHARD, (4, 1, NO_SHARD), id="degree1"),
    pytest.param(2, HYBRID_SHARD, (2, 2, HYBRID_SHARD), id="degree2"),
    pytest.param(2, HYBRID_SHARD_ZERO2, (2, 2, HYBRID_SHARD_ZERO2), id="degree2_zero2"),
    pytest.param(4, HYBRID_SHARD, (1, 4, FULL_SHARD), id="degree4"),
]


@pytest.mark.parametrize(("degree", "requested", "expected"), FSDP2_CONFIGS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_matches_ddp(tmp_path, backend, degree, requested, expected):
    """Mesh, placements, the exact local shard of every parameter, replica equality and DDP parity."""
    require_devices(backend, WORLD)
    accelerator = accelerator_for(backend)
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, sharding_strategy=requested, start_method="fork",
                                       fsdp_version=2, process_group_backend=process_group_backend_for(backend))
    trainer, model, records = _fit(strategy, tmp_path, accelerator=accelerator,
                                   callbacks=[MemorySavingsCallback(print_table=False, filename=None)])
    assert trainer.strategy.fsdp_version == 2 and trainer.strategy.gradient_accumulation == DEFER_ALL_REDUCE
    replicate, shard, name = expected
    layout = resolve_layout(WORLD, degree, requested)
    assert (layout.replicate, layout.shard, layout.sharding_strategy) == expected
    shapes = [p.shape for p in TinyModel().parameters()]
    report = trainer.callbacks[-1].report
    for rank, record in enumerate(records):
        assert record["shard_group"] == layout.shard_group(rank)
        assert record["replicate_group"] == layout.replicate_group(rank)
        # each parameter's local shard is its dim-0 chunk of this rank's place in the shard group
        position = layout.shard_group(rank).index(rank)
        expected_shapes = [(_chunk_rows(s[0], shard, position), *s[1:]) for s in shapes]
        assert [tuple(t.shape) for t in record["shards"]] == expected_shapes
        # the memory report measures FSDP2's padded allocation, to the byte: ceil(rows / shard) rows each
        padded = sum(math.ceil(s[0] / shard) * math.prod(s[1:]) for s in shapes)
        assert report[rank]["params_bytes"] == padded * 4
        assert report[rank]["sharding_strategy"] == name
        assert (report[rank]["shard_degree"], report[rank]["replicas"]) == (shard, replicate)
        # an axis whose group spans the world is the world group itself (DeviceMesh reuses it), so it also carries
        # the recorder's own loss all-reduce (4 bytes) and a barrier; FSDP2's own traffic is what the book says
        world_axis = REPLICATE_AXIS if shard == 1 else SHARD_AXIS if replicate == 1 else None
        assert {tuple(m) for m in report[rank]["comm_mismatch"]} <= {(world_axis, "all_reduce"), (world_axis, "other")}
        for axis in (REPLICATE_AXIS, SHARD_AXIS):
            counted, book = report[rank]["comm"][axis], report[rank]["comm_textbook"][axis]
            for op in ("all_gather", "reduce_scatter", "all_reduce"):
                extra = 4 if (axis, op) == (world_axis, "all_reduce") else 0
                assert counted[op]["bytes"] == book[op]["bytes"] + extra, (axis, op)
    for rank, record in enumerate(records):
        for peer in layout.replicate_group(rank):
            assert all(torch.equal(a, b) for a, b in zip(record["shards"], records[peer]["shards"])), (rank, peer)
    ddp_losses, ddp_weights = ddp_reference("tiny", accelerator=accelerator)
    assert max(abs(a - b) for a, b in zip(records[0]["losses"], ddp_losses)) <= TOL
    assert _max_diff(_state(model), ddp_weights) <= TOL


# ---------------------------------------------------------------------------------------- features, both engines

FEATURES = {
    "gradient_clip_val": 0.05,
    "gradient_clip_algorithm": "norm",
    "accumulate_grad_batches": 2,
}
FEATURE_CONFIGS = [
    pytest.param(2, 1, HYBRID_SHARD, None, id="fsdp2_degree1"),
    pytest.param(2, 2, HYBRID_SHARD, None, id="fsdp2_degree2"),
    pytest.param(2, 2, HYBRID_SHARD_ZERO2, None, id="fsdp2_degree2_zero2"),
    pytest.param(2, 4, HYBRID_SHARD, None, id="fsdp2_degree4"),
    pytest.param(2, 2, HYBRID_SHARD, EVERY_MICRO_BATCH, id="fsdp2_degree2_every_micro_batch"),
    pytest.param(2, 2, HYBRID_SHARD, NO_SYNC, id="fsdp2_degree2_no_sync"),
    pytest.param(1, 2, HYBRID_SHARD, None, id="fsdp1_degree2_no_sync"),
    pytest.param(1, 2, HYBRID_SHARD, EVERY_MICRO_BATCH, id="fsdp1_degree2_every_micro_batch"),
]


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize(("version", "degree", "requested", "accumulation"), FEATURE_CONFIGS)
def test_features_match_ddp(tmp_path, version, degree, requested, accumulation):
    """Tied embeddings, frozen LoRA bases, activation checkpointing, norm clipping over the whole model and
    accumulate_grad_batches=2 together: DDP's weights to 1e-5, whatever the engine and accumulation mode."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, sharding_strategy=requested, start_method="fork",
                                       fsdp_version=version, gradient_accumulation=accumulation,
                                       auto_wrap_policy={LoRABlock}, activation_checkpointing_policy={LoRABlock})
    trainer, model, records = _fit(strategy, tmp_path, "features", **FEATURES)
    assert trainer.strategy.fsdp_version == version
    assert trainer.strategy.gradient_accumulation == (accumulation or (DEFER_ALL_REDUCE if version == 2 else NO_SYNC))
    assert records[0]["counters"][0] == 6  # optimizer steps, each of 2 micro-batches
    ddp_losses, ddp_weights = ddp_reference("features", **FEATURES)
    assert _max_diff(_state(model), ddp_weights) <= TOL
    assert max(abs(a - b) for a, b in zip(records[0]["losses"], ddp_losses)) <= TOL
    # the features really acted: clipping changes the result, the tied weight stayed one tensor
    assert _max_diff(ddp_weights, ddp_reference("features", accumulate_grad_batches=2)[1]) > 1e-3
    assert model.head.weight is model.embed.weight
    assert not any(isinstance(m, CheckpointWrapper) for m in model.modules())  # the launching process's model

