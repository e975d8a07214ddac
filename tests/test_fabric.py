"""``Fabric(strategy="smp_hybrid")``: hand-written loops on the same core as the Trainer strategy, as real
multi-process runs (Fabric's fork launcher, gloo): equality with Fabric's DDP, what each rank holds and sends,
accumulation with ``no_backward_sync``, checkpoints across degree, world size, engine and front end."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy

from lightning_smp import (
    CheckpointError,
    GradientSyncError,
    HybridShardConfigError,
    count_communication,
    memory_report,
)
from lightning_smp.fabric import HybridShardFSDPStrategy
from lightning_smp.names import (
    DEFER_ALL_REDUCE,
    FULL,
    FULL_SHARD,
    HYBRID_SHARD,
    HYBRID_SHARD_ZERO2,
    NO_SHARD,
    NO_SYNC,
    REPLICATE_AXIS,
    SHARD_GRAD_OP,
    SHARDED,
    STATE_DICT_TYPES,
    STRATEGY_NAMES,
)
from tests.fabric_loops import (
    K,
    clipped_by_optimizer,
    fabric_state,
    full_weights,
    load_fabric_state,
    make_net,
    rank_batches,
    tiny_gpt2,
    window_dropped,
)
from tests.helpers import (
    FRONT_ENDS,
    FSDP_VERSIONS,
    GLOO_TIMEOUT,
    TinyModel,
    assert_matches_ddp,
    make_loader,
    rounding_residue_bound,
    weight_difference,
)

WORLD = 4
STEPS = 4


def _fabric(strategy: Any, devices: int = WORLD) -> L.Fabric:
    return L.Fabric(strategy=strategy, accelerator="cpu", devices=devices)


def _ours(degree: int, version: int, requested: str = HYBRID_SHARD, **kwargs: Any) -> HybridShardFSDPStrategy:
    return HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=version, sharding_strategy=requested,
                                   start_method="fork", **kwargs)


def train(fabric: L.Fabric, clip: dict[str, float], steps: int = STEPS) -> dict[str, Any]:
    """A litgpt-style step: k micro-batches under no_backward_sync but the last, clipping, AdamW."""
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    batches = iter(rank_batches(fabric))
    counted: dict | None = None
    for step in range(steps):
        counter = count_communication(model) if step == 1 else None
        if counter is not None:
            counter.__enter__()
        for micro in range(K):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < K - 1):
                fabric.backward(torch.nn.functional.mse_loss(model(x), y) / K)
        if counter is not None:
            counter.__exit__(None, None, None)  # clipping's norm reduction is not in the textbook
        fabric.clip_gradients(model, optimizer, **clip)
        if counter is not None:
            counter.__enter__()  # the step itself is: the all-reduce of the bitmap of parameters no rank used
        optimizer.step()
        if counter is not None:
            counter.__exit__(None, None, None)
            counted = counter.counts()
        optimizer.zero_grad()
    accumulation = getattr(fabric.strategy, "gradient_accumulation", NO_SYNC)  # Fabric's DDP: no_sync
    records = memory_report(model, [optimizer], comm=counted, backward_passes=K, accumulation=accumulation,
                            print_table=False)
    return {"weights": full_weights(fabric, model), "records": records}


@lru_cache(maxsize=None)
def ddp_reference(clip: tuple[tuple[str, float], ...]) -> dict[str, torch.Tensor]:
    result = _fabric(DDPStrategy(start_method="fork")).launch(train, dict(clip))
    return {k: torch.tensor(v) for k, v in result["weights"].items()}


# ---------------------------------------------------------------------------------------- names and checks


@pytest.mark.parametrize("name", [n for n, _, _ in STRATEGY_NAMES])
def test_every_name_is_registered_in_fabric(name):
    assert STRATEGY_REGISTRY[name]["strategy"] is HybridShardFSDPStrategy
    strategy = _fabric(name).strategy
    assert isinstance(strategy, HybridShardFSDPStrategy)
    init = next(args for n, _, args in STRATEGY_NAMES if n == name)
    # degree 0 on one node: native FSDP over the node (FULL_SHARD, or SHARD_GRAD_OP for the ZeRO-2 name)
    zero2 = init["sharding_strategy"] == HYBRID_SHARD_ZERO2
    assert strategy.layout.sharding_strategy == (SHARD_GRAD_OP if zero2 else FULL_SHARD)
    assert strategy.fsdp_version == init.get("fsdp_version", 1)
    assert strategy._start_method == init.get("start_method", "popen")


def test_bad_degree_fails_when_fabric_is_created():
    with pytest.raises(HybridShardConfigError, match="hybrid_shard_degree=3"):
        _fabric(HybridShardFSDPStrategy(hybrid_shard_degree=3))
    with pytest.raises(HybridShardConfigError, match="fsdp_version=7"):
        HybridShardFSDPStrategy(fsdp_version=7)


# ---------------------------------------------------------------------------------------- parity with DDP

CONFIGS = [
    pytest.param(version, degree, requested, id=f"fsdp{version}_{label}")
    for version in (1, 2)
    for degree, requested, label in ((1, HYBRID_SHARD, "degree1"), (2, HYBRID_SHARD, "degree2"),
                                     (2, HYBRID_SHARD_ZERO2, "degree2_zero2"), (4, HYBRID_SHARD, "degree4"))
]


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize(("version", "degree", "requested"), CONFIGS)
def test_fabric_loop_matches_ddp(version, degree, requested):
    """Norm clipping and no_backward_sync accumulation: DDP's weights within the parity bound, and what crosses the replicas."""
    clip = (("max_norm", 0.05),)
    result = _fabric(_ours(degree, version, requested)).launch(train, dict(clip))
    assert_matches_ddp(result["weights"], ddp_reference(clip))
    # clipping acted: unclipped DDP ends elsewhere
    assert weight_difference(result["weights"], ddp_reference((("max_norm", 1e9),))) > 1e-4
    for record in result["records"]:
        assert record["comm_mismatch"] == [] or degree in (1, 4)  # a world-spanning axis also counts Fabric's own
        if 1 < degree < WORLD:
            replicated = record["comm"][REPLICATE_AXIS]["all_reduce"]
            book = record["comm_textbook"][REPLICATE_AXIS]["all_reduce"]
            # one unit: one crossing per optimizer step of K, and the bitmap of parameters no rank used
            assert replicated["count"] == book["count"] == 2
            assert record["gradient_accumulation"] == (DEFER_ALL_REDUCE if version == 2 else NO_SYNC)


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_clipping_by_value_matches_ddp(version):
    clip = (("clip_val", 0.002),)
    result = _fabric(_ours(2, version)).launch(train, dict(clip))
    assert_matches_ddp(result["weights"], ddp_reference(clip))


