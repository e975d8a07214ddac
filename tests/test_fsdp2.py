"""The FSDP2 engine (``fsdp_version=2``, ``fully_shard``) as real multi-process runs: what each rank holds and sends,
equality with DDP, and gradient accumulation that keeps gradients sharded and crosses replicas once per step.

The bodies that FSDP1 shares (accumulation modes, feature parity) are parametrized over the engine.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_smp import GradientSyncError, HybridShardFSDPStrategy, MemorySavingsCallback, resolve_layout
from lightning_smp.engines import FSDP2Engine
from lightning_smp.engines.fsdp2.groups import fsdp_modules
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
    PARITY_BOUND,
    TinyModel,
    accelerator_for,
    assert_matches_ddp,
    cpu_trainer,
    ddp_fit,
    fit_and_record,
    make_loader,
    parity_bound,
    process_group_backend_for,
    require_devices,
    weight_difference,
    weights_of,
)
from tests.modules import FeatureModel, LoRABlock, token_loader

WORLD = 4


def _chunk_rows(rows: int, shard: int, rank: int) -> int:
    """Rows of dim 0 that ``rank`` of a shard group holds: ``torch.chunk``'s split, FSDP2's placement ``Shard(0)``."""
    chunk = math.ceil(rows / shard)
    return max(0, min(chunk, rows - rank * chunk))


# ---------------------------------------------------------------------------------------- models


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
        assert report[rank]["grads_bytes"] == padded * 4  # one padded reduce-scatter output per module
        # Adam: exp_avg and exp_avg_sq shaped like the unpadded local shard, and one fp32 step per parameter
        local = sum(math.prod(t.shape) for t in record["shards"])
        assert report[rank]["optimizer_bytes"] == 2 * 4 * local + 4 * len(shapes)
        assert report[rank]["unsharded_optimizer_bytes"] == 2 * 4 * sum(math.prod(s) for s in shapes) + 4 * len(shapes)
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
    ddp_losses, ddp_weights = ddp_fit(TinyModel, WORLD, accelerator=accelerator)
    assert max(abs(a - b) for a, b in zip(records[0]["losses"], ddp_losses)) <= PARITY_BOUND
    assert_matches_ddp(weights_of(model), ddp_weights)


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
    accumulate_grad_batches=2 together: DDP's weights within the parity bound, whatever the engine and accumulation mode."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, sharding_strategy=requested, start_method="fork",
                                       fsdp_version=version, gradient_accumulation=accumulation,
                                       auto_wrap_policy={LoRABlock}, activation_checkpointing_policy={LoRABlock})
    trainer, model, records = _fit(strategy, tmp_path, "features", **FEATURES)
    assert trainer.strategy.fsdp_version == version
    assert trainer.strategy.gradient_accumulation == (accumulation or (DEFER_ALL_REDUCE if version == 2 else NO_SYNC))
    assert records[0]["counters"][0] == 6  # optimizer steps, each of 2 micro-batches
    ddp_losses, ddp_weights = ddp_fit(FeatureModel, WORLD, loader_factory=token_loader, **FEATURES)
    assert_matches_ddp(weights_of(model), ddp_weights, lr=0.5, momentum=0.9)  # FeatureModel's SGD
    assert max(abs(a - b) for a, b in zip(records[0]["losses"], ddp_losses)) <= parity_bound(2_000, lr=0.5,
                                                                                             momentum=0.9)
    # the features really acted: clipping changes the result, the tied weight stayed one tensor
    unclipped = ddp_fit(FeatureModel, WORLD, loader_factory=token_loader, accumulate_grad_batches=2)[1]
    assert weight_difference(ddp_weights, unclipped) > 1e-3
    assert model.head.weight is model.embed.weight
    assert not any(isinstance(m, CheckpointWrapper) for m in model.modules())  # the launching process's model


# ---------------------------------------------------------------------------------------- gradient accumulation


def _accumulation_report(folder: Path, version: int, accumulation: str | None, k: int) -> list[dict]:
    """The first-step report of TinyModel at degree 2 on 4 ranks (AdamW) with ``accumulate_grad_batches=k``."""
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork", fsdp_version=version,
                                       gradient_accumulation=accumulation)
    callback = MemorySavingsCallback(print_table=False, filename=None)
    torch.manual_seed(0)
    trainer = cpu_trainer(strategy, folder, WORLD, max_steps=2, accumulate_grad_batches=k, callbacks=[callback])
    trainer.fit(TinyModel(), make_loader())
    return callback.reports["first_step"]


ACCUMULATIONS = [
    pytest.param(2, None, id="fsdp2_defer_all_reduce"),
    pytest.param(2, EVERY_MICRO_BATCH, id="fsdp2_every_micro_batch"),
    pytest.param(2, NO_SYNC, id="fsdp2_no_sync"),
    pytest.param(1, None, id="fsdp1_no_sync"),
    pytest.param(1, EVERY_MICRO_BATCH, id="fsdp1_every_micro_batch"),
]


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize(("version", "accumulation"), ACCUMULATIONS)
def test_accumulation_traffic_and_gradient_memory(tmp_path, version, accumulation):
    """k=4 against k=1: what crosses the replicas per optimizer step, what stays inside the shard group, and the most
    gradient memory a rank holds during the step, measured and equal to the textbook."""
    k = 4
    once = _accumulation_report(tmp_path / "k1", version, accumulation, 1)
    accumulated = _accumulation_report(tmp_path / "k4", version, accumulation, k)
    mode = accumulated[0]["gradient_accumulation"]
    assert mode == (accumulation or (DEFER_ALL_REDUCE if version == 2 else NO_SYNC))
    for one, many in zip(once, accumulated):
        assert many["comm_mismatch"] == [] and one["comm_mismatch"] == []
        assert many["backward_passes"] == k
        replica_bytes = many["comm"][REPLICATE_AXIS]["all_reduce"]["bytes"]
        scattered = many["comm"][SHARD_AXIS]["reduce_scatter"]["count"]
        sharded_grads = one["grads_bytes"]
        assert sharded_grads == one["params_bytes"]  # k=1: the padded shard of every parameter's gradient
        # the bitmap of parameters no rank used: one all-reduce on each axis per optimizer step, whatever k is
        bitmap = one["comm"][SHARD_AXIS]["all_reduce"]["bytes"]
        assert bitmap == many["comm"][SHARD_AXIS]["all_reduce"]["bytes"] > 0
        if mode == EVERY_MICRO_BATCH:
            assert replica_bytes - bitmap == k * (one["comm"][REPLICATE_AXIS]["all_reduce"]["bytes"] - bitmap)
            assert scattered == k * one["comm"][SHARD_AXIS]["reduce_scatter"]["count"]
            assert many["grads_bytes"] == sharded_grads
        elif mode == DEFER_ALL_REDUCE:
            # one crossing of the replicas per optimizer step whatever k is, every micro-batch reduce-scattered
            assert replica_bytes == one["comm"][REPLICATE_AXIS]["all_reduce"]["bytes"]
            assert scattered == k * one["comm"][SHARD_AXIS]["reduce_scatter"]["count"]
            # the partial reduce buffer is a shard too: never more than (1 + 1/d) x the sharded gradient
            assert sharded_grads <= many["grads_bytes"] <= sharded_grads * (1 + 1 / 2)
        else:
            assert replica_bytes == one["comm"][REPLICATE_AXIS]["all_reduce"]["bytes"]
            assert scattered == one["comm"][SHARD_AXIS]["reduce_scatter"]["count"]
            # no_sync: every rank holds the full unsharded gradient, and the report shows it
            unsharded = many["unsharded_grads_bytes"]
            assert many["grads_bytes"] >= unsharded > sharded_grads


class _WarningProbe(L.Callback):
    """Records the warnings each rank raises from ``setup`` on (the strategy warns inside the ranks) to a file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._catcher.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{trainer.global_rank}.txt").write_text("\n".join(str(w.message) for w in self._caught))


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("chosen", [None, NO_SYNC])
def test_fsdp1_no_sync_warns_once_with_the_cost(tmp_path, chosen):
    """Rank 0 warns once, with the exact extra bytes per rank and the fix; choosing no_sync explicitly silences it."""
    from lightning_smp.engines.fsdp1.flat import local_shard_numel

    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork", gradient_accumulation=chosen)
    trainer = cpu_trainer(strategy, tmp_path, WORLD, max_steps=2, accumulate_grad_batches=2,
                          callbacks=[_WarningProbe(tmp_path / "warnings")])
    trainer.fit(TinyModel(), make_loader())
    caught = [(tmp_path / "warnings" / f"rank{r}.txt").read_text() for r in range(WORLD)]
    if chosen == NO_SYNC:
        assert not any("no_sync" in text for text in caught)
        return
    assert caught[0].count("runs the fsdp1 engine's no_sync") == 1 and not any("no_sync" in text for text in caught[1:])
    # the unsharded padded flat parameter instead of this rank's half of it
    numels = [n for layer in TinyModel.LAYER_NUMELS for n in layer]
    extra = 4 * (local_shard_numel(numels, 1, 2) - local_shard_numel(numels, 2))
    assert f"({extra} bytes) more per rank" in caught[0] and "Fix: fsdp_version=2" in caught[0]


