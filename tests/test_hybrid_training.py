"""Real multi-process training: what each rank holds, and equality with DDP, on CPU (gloo) and, where GPUs
exist, on CUDA (NCCL). The DDP references are the suite's (``tests.helpers.ddp_fit``, fitted once per session).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_smp import HybridShardConfigError, HybridShardFSDPStrategy, resolve_layout
from lightning_smp.engines.fsdp1.flat import local_shard_numel
from lightning_smp.names import FULL, FULL_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2, NO_SHARD, SHARD_AXIS
from tests.helpers import (
    BACKENDS,
    FSDP_VERSIONS,
    LIGHTNING_DEFAULTS,
    NCCL_BACKENDS,
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
    run_distributed,
    weight_difference,
    weights_of,
)

TINY_NUMELS = [n for layer in TinyModel.LAYER_NUMELS for n in layer]




CONFIGS = [
    pytest.param(2, 1, HYBRID_SHARD, (2, 1, NO_SHARD), id="2ranks_degree1"),
    pytest.param(2, 2, HYBRID_SHARD, (1, 2, FULL_SHARD), id="2ranks_degree2"),
    pytest.param(4, 1, HYBRID_SHARD, (4, 1, NO_SHARD), id="4ranks_degree1"),
    pytest.param(4, 2, HYBRID_SHARD, (2, 2, HYBRID_SHARD), id="4ranks_degree2"),
    pytest.param(4, 2, HYBRID_SHARD_ZERO2, (2, 2, HYBRID_SHARD_ZERO2), id="4ranks_degree2_zero2"),
    pytest.param(4, 2, FULL_SHARD, (2, 2, HYBRID_SHARD), id="4ranks_degree2_overrides_full_shard"),
    pytest.param(4, 4, HYBRID_SHARD, (1, 4, FULL_SHARD), id="4ranks_degree4"),
    pytest.param(4, 0, HYBRID_SHARD, (1, 4, FULL_SHARD), id="4ranks_degree0_native"),
    pytest.param(8, 2, HYBRID_SHARD, (4, 2, HYBRID_SHARD), id="8ranks_degree2"),
]


@pytest.mark.parametrize(("devices", "degree", "requested", "expected"), CONFIGS)
@pytest.mark.parametrize("backend", BACKENDS)  # the timeout comes with the backend
def test_hybrid_training_matches_ddp(tmp_path, backend, devices, degree, requested, expected):
    """Groups, shard sizes, replica equality and DDP parity, on every backend of BACKENDS."""
    require_devices(backend, devices)
    accelerator = accelerator_for(backend)
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, sharding_strategy=requested, start_method="fork",
                                       process_group_backend=process_group_backend_for(backend))
    torch.manual_seed(0)
    trainer, model, records = fit_and_record(strategy, tmp_path, devices, model=TinyModel(), accelerator=accelerator)
    assert trainer.strategy.root_device.type == accelerator
    layout = resolve_layout(devices, degree, requested)
    assert trainer.strategy.engine.name == ("ddp" if layout.shard == 1 else "fsdp1")
    replicate, shard, fsdp_strategy = expected
    assert (layout.replicate, layout.shard, layout.sharding_strategy) == expected

    group_size = devices if fsdp_strategy == NO_SHARD else shard
    for rank, record in enumerate(records):
        assert record["rank"] == rank
        assert record["fsdp_strategy"] == fsdp_strategy
        # shard groups are consecutive ranks; replicate groups stride by the degree
        first = rank // shard * shard
        assert record["shard_group"] == layout.shard_group(rank) == list(range(first, first + shard))
        assert record["replicate_group"] == layout.replicate_group(rank)
        assert len(record["replicate_group"]) == replicate
        # each rank holds exactly FSDP's padded shard for this degree; nothing sharded runs on the DDP engine, whole
        held = sum(TINY_NUMELS) if shard == 1 else local_shard_numel(TINY_NUMELS, shard, group_size)
        assert sum(s.numel() for s in record["shards"]) == held

    # after training every replica holds identical shards
    for rank, record in enumerate(records):
        for peer in layout.replicate_group(rank):
            for mine, theirs in zip(record["shards"], records[peer]["shards"]):
                assert torch.equal(mine, theirs), (rank, peer)

    ddp_losses, ddp_weights = ddp_fit(TinyModel, devices, accelerator=accelerator)
    assert len(records[0]["losses"]) == len(ddp_losses) == 6
    assert max(abs(a - b) for a, b in zip(records[0]["losses"], ddp_losses)) <= parity_bound(2_000, world=devices)
    assert_matches_ddp(weights_of(model), ddp_weights, world=devices)


@pytest.mark.parametrize("backend", NCCL_BACKENDS)  # the timeout comes with the backend
def test_one_gpu_trains_with_bf16_mixed(tmp_path, backend):
    """What a single-GPU machine can check: the NCCL (or mixed) group, the mesh on "cuda", bf16 autocast."""
    require_devices(backend, 1)
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=1, start_method="spawn",
                                       process_group_backend=process_group_backend_for(backend))
    torch.manual_seed(0)
    trainer, _, records = fit_and_record(strategy, tmp_path, 1, model=TinyModel(), accelerator=accelerator_for(backend),
                                         precision="bf16-mixed", max_steps=3)
    assert records[0]["fsdp_strategy"] == NO_SHARD
    assert all(torch.isfinite(torch.tensor(records[0]["losses"])))
    assert trainer.strategy.root_device.type == "cuda"


@pytest.mark.timeout(240)
def test_mixed_backend_string_reaches_the_mesh_groups(tmp_path):
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork", process_group_backend="cpu:gloo")
    _, _, records = fit_and_record(strategy, tmp_path, 4, max_steps=2)
    assert all(r["backends"] == ["cpu:gloo", "cpu:gloo"] for r in records)


@pytest.mark.timeout(240)
def test_trainer_defaults_work_on_cpu(tmp_path, recwarn):
    """Checkpointing, progress bar, logger and model summary on, as a user gets them without asking."""
    torch.manual_seed(0)
    trainer = cpu_trainer(HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork"), tmp_path, 4,
                          max_steps=4, **LIGHTNING_DEFAULTS)
    trainer.fit(TinyModel(), make_loader())
    assert trainer.global_step == 4
    saved = list((tmp_path / "lightning_logs" / "version_0" / "checkpoints").glob("*.ckpt"))
    assert len(saved) == 1
    # the launching process knows where the ranks saved it
    assert trainer.checkpoint_callback.best_model_path == str(saved[0])
    assert trainer.checkpoint_callback.dirpath == str(saved[0].parent)
    assert not [w for w in recwarn if "dirpath has changed" in str(w.message)]


def _process_group_contradicting_degree(rank: int, world_size: int) -> str:
    group = torch.distributed.new_group(list(range(world_size)))
    try:
        HybridShardFSDPStrategy(hybrid_shard_degree=2, process_group=group)
    except HybridShardConfigError as err:
        return str(err)
    return "no error"


@pytest.mark.timeout(120)
def test_process_group_contradicting_degree_is_refused():
    messages = run_distributed(_process_group_contradicting_degree, 4, timeout=60)
    # one error, the same on every rank; its message is lightning_smp.degree's (asserted in tests/test_degree.py)
    assert len(set(messages)) == 1
    assert messages[0].startswith("hybrid_shard_degree=2 ") and "process_group" in messages[0]


class ValidatedModel(TinyModel):
    def validation_step(self, batch, batch_idx) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)


def _fit_then_validate(rank: int, world_size: int, fsdp_version: int) -> tuple[bool, int, float, float]:
    # ranks started externally, as under torchrun: fit and validate run in the same processes
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=fsdp_version)
    trainer = cpu_trainer(strategy, devices=world_size, max_steps=2, limit_val_batches=1, num_sanity_val_steps=0)
    model = ValidatedModel()
    trainer.fit(model, make_loader(), make_loader())
    mesh = strategy.device_mesh
    val_loss = trainer.validate(model, make_loader(), verbose=False)[0]["val_loss"]
    shard_group = torch.distributed.get_process_group_ranks(strategy.device_mesh.get_group(SHARD_AXIS))
    # the same loss from the full weights: each rank's first validation batch (DistributedSampler), averaged
    reference = ValidatedModel()
    full = strategy.full_state_dict()  # a collective; the weights arrive on rank 0
    if rank == 0:
        reference.load_state_dict(full)
    x, y = make_loader().dataset.tensors
    with torch.no_grad():
        expected = sum(torch.nn.functional.mse_loss(reference(x[r::world_size][:4]), y[r::world_size][:4])
                       for r in range(world_size)) / world_size
    return strategy.device_mesh is mesh, len(shard_group), float(val_loss), float(expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fsdp_version", FSDP_VERSIONS)
def test_mesh_is_built_once_per_strategy_across_stages(fsdp_version):
    results = run_distributed(_fit_then_validate, 4, fsdp_version, timeout=90)
    assert all(r[:2] == (True, 2) for r in results)
    # validation after fit in the same processes uses the trained shards (a second wrap used to see 1-D views)
    assert abs(results[0][2] - results[0][3]) <= 1e-6


def _user_mesh_fit_and_save(rank: int, world_size: int, folder: str) -> list[int]:
    from torch.distributed.device_mesh import DeviceMesh

    # the user's own mesh: no axis names, and shard groups that are not consecutive ranks
    mesh = DeviceMesh("cpu", [[0, 2], [1, 3]])
    strategy = HybridShardFSDPStrategy(device_mesh=mesh, state_dict_type=FULL)
    trainer = cpu_trainer(strategy, folder, world_size, max_steps=2)
    with torch.device("meta"):
        model = RankSeededModel()  # materialised per rank: the replicas are synced through the user's mesh
    trainer.fit(model, make_loader())
    trainer.save_checkpoint(f"{folder}/user_mesh.ckpt")
    full = strategy.full_state_dict()
    if rank == 0:
        saved = torch.load(f"{folder}/user_mesh.ckpt", weights_only=True)["state_dict"]
        assert all(torch.equal(saved[k], v) for k, v in full.items())
    return torch.distributed.get_process_group_ranks(strategy.model.process_group)


@pytest.mark.timeout(120)
def test_user_device_mesh_is_used_as_is(tmp_path):
    shard_groups = run_distributed(_user_mesh_fit_and_save, 4, str(tmp_path), timeout=90)
    assert shard_groups == [[0, 2], [1, 3], [0, 2], [1, 3]]


class RankSeededModel(TinyModel):
    """Every rank initialises its own, different weights (no common seed), as an unseeded script would."""

    def setup(self, stage: str) -> None:
        if any(p.is_meta for p in self.parameters()):
            torch.manual_seed(100 + self.global_rank)  # FSDP materialises meta weights with this rank's generator
            return
        generator = torch.Generator().manual_seed(100 + self.global_rank)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("degree", [1, 2])
def test_replicas_start_from_rank0_weights(tmp_path, degree):
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, start_method="fork")
    torch.manual_seed(0)
    _, model, records = fit_and_record(strategy, tmp_path, 4, model=RankSeededModel())
    ddp_losses, ddp_weights = ddp_fit(RankSeededModel)
    assert max(abs(a - b) for a, b in zip(records[0]["losses"], ddp_losses)) <= PARITY_BOUND
    assert_matches_ddp(weights_of(model), ddp_weights)


@pytest.mark.timeout(240)
def test_meta_device_init_keeps_replicas_identical(tmp_path):
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork")
    with torch.device("meta"):
        model = RankSeededModel()
    assert all(p.is_meta for p in model.parameters())
    _, _, records = fit_and_record(strategy, tmp_path, 4, model=model)
    # the process that called fit gets the trained tensors even though its model was never materialised
    assert not any(p.is_meta for p in model.parameters())
    layout = resolve_layout(4, 2)
    for rank, record in enumerate(records):
        peer = layout.replicate_group(rank)[0]
        assert all(torch.equal(a, b) for a, b in zip(record["shards"], records[peer]["shards"]))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("degree", "algorithm", "value"),
    [(2, "norm", 0.05), (1, "norm", 0.05), (4, "norm", 0.05), (2, "value", 0.002)],
    ids=["degree2_norm", "degree1_norm", "degree4_norm", "degree2_value"],
)
def test_gradient_clipping_matches_ddp(tmp_path, degree, algorithm, value):
    clip = {"gradient_clip_val": value, "gradient_clip_algorithm": algorithm}
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, start_method="fork")
    torch.manual_seed(0)
    _, model, records = fit_and_record(strategy, tmp_path, 4, model=_SGDModel(), **clip)
    ddp_losses, ddp_weights = ddp_fit(_SGDModel, **clip)
    assert max(abs(a - b) for a, b in zip(records[0]["losses"], ddp_losses)) <= parity_bound(2_000, lr=_SGDModel().lr)
    assert_matches_ddp(weights_of(model), ddp_weights, lr=_SGDModel().lr)
    # clipping really acted: the unclipped run ends elsewhere
    assert weight_difference(weights_of(model), ddp_fit(_SGDModel)[1]) > 1e-3


class _SGDModel(TinyModel):
    def __init__(self) -> None:
        super().__init__(optimizer="sgd", lr=0.5)


class _HeadOnlySGD(_SGDModel):
    """An optimizer over the head alone while the body still requires grad (and gets gradients)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net[2].parameters(), lr=self.lr)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_norm_clipping_takes_the_optimizers_parameters(tmp_path, version):
    """Lightning and DDP clip the norm of the optimizer's parameters: the body's gradients must not shrink the
    head's."""
    clip = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=version, start_method="fork")
    torch.manual_seed(0)
    _, model, _ = fit_and_record(strategy, tmp_path, 4, model=_HeadOnlySGD(), **clip)
    _, ddp_weights = ddp_fit(_HeadOnlySGD, **clip)
    assert_matches_ddp(weights_of(model), ddp_weights, lr=_HeadOnlySGD().lr)