def _step_after_unreduced_backward(fabric: L.Fabric) -> None:
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = rank_batches(fabric)[0]
    with fabric.no_backward_sync(model):
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()  # the gradients were never reduced


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_step_after_an_unreduced_backward_is_refused(version):
    # raised inside the forked ranks, it reaches the launching process as itself, as from the Trainer's launcher
    with pytest.raises(GradientSyncError, match="optimizer.step\\(\\) right after a backward"):
        _fabric(_ours(2, version)).launch(_step_after_unreduced_backward)


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_joint_setup_is_refused_under_fsdp2():
    def joint(fabric: L.Fabric) -> None:
        net = make_net()
        fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))

    with pytest.raises(HybridShardConfigError, match="fabric.setup_module\\(model\\), then"):
        _fabric(_ours(2, 2)).launch(joint)


# ---------------------------------------------------------------------------------------- model creation


def _meta_init(fabric: L.Fabric) -> list[list]:
    torch.manual_seed(100 + fabric.global_rank)  # every rank would initialise differently
    with fabric.init_module(empty_init=True):
        net = TinyModel().net
    assert all(p.is_meta for p in net.parameters())
    model = fabric.setup_module(net)
    from torch.distributed.tensor import DTensor

    local = [(p.to_local() if isinstance(p, DTensor) else p).detach().flatten().tolist() for p in model.parameters()]
    gathered: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(gathered, local)
    return gathered


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_meta_device_init_gives_identical_replicas(version):
    ranks = _fabric(_ours(2, version)).launch(_meta_init)
    for rank in range(WORLD):
        peer = (rank + 2) % WORLD  # the other replica of the same shard
        assert ranks[rank] == ranks[peer]
        assert all(math.isfinite(v) for tensor in ranks[rank] for v in tensor)