class _LeavesAllReduceOff(TinyModel):
    """A user's mistake: turns FSDP2's cross-replica all-reduce off on every micro-batch, the last one too."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trainer.strategy.model.set_requires_all_reduce(False)
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_step_on_gradients_never_reduced_is_refused(tmp_path):
    """The known trap (``.grad`` stays None, the optimizer silently does nothing) fails loudly, in every rank."""
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork", fsdp_version=2)
    with pytest.raises(GradientSyncError, match="set_requires_all_reduce"):
        cpu_trainer(strategy, tmp_path, WORLD, max_steps=2).fit(_LeavesAllReduceOff(), make_loader())


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_accumulation_that_never_turns_the_all_reduce_back_on_fails(tmp_path, monkeypatch):
    """If the strategy's own accumulation context forgot to re-enable the all-reduce for the last micro-batch, the
    run must fail, not train on nothing."""
    from contextlib import contextmanager

    @contextmanager
    def broken(self, model, all_reduce_only):
        for module in fsdp_modules(model):
            module.set_requires_all_reduce(False, recurse=False)
        yield  # and never turned back on

    monkeypatch.setattr(FSDP2Engine, "_reducing_off", broken)
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork", fsdp_version=2)
    with pytest.raises(GradientSyncError):
        cpu_trainer(strategy, tmp_path, WORLD, max_steps=2, accumulate_grad_batches=2).fit(TinyModel(), make_loader())


# ---------------------------------------------------------------------------------------- model creation


class RankSeededModel(TinyModel):
    """Every rank initialises its own, different weights (no common seed), as an unseeded script would."""

    def setup(self, stage: str) -> None:
        torch.manual_seed(100 + self.global_rank)  # meta weights are materialised with this rank's generator
        if not any(p.is_meta for p in self.parameters()):
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape) * 0.3)


class ShardsItself(TinyModel):
    """Shards its first layer itself in ``configure_model`` with a plain ``fully_shard(layer)`` (no mesh)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if not FSDP2Engine().has_wrapped(self.net[0]):
            torch.manual_seed(100 + self.global_rank)  # different weights per rank: replicas must still agree
            self.net[0].reset_parameters()
            fully_shard(self.net[0])


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("how", ["seeded_per_rank", "meta_device", "init_module_empty", "shards_itself"])
def test_replicas_start_from_rank0_and_stay_identical(tmp_path, how):
    """FSDP2 has no sync_module_states: however the model was created, every replica trains the same shards."""
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork", fsdp_version=2)
    trainer = None
    if how == "meta_device":
        with torch.device("meta"):
            model = RankSeededModel()
    elif how == "init_module_empty":
        trainer = cpu_trainer(strategy, tmp_path, WORLD, max_steps=6)
        with trainer.init_module(empty_init=True):
            model = RankSeededModel()
        assert all(p.is_meta for p in model.parameters())
    else:
        model = ShardsItself() if how == "shards_itself" else RankSeededModel()
    if trainer is None:
        _, model, records = fit_and_record(strategy, tmp_path, WORLD, model=model)
    else:
        from tests.helpers import RankRecorder

        trainer.callbacks.append(RankRecorder(tmp_path / "records"))
        trainer.fit(model, make_loader())
        records = [torch.load(tmp_path / "records" / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    layout = resolve_layout(WORLD, 2)
    for rank, record in enumerate(records):
        assert all(torch.isfinite(s).all() for s in record["shards"])
        for peer in layout.replicate_group(rank):
            assert all(torch.equal(a, b) for a, b in zip(record["shards"], records[peer]["shards"])), (rank, peer)
    if how == "seeded_per_rank":  # exactly DDP, which also starts every rank from rank 0's weights
        ddp_losses, _ = ddp_fit(RankSeededModel, WORLD)
        assert max(abs(a - b) for a, b in zip(records[0]["losses"], ddp_losses)) <= PARITY_BOUND
    if how == "shards_itself":  # fully_shard(layer) without a mesh got the strategy's 2-D mesh, not torch's 1-D one
        for rank, record in enumerate(records):
            assert record["shards"][0].shape == (_chunk_rows(33, 2, layout.shard_group(rank).index(rank)), 16)


# ---------------------------------------------------------------------------------------- arguments and sources


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"use_orig_params": False}, r"use_orig_params=False is an FSDP1 argument .* FSDP2 always keeps the original"),
    ({"limit_all_gathers": True}, r"limit_all_gathers=True is an FSDP1 argument"),
    ({"forward_prefetch": True}, r"set_modules_to_forward_prefetch"),
    ({"sync_module_states": True}, r"replicas always start from global rank 0"),
    ({"reshard_after_forward": False}, r"choose sharding_strategy"),
    ({"ignored_modules": []}, r"ignored_params"),
    ({"not_an_argument": 1}, r"not_an_argument=1 is not an argument of fully_shard"),
])
def test_fsdp1_arguments_are_refused_naming_the_fsdp2_equivalent(kwargs, message):
    from lightning_smp import UnsupportedOptionError

    with pytest.raises(UnsupportedOptionError, match=message):
        HybridShardFSDPStrategy(fsdp_version=2, **kwargs)