class _AutocastProbe(TinyModel):
    """Writes whether autocast runs in each rank's step, and its dtype (FSDP's param_dtype alone would give the
    forward's output that dtype too)."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        on = torch.is_autocast_enabled(self.device.type)
        (self.folder / f"dtype{self.global_rank}").write_text(str(torch.get_autocast_dtype(self.device.type)) if on
                                                              else "autocast off")
        return torch.nn.functional.mse_loss(out.float(), y)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_mixed_precision_autocasts_on_cpu(tmp_path, precision, dtype):
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork")
    torch.manual_seed(0)
    trainer, _, records = fit_and_record(strategy, tmp_path, 4, model=_AutocastProbe(tmp_path), precision=precision,
                                         max_steps=3)
    assert [(tmp_path / f"dtype{r}").read_text() for r in range(4)] == [str(dtype)] * 4  # the forward ran autocast
    plugin = trainer.strategy.precision_plugin
    assert plugin.device_type == "cpu"
    assert trainer.strategy.mixed_precision_config.param_dtype == dtype
    if precision == "16-mixed":  # a working loss scaler for the CPU, not CUDA's disabled one
        assert plugin.scaler._device == "cpu" and plugin.scaler._enabled
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in records)
    # FSDP keeps the sharded master weights in fp32
    assert all(s.dtype == torch.float32 for r in records for s in r["shards"])


def _bad_degree_in_every_rank(rank: int, world_size: int) -> str:
    # ranks started externally (torchrun-like): the check runs in each rank at Trainer(...), before any collective
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", GROUP_RANK="0", LOCAL_WORLD_SIZE=str(world_size),
                      TORCHELASTIC_RUN_ID="test")
    try:
        cpu_trainer(HybridShardFSDPStrategy(hybrid_shard_degree=3), devices=world_size)
    except HybridShardConfigError as err:
        return str(err)
    return "no error"


@pytest.mark.timeout(120)
def test_bad_degree_fails_identically_on_every_rank_without_hanging():
    messages = run_distributed(_bad_degree_in_every_rank, 2, timeout=60)
    assert messages[0] == messages[1]
    # the message is lightning_smp.degree's (asserted in tests/test_degree.py)
    assert messages[0].startswith("hybrid_shard_degree=3 ") and "world_size=2 " in messages[0]