# ---------------------------------------------------------------------------------------- checkpoints


def _save(fabric: L.Fabric, folder: str, kind_steps: int, factory: Any = None) -> dict[str, Any]:
    """Train ``kind_steps`` steps, save, return the full state (rank 0)."""
    model = fabric.setup_module(factory() if factory is not None else make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    for x, y in rank_batches(fabric)[:kind_steps]:
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(Path(folder) / "ckpt", {"model": model, "optimizer": optimizer, "step": kind_steps})
    return fabric_state(fabric, model, optimizer)


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("kind", STATE_DICT_TYPES)
@pytest.mark.parametrize(("version", "degree", "devices"), [(2, 4, 4), (1, 1, 2), (1, 2, 4)],
                         ids=["fsdp2_d4_4r", "fsdp1_d1_2r", "fsdp1_d2_4r"])
def test_fabric_checkpoint_resumes_across_degree_world_size_and_engine(tmp_path, kind, version, degree, devices):
    saved = _fabric(_ours(2, 2, state_dict_type=kind)).launch(_save, str(tmp_path), 3)
    loaded = _fabric(_ours(degree, version, state_dict_type=kind), devices).launch(load_fabric_state, str(tmp_path / "ckpt"))
    assert loaded["weights"] == saved["weights"] and loaded["optimizer"] == saved["optimizer"]
    assert loaded["step"] == 3


def _trainer_writes(folder: Path, kind: str) -> Path:
    from lightning_smp import HybridShardFSDPStrategy as TrainerStrategy
    from tests.helpers import cpu_trainer

    class Net(TinyModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    module = Net()
    trainer = cpu_trainer(TrainerStrategy(hybrid_shard_degree=2, start_method="fork", state_dict_type=kind), folder,
                          WORLD, max_steps=2)
    trainer.fit(module, make_loader())
    path = folder / "trainer.ckpt"
    trainer.save_checkpoint(path)  # from the notebook-style launching process: one full file
    return path


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_checkpoints_cross_front_ends(tmp_path):
    """A Trainer checkpoint loads in Fabric; a Fabric one (either format) loads in one process and in the Trainer."""
    from lightning_smp import checkpoint as ckpt

    written = _trainer_writes(tmp_path, SHARDED)
    full = torch.load(written, weights_only=True)
    def load_trainer_checkpoint(fabric: L.Fabric, path: str) -> dict[str, list]:
        model = fabric.setup_module(Wrapped())
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
        remainder = fabric.load(path, {"model": model, "optimizer": optimizer})
        assert remainder["global_step"] == 2
        return full_weights(fabric, model)

    weights = _fabric(_ours(2, 2)).launch(load_trainer_checkpoint, str(written))
    assert {k: torch.tensor(v) for k, v in weights.items()}.keys() == full["state_dict"].keys()
    assert all(torch.equal(torch.tensor(weights[k]), v) for k, v in full["state_dict"].items())

    for kind in STATE_DICT_TYPES:
        folder = tmp_path / f"fabric_{kind}"
        saved = _fabric(_ours(2, 2, state_dict_type=kind)).launch(_save, str(folder), 2, Wrapped)
        assembled = ckpt.read_full(folder / "ckpt")  # one process, no GPU, either format
        assert {k: v.tolist() for k, v in assembled["state_dict"].items()} == saved["weights"]
        assert assembled["step"] == 2
        # and back: the Trainer (FSDP1, degree 4) resumes from the Fabric checkpoint, optimizer state included
        from lightning_smp import HybridShardFSDPStrategy as TrainerStrategy
        from tests.helpers import cpu_trainer

        probe = _StartProbe(folder / "start.pt")
        trainer = cpu_trainer(TrainerStrategy(hybrid_shard_degree=4, start_method="fork"), folder, WORLD, max_steps=1,
                              callbacks=[probe])
        trainer.fit(_AdamWModel(), make_loader(), ckpt_path=folder / "ckpt")
        start = torch.load(folder / "start.pt", weights_only=True)
        assert {k: v.tolist() for k, v in start["weights"].items()} == saved["weights"]
        assert {i: {k: v.tolist() for k, v in s.items()} for i, s in start["optimizer"]["state"].items()} == (
            saved["optimizer"])


class Wrapped(torch.nn.Module):
    """The bare net under ``net``, so that its keys are TinyModel's (``net.*``), as a Trainer checkpoint has them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _AdamWModel(TinyModel):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class _StartProbe(L.Callback):
    """Rank 0 writes the full model and optimizer state the Trainer starts training from."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = {"weights": trainer.strategy.full_state_dict(),
                 "optimizer": trainer.strategy.full_optimizer_state(trainer.optimizers[0])}
        if trainer.global_rank == 0:
            torch.save(state, self.path)


def _load_raw(fabric: L.Fabric, path: str) -> dict[str, list]:
    model = fabric.setup_module(make_net())
    fabric.load_raw(path, model)
    return full_weights(fabric, model)


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_load_raw_reads_a_plain_state_dict_file(tmp_path, version):
    torch.manual_seed(7)
    plain = TinyModel().net
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    weights = _fabric(_ours(2, version)).launch(_load_raw, str(tmp_path / "plain.pt"))
    assert all(torch.equal(torch.tensor(weights[k]), v) for k, v in plain.state_dict().items())


# ---------------------------------------------------------------------------------------- a third-party model


GPT2_STEPS, GPT2_LR = 3, 1e-2
#: The key third of each block's ``c_attn.bias`` (query, key, value in that order): its exact gradient is zero (a
#: bias added to every key adds the same number to a whole row of attention logits, which the softmax ignores), so
#: each run moves it by rounding residue only (``rounding_residue_bound``); the other elements keep the usual bound.
GPT2_KEY_BIASES = {f"transformer.h.{block}.attn.c_attn.bias":
                   (slice(32, 64), rounding_residue_bound(GPT2_STEPS, GPT2_LR)) for block in range(2)}


def train_gpt2(fabric: L.Fabric, path: str) -> None:
    """Hugging Face GPT-2 (tied input and output embeddings) in the same loop: accumulation, clipping, AdamW. Rank 0
    writes the full weights to ``path`` (a launched function's result travels through a pipe Fabric reads only
    after the ranks end, too small for them)."""
    model = fabric.setup_module(tiny_gpt2())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=GPT2_LR))
    tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    mine = tokens[fabric.global_rank::fabric.world_size]
    for step in range(GPT2_STEPS):
        for micro in range(K):
            batch = mine[(step * K + micro) * 2:(step * K + micro) * 2 + 2]
            with fabric.no_backward_sync(model, enabled=micro < K - 1):
                fabric.backward(model(input_ids=batch, labels=batch).loss / K)
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
    strategy = fabric.strategy
    full = strategy.full_state_dict(model) if isinstance(strategy, HybridShardFSDPStrategy) else model.state_dict()
    if fabric.global_rank == 0:
        torch.save({k: v.detach().cpu() for k, v in full.items()}, path)