def test_engine_configs_of_the_other_engine_are_refused():
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy

    from lightning_smp import HybridShardConfigError, UnsupportedOptionError

    with pytest.raises(UnsupportedOptionError, match=r"mixed_precision=MixedPrecision\(...\) is an FSDP1 config"):
        HybridShardFSDPStrategy(fsdp_version=2, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    with pytest.raises(UnsupportedOptionError, match=r"mixed_precision=MixedPrecisionPolicy\(...\) is an FSDP2 config"):
        HybridShardFSDPStrategy(fsdp_version=1, mixed_precision=MixedPrecisionPolicy())
    with pytest.raises(UnsupportedOptionError, match=r"cpu_offload=CPUOffloadPolicy\(...\) is an FSDP2 config"):
        # without fsdp_version the engine is known once the Trainer resolves the configuration sources
        cpu_trainer(HybridShardFSDPStrategy(cpu_offload=CPUOffloadPolicy(pin_memory=False)), devices=WORLD)
    with pytest.raises(HybridShardConfigError, match=r"gradient_accumulation='defer_all_reduce' needs fsdp_version=2"):
        HybridShardFSDPStrategy(fsdp_version=1, gradient_accumulation=DEFER_ALL_REDUCE)
    with pytest.raises(HybridShardConfigError, match=r"gradient_accumulation='sometimes' is not supported"):
        HybridShardFSDPStrategy(gradient_accumulation="sometimes")
    with pytest.raises(HybridShardConfigError, match=r"fsdp_version=3 is not an FSDP version. Valid values: 1, 2"):
        HybridShardFSDPStrategy(fsdp_version=3)


@pytest.mark.parametrize("source", ["argument", "registered_name", "environment", "init", "cli_section"])
def test_fsdp_version_from_every_source(monkeypatch, tmp_path, source):
    """Resolved when the Trainer is created, before any process starts; a bad value fails there."""
    import json

    from lightning_smp import HybridShardConfigError, init, shutdown
    from lightning_smp.config import ENV_CONFIG, set_cli_config

    strategy: Any = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork")
    if source == "argument":
        strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork", fsdp_version=2)
    elif source == "registered_name":
        strategy = "smp_hybrid_fsdp2"
    elif source == "environment":
        monkeypatch.setenv(ENV_CONFIG, json.dumps({"fsdp_version": 2}))
    elif source == "init":
        init({"fsdp_version": 2})
    else:
        set_cli_config({"fsdp_version": 2})
    try:
        trainer = cpu_trainer(strategy, tmp_path, WORLD)
        assert trainer.strategy.fsdp_version == 2 and trainer.strategy.engine.name == "fsdp2"
        assert trainer.strategy.gradient_accumulation == DEFER_ALL_REDUCE
        if source == "environment":  # an FSDP1-only argument is refused once the source says FSDP2
            from lightning_smp import UnsupportedOptionError

            with pytest.raises(UnsupportedOptionError, match="limit_all_gathers"):
                cpu_trainer(HybridShardFSDPStrategy(limit_all_gathers=True), tmp_path, WORLD)
            monkeypatch.setenv(ENV_CONFIG, json.dumps({"fsdp_version": "2"}))
            with pytest.raises(HybridShardConfigError, match=rf"{ENV_CONFIG}: fsdp_version='2' is not an FSDP version"):
                cpu_trainer(HybridShardFSDPStrategy(), tmp_path, WORLD)
    finally:
        shutdown()
        set_cli_config(None)


def test_precision_maps_to_a_mixed_precision_policy():
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    from lightning_smp.engines import ShardingPlan
    from lightning_smp.engines.fsdp2.options import _mixed_precision_policy, _offload_policy

    layout = resolve_layout(WORLD, 2)
    cpu = torch.device("cpu")

    def plan(**kwargs: Any) -> ShardingPlan:
        return ShardingPlan(layout=layout, device=kwargs.pop("device", cpu), **kwargs)

    assert _mixed_precision_policy(plan(precision="32-true")) == MixedPrecisionPolicy()
    assert _mixed_precision_policy(plan(precision="bf16-true")) == MixedPrecisionPolicy()  # the module is bf16
    assert _mixed_precision_policy(plan(precision="bf16-mixed")) == MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    assert _mixed_precision_policy(plan(precision="16-mixed")) == MixedPrecisionPolicy(torch.float16, torch.float32)
    mine = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert _mixed_precision_policy(plan(precision="bf16-mixed", mixed_precision=mine)) is mine
    offload = _offload_policy(plan(cpu_offload=CPUOffload(offload_params=True)))
    assert isinstance(offload, CPUOffloadPolicy) and offload.pin_memory is False  # no pinned memory without a GPU
    assert _offload_policy(plan(cpu_offload=CPUOffload(offload_params=True), device=torch.device("cuda", 0))).pin_memory
    assert type(_offload_policy(plan(cpu_offload=CPUOffload(offload_params=False)))) is OffloadPolicy


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize(("precision", "cpu_offload"),
                         [("bf16-mixed", None), ("16-mixed", None), ("bf16-true", None), ("32-true", True)])
def test_precision_and_cpu_offload_train(tmp_path, precision, cpu_offload):
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork", fsdp_version=2,
                                       cpu_offload=cpu_offload)
    trainer, _, records = fit_and_record(strategy, tmp_path, WORLD, precision=precision, max_steps=3)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in records)
    # fp32 sharded master weights under *-mixed; a bf16 model (converted by the precision plugin) under bf16-true
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert all(s.dtype == dtype for r in records for s in r["shards"])
    if cpu_offload:  # the same numbers as without offloading (on a CPU the offload is a no-op that must not crash)
        _, _, plain = fit_and_record(HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork",
                                                             fsdp_version=2), tmp_path / "plain", WORLD, max_steps=3)
        assert records[0]["losses"] == plain[0]["losses"]