@lru_cache(maxsize=None)
def gpt2_reference(folder: str) -> dict[str, torch.Tensor]:
    path = str(Path(folder) / "ddp.pt")
    _fabric(DDPStrategy(start_method="fork")).launch(train_gpt2, path)
    return torch.load(path, weights_only=True)


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_hugging_face_gpt2_in_a_fabric_loop_matches_ddp(tmp_path_factory, version):
    pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    path = tmp_path_factory.mktemp("gpt2") / "ours.pt"
    _fabric(_ours(2, version, auto_wrap_policy={GPT2Block})).launch(train_gpt2, str(path))
    ours = torch.load(path, weights_only=True)
    reference = gpt2_reference(str(tmp_path_factory.getbasetemp()))
    assert_matches_ddp(ours, reference, steps=GPT2_STEPS, lr=GPT2_LR, zero_gradient=GPT2_KEY_BIASES)


# ---------------------------------------------------------------------------------------- the rest of the contract


@pytest.mark.parametrize("source", ["environment", "init"])
def test_fsdp_version_and_degree_from_the_configuration_sources(monkeypatch, source):
    import json

    from lightning_smp import init, shutdown
    from lightning_smp.config import ENV_CONFIG

    values = {"hybrid_shard_degree": 2, "fsdp_version": 2}
    if source == "environment":
        monkeypatch.setenv(ENV_CONFIG, json.dumps(values))
    else:
        init(values)
    try:
        strategy = _fabric("smp_hybrid").strategy
        assert strategy.fsdp_version == 2 and strategy.layout.mesh_shape == (2, 2)
        assert strategy.gradient_accumulation == DEFER_ALL_REDUCE
    finally:
        shutdown()


def _rank_seeded(fabric: L.Fabric) -> tuple[dict[str, list], dict[str, list]]:
    torch.manual_seed(100 + fabric.global_rank)  # every rank initialises its own weights
    net = TinyModel().net
    mine = {k: v.tolist() for k, v in net.state_dict().items()}
    first: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(first, mine)
    model = fabric.setup_module(net)
    return first[0], full_weights(fabric, model)


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_replicas_start_from_rank0_weights(version):
    rank0, trained_from = _fabric(_ours(2, version)).launch(_rank_seeded)
    assert trained_from == rank0


def _joint_setup(fabric: L.Fabric) -> dict[str, list]:
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.05))
    for x, y in rank_batches(fabric)[:2]:
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return full_weights(fabric, model)


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_joint_setup_under_fsdp1_trains_like_ddp():
    ours = _fabric(_ours(2, 1)).launch(_joint_setup)
    reference = _fabric(DDPStrategy(start_method="fork")).launch(_joint_setup)
    assert_matches_ddp(ours, {k: torch.tensor(v) for k, v in reference.items()})


def _save_once(fabric: L.Fabric, path: str) -> None:
    model = fabric.setup_module(make_net())
    fabric.save(path, {"model": model, "step": 1})


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("kind", STATE_DICT_TYPES)
def test_a_second_run_never_overwrites_the_first_runs_checkpoint(tmp_path, kind):
    path = str(tmp_path / "ckpt")
    _fabric(_ours(2, 2, state_dict_type=kind)).launch(_save_once, path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match="another run"):
        _fabric(_ours(2, 2, state_dict_type=kind)).launch(_save_once, path)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def _report(fabric: L.Fabric) -> list[dict]:
    model = fabric.setup_module(TinyModel())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.05))
    x, y = rank_batches(fabric)[0]
    fabric.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    return memory_report(model, [optimizer], print_table=False)


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_memory_report_in_a_loop_equals_the_callbacks(tmp_path, version):
    """The same model, optimizer and degree: Fabric's report holds the Trainer callback's memory figures."""
    from lightning_smp import HybridShardFSDPStrategy as TrainerStrategy
    from lightning_smp import MemorySavingsCallback
    from lightning_smp.accounting import MEMORY_FIELDS, PEAK_FIELDS
    from tests.helpers import cpu_trainer

    ours = _fabric(_ours(2, version)).launch(_report)
    callback = MemorySavingsCallback(print_table=False, filename=None)
    torch.manual_seed(0)
    cpu_trainer(TrainerStrategy(hybrid_shard_degree=2, start_method="fork", fsdp_version=version), tmp_path, WORLD,
                max_steps=1, callbacks=[callback]).fit(TinyModel(), make_loader())
    fields = [f for f in MEMORY_FIELDS if f not in PEAK_FIELDS] + ["sharding_strategy", "shard_degree", "replicas"]
    for mine, theirs in zip(ours, callback.reports["first_step"], strict=True):
        assert {f: mine[f] for f in fields} == {f: theirs[f] for f in fields}