# ---------------------------------------------------------------------------------------- plain PyTorch


def _plain_fully_shard(rank: int, world_size: int, degree: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    import lightning_smp

    lightning_smp.init({"hybrid_shard_degree": degree})
    try:
        model = torch.nn.Linear(8, 6)
        fully_shard(model)  # no mesh: the configured one
        inside = (tuple(model.weight.device_mesh.shape), model.weight.device_mesh.mesh_dim_names)
        other = torch.nn.Linear(8, 6)
        own = dist.device_mesh.init_device_mesh("cpu", (world_size,))
        fully_shard(other, mesh=own)  # the caller's mesh wins
        mine = tuple(other.weight.device_mesh.shape)
    finally:
        lightning_smp.shutdown()
    after = torch.nn.Linear(8, 6)
    fully_shard(after)  # undone: torch's default 1-D world mesh again
    return {"inside": inside, "mine": mine, "after": tuple(after.weight.device_mesh.shape)}


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize(("degree", "shape", "names"), [
    (2, (2, 2), (REPLICATE_AXIS, SHARD_AXIS)), (4, (4,), (SHARD_AXIS,)), (1, (4, 1), (REPLICATE_AXIS, SHARD_AXIS)),
])
def test_init_gives_plain_fully_shard_the_configured_mesh(degree, shape, names):
    from tests.helpers import run_distributed

    for result in run_distributed(_plain_fully_shard, WORLD, degree):
        assert result == {"inside": (shape, names), "mine": (WORLD,), "after": (WORLD,)}


# ---------------------------------------------------------------------------------------- pieces, without processes


def test_auto_wrap_policies_pick_the_same_modules_as_fsdp1():
    """Every kind of policy FSDP1 and Lightning accept picks the modules FSDP1 would wrap, innermost first."""
    import functools

    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy, size_based_auto_wrap_policy

    from lightning_smp import UnsupportedOptionError
    from lightning_smp.engines.fsdp2.wrap import wrap_targets

    model = FeatureModel()
    blocks = list(model.blocks)
    assert wrap_targets(model, None) == []
    assert wrap_targets(model, {LoRABlock}) == blocks
    assert wrap_targets(model, ModuleWrapPolicy({LoRABlock})) == blocks
    assert wrap_targets(model, CustomPolicy(lambda m: isinstance(m, LoRABlock))) == blocks
    # a callable policy: exactly the modules FSDP1's own recursive wrapping would wrap, in its order
    from torch.distributed.fsdp.wrap import _recursive_wrap

    for threshold in (20, 150, 400):
        by_size = functools.partial(size_based_auto_wrap_policy, min_num_params=threshold)
        wrapped: list[torch.nn.Module] = []
        _recursive_wrap(model, by_size, lambda module, wrapped=wrapped, **kwargs: wrapped.append(module) or module,
                        ignored_modules=set(), ignored_params=set(), only_wrap_children=True)
        assert wrap_targets(model, by_size) == wrapped, threshold
        assert wrapped, threshold
    with pytest.raises(UnsupportedOptionError, match="auto_wrap_policy=3 is not a wrapping policy"):
        wrap_targets(model, 3)


def test_a_count_that_differs_from_the_textbook_is_marked():
    from lightning_smp.accounting.render import MISMATCH_MARK, comm_mismatches, comm_rows, comm_title

    def figure(gathers: int) -> dict:
        return {SHARD_AXIS: {"all_gather": {"count": gathers, "bytes": 8 * gathers, "ring_bytes": 4.0 * gathers}}}

    record = {"rank": 0, "comm": {**figure(1), "other": {"broadcast": {"count": 1, "bytes": 1}}},
              "comm_textbook": figure(2)}
    # Lightning's own world-group traffic ("other") has no textbook figure and is never marked
    assert comm_mismatches(record) == [(SHARD_AXIS, "all_gather")]
    rows = comm_rows([record])[1]
    assert [row[3] for row in rows] == [f"1 {MISMATCH_MARK}", "1"]
    agreed = {**record, "comm": figure(2)}
    assert comm_mismatches(agreed) == [] and MISMATCH_MARK not in str(comm_rows([agreed]))
    title = comm_title([{**record, "backward_passes": 4, "gradient_accumulation": DEFER_ALL_REDUCE}])
    assert title == (f"Collectives per rank in one optimizer step (4 micro-batch(es), defer_all_reduce); {MISMATCH_MARK}:"
                     " measured differs from the textbook")
    assert MISMATCH_MARK not in comm_title([agreed])


def _clip_over_shards(rank: int, world_size: int) -> tuple[str, float, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(REPLICATE_AXIS, SHARD_AXIS))
    torch.manual_seed(0)
    model = TinyModel()
    reference = TinyModel()
    reference.load_state_dict(model.state_dict())
    fully_shard(model.net[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))  # the same batch everywhere: grads agree
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    total = FSDP2Engine().clip_grad_norm(model, max_norm=0.5)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
    clipped = max((p.grad.full_tensor() - q.grad).abs().max().item()
                  for p, q in zip(model.parameters(), reference.parameters()))
    return type(total).__name__, abs(total.item() - expected.item()), clipped


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_norm_clipping_counts_every_shard_once_and_returns_a_plain_number():
    from tests.helpers import run_distributed

    for kind, norm_error, grad_error in run_distributed(_clip_over_shards, WORLD):
        assert kind == "Tensor"  # not a DTensor: loggable as is
        assert norm_error <= 1e-4 and grad_error <= 1e-6


class _StepWithoutForward(TinyModel):
    """A training step that calls a submodule, never ``self(...)``: the root's own parameters must still be gathered."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_steps_that_do_not_call_forward_train_and_validate(tmp_path):
    """FSDP2 gathers the root's parameters in its forward hooks; every step runs through them, whatever it calls."""
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork", fsdp_version=2)
    callback = MemorySavingsCallback(print_table=False, filename=None)
    torch.manual_seed(0)
    trainer = cpu_trainer(strategy, tmp_path, WORLD, max_steps=4, accumulate_grad_batches=2, limit_val_batches=2,
                          val_check_interval=4, callbacks=[callback])
    trainer.fit(_StepWithoutForward(), make_loader(), make_loader(samples=16))
    assert trainer.global_step == 4 and "val_loss" in trainer.callback_metrics
    # at the end of fit every parameter is counted once, as its shard (never also as a gathered copy)
    shapes = [p.shape for p in TinyModel().parameters()]
    padded = sum(math.ceil(s[0] / 2) * math.prod(s[1:]) for s in shapes)
    assert all(r["params_bytes"] == 4 * padded for r in callback.reports["fit_end"])


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_frozen_parameters_are_not_reduced_and_the_textbook_knows(tmp_path):
    """FSDP2 reduce-scatters and all-reduces only the parameters that require gradients (the frozen LoRA bases are
    gathered, never reduced): measured bytes equal the textbook's on both axes."""
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork", fsdp_version=2,
                                       auto_wrap_policy={LoRABlock})
    callback = MemorySavingsCallback(print_table=False, filename=None)
    torch.manual_seed(0)
    cpu_trainer(strategy, tmp_path, WORLD, max_steps=1, callbacks=[callback]).fit(FeatureModel(), token_loader())
    for record in callback.reports["first_step"]:
        assert record["comm_mismatch"] == []
        for axis in (SHARD_AXIS, REPLICATE_AXIS):
            for op in ("all_gather", "reduce_scatter", "all_reduce"):
                assert record["comm"][axis][op]["bytes"] == record["comm_textbook"][axis][op]["bytes"], (axis, op)