# ---------------------------------------------------------------------------------------- Fabric's checkpoint contract


class _Position:
    """A data position with ``state_dict()``/``load_state_dict()``: what a resumable data loader gives Fabric."""

    def __init__(self) -> None:
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches = state["batches"]


def _train_with_position(fabric: L.Fabric, folder: str, save_at: int | None, resume: bool) -> dict[str, Any]:
    """AdamW over the rank's batches in order, from the position a stateful object holds; saves after ``save_at``
    steps; ``resume`` starts from that checkpoint instead of step 0."""
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    position = _Position()
    state = {"model": model, "optimizer": optimizer, "data": position, "step": 0}
    remainder = fabric.load(Path(folder) / "ckpt", state) if resume else {}
    batches = rank_batches(fabric)
    while state["step"] < STEPS:
        x, y = batches[position.batches]
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        position.batches += 1
        state["step"] += 1
        if state["step"] == save_at:
            fabric.save(Path(folder) / "ckpt", state)
    return {"weights": full_weights(fabric, model), "position": position.batches, "remainder": sorted(remainder),
            "data_is_the_object": state["data"] is position}


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("kind", STATE_DICT_TYPES)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_stateful_objects_are_saved_through_state_dict_and_resume_exactly(tmp_path, kind, version):
    whole = _fabric(_ours(2, version, state_dict_type=kind)).launch(_train_with_position, str(tmp_path), 2, False)
    resumed = _fabric(_ours(2, version, state_dict_type=kind)).launch(_train_with_position, str(tmp_path), None, True)
    # the position came back through load_state_dict (the object kept, not replaced by a dict): the resumed run
    # trains on batches 2 and 3, not 0 and 1 again, and ends exactly where the uninterrupted one ended
    assert resumed["data_is_the_object"] and resumed["position"] == STEPS and resumed["remainder"] == []
    assert resumed["weights"] == whole["weights"]
    if kind == FULL:
        saved = torch.load(tmp_path / "ckpt", weights_only=True)
        assert saved["data"] == {"batches": 2} and saved["step"] == 2


def _save_full_with_user_keys(fabric: L.Fabric, path: str) -> dict[str, Any]:
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    x, y = rank_batches(fabric)[0]
    fabric.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    fabric.save(path, {"model": model, "optimizer": optimizer, "iter_num": 1})
    return fabric_state(fabric, model, optimizer)


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_full_checkpoint_keeps_the_users_keys(tmp_path, version):
    """Fabric's full checkpoint is what Fabric's FSDPStrategy writes: {"model", "optimizer", ...} (litgpt reads
    ["model"]); the Trainer and read_full still read it, and consolidating a sharded one gives the same layout."""
    from lightning_smp import checkpoint as ckpt

    saved = _fabric(_ours(2, version, state_dict_type=FULL)).launch(_save_full_with_user_keys, str(tmp_path / "f"))
    raw = torch.load(tmp_path / "f", weights_only=True)
    assert set(raw) == {"model", "optimizer", "iter_num", ckpt.RUN_KEY, ckpt.FABRIC_KEYS}
    assert {k: v.tolist() for k, v in raw["model"].items()} == saved["weights"]
    assert {i: {k: v.tolist() for k, v in s.items()} for i, s in raw["optimizer"]["state"].items()} == saved[
        "optimizer"]
    assert {k: v.tolist() for k, v in ckpt.read_full(tmp_path / "f")["state_dict"].items()} == saved["weights"]

    _fabric(_ours(2, version)).launch(_save_full_with_user_keys, str(tmp_path / "s"))
    ckpt.consolidate(tmp_path / "s", tmp_path / "s.full")
    assert set(torch.load(tmp_path / "s.full", weights_only=True)) == set(raw)


def test_trainer_and_fabric_layouts_map_onto_each_other():
    from lightning_smp import checkpoint as ckpt

    trainer = {"state_dict": {"w": 1}, "optimizer_states": [{"state": {}}], "epoch": 3}
    as_fabric = ckpt.fabric_layout(trainer, "model", ["opt"])
    assert as_fabric["model"] == {"w": 1} and as_fabric["opt"] == {"state": {}} and "state_dict" not in as_fabric
    back = ckpt.trainer_layout(as_fabric)
    assert back == {**trainer, ckpt.FABRIC_KEYS: {"module": "model", "optimizers": ["opt"]},
                    "lr_schedulers": [], "pytorch-lightning_version": L.__version__}
    # a full file of Lightning's own Fabric FSDPStrategy records nothing: the keys of the state to restore map it
    lightning_written = {"model": {"w": 1}, "optimizer": {"state": {}}, "iter_num": 4}
    assert ckpt.trainer_layout(lightning_written) is lightning_written
    mapped = ckpt.trainer_layout(lightning_written, "model", ["optimizer"])
    assert mapped == {"state_dict": {"w": 1}, "optimizer_states": [{"state": {}}], "iter_num": 4,
                      "lr_schedulers": [], "pytorch-lightning_version": L.__version__}


def _misused_save(fabric: L.Fabric, folder: str, version: int) -> list[Any]:
    net = make_net()
    model = fabric.setup_module(net)
    # FSDP1: the module given to setup_module (now inside the FSDP root, its parameters views into flat shards);
    # FSDP2 shards that very module in place, so there the misuse is a submodule of it
    wrong = net if version == 1 else net[0]
    outcome: Any = None
    try:
        fabric.save(Path(folder) / "ckpt", {"model": wrong})
    except ValueError as err:
        outcome = (type(err).__name__, str(err))
    fabric.save(Path(folder) / "good", {"model": model})  # the ranks are still in step
    gathered: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(gathered, outcome)
    return gathered


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("kind", STATE_DICT_TYPES)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_a_module_that_was_not_set_up_is_refused_on_every_rank(tmp_path, kind, version):
    outcomes = _fabric(_ours(2, version, state_dict_type=kind)).launch(_misused_save, str(tmp_path), version)
    assert len({o[1] for o in outcomes}) == 1 and outcomes[0][0] == "HybridShardConfigError"
    assert "Could not find a FSDP model in the provided checkpoint state" in outcomes[0][1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good"]  # nothing written, not even a temporary


def _error_types(fabric: L.Fabric, folder: str) -> dict[str, list[str]]:
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    (Path(folder) / "not_a_checkpoint").mkdir(exist_ok=True)
    caught: dict[str, list[str]] = {}
    try:
        fabric.save(Path(folder) / "not_a_checkpoint", {"model": model})
    except IsADirectoryError as err:
        caught["full save onto a folder"] = [type(err).__name__]
    fabric.save(Path(folder) / "ckpt", {"model": model, "optimizer": optimizer})
    try:
        fabric.load_raw(Path(folder) / "ckpt", optimizer)
    except NotImplementedError as err:
        caught["load_raw of an optimizer"] = [type(err).__name__]
    return caught


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_errors_are_instances_of_what_fabrics_fsdp_strategy_raises(tmp_path):
    caught = _fabric(_ours(2, 1, state_dict_type=FULL)).launch(_error_types, str(tmp_path))
    assert caught == {"full save onto a folder": ["CheckpointPathError"],
                      "load_raw of an optimizer": ["UnsupportedOptionError"]}
    assert list((tmp_path / "not_a_checkpoint").iterdir()) == []  # the folder is left as it was


@pytest.mark.parametrize(("degree", "requested", "devices", "effective"), [
    (None, SHARD_GRAD_OP, 2, SHARD_GRAD_OP),  # degree 0: native FSDP, the strategy asked for
    (2, SHARD_GRAD_OP, 4, HYBRID_SHARD),  # a degree >= 2 forces HYBRID_SHARD (SMP)
    (1, HYBRID_SHARD, 2, NO_SHARD),
    (2, HYBRID_SHARD_ZERO2, 4, HYBRID_SHARD_ZERO2),
])
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_sharding_strategy_attribute_says_what_will_run(degree, requested, devices, effective, front_end):
    from lightning_smp import HybridShardFSDPStrategy as TrainerStrategy
    from tests.helpers import cpu_trainer

    cls = HybridShardFSDPStrategy if front_end == "fabric" else TrainerStrategy
    strategy = cls(hybrid_shard_degree=degree, sharding_strategy=requested, start_method="fork")
    assert strategy.sharding_strategy.name == requested  # what was asked for, until the world size is known
    if front_end == "fabric":
        fabric = _fabric(strategy, devices)
        strategy = fabric.strategy
        # and inside the launched ranks, where the mesh exists
        assert fabric.launch(_sharding_strategy_name) == effective
    else:
        strategy = cpu_trainer(strategy, devices=devices).strategy
    assert strategy.sharding_strategy.name == effective == strategy.layout.sharding_strategy


def _sharding_strategy_name(fabric: L.Fabric) -> str:
    name = fabric.strategy.sharding_strategy.name
    # no rank leaves right after creating the mesh's groups while a slower peer is still connecting to it
    fabric.barrier()
    return name


def _seeded_meta_init(fabric: L.Fabric) -> dict[str, list]:
    fabric.seed_everything(7)  # every rank alike, as litgpt and most scripts do
    with fabric.init_module(empty_init=True):
        net = TinyModel().net
    assert all(p.is_meta for p in net.parameters())
    return full_weights(fabric, fabric.setup_module(net))


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_seeded_meta_init_gives_the_weights_of_an_unsharded_model(version, degree):
    """Not one block of rows repeated per shard (FSDP2 on CPU drew the same numbers on every rank for its shard)."""
    torch.manual_seed(7)
    reference = TinyModel().net.state_dict()
    ours = _fabric(_ours(degree, version)).launch(_seeded_meta_init)
    assert list(ours) == list(reference)
    assert all(torch.equal(torch.tensor(ours[k]), v) for k, v in reference.items())


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_zero_grad_inside_an_accumulation_window_drops_what_it_accumulated(version):
    """As under DDP: nothing of the dropped micro-batch reaches the step (FSDP2's deferred sum is held outside
    .grad; zero_grad discards it too)."""
    reference = _fabric(DDPStrategy(start_method="fork")).launch(window_dropped)
    ours = _fabric(_ours(2, version)).launch(window_dropped)
    assert_matches_ddp(ours, {k: torch.tensor(v) for k, v in reference.items()})


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("two", [False, True], ids=["head_only", "two_optimizers"])
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_norm_clipping_takes_the_optimizers_parameters(version, two):
    """As Lightning and DDP clip: the norm of the optimizer's own parameters, not of the whole model."""
    reference = _fabric(DDPStrategy(start_method="fork")).launch(clipped_by_optimizer, two)
    ours = _fabric(_ours(2, version)).launch(clipped_by_optimizer, two)
    assert_matches_ddp(ours, {k: torch.tensor(v) for k, v in reference.items()})
