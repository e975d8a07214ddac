"""Checkpoints of HybridShardFSDPStrategy: sharded and full, exact resume, resharding, nothing lost (issue 5).

Every fit here is a real 2- or 4-rank run (fork launcher, gloo). States are compared as full (unsharded) model
and optimizer state dicts gathered inside the ranks, bitwise.

One module above 300 lines on purpose: its tests share the checkpoints that the module-scoped ``written`` and
``uninterrupted`` fixtures produce with real fits once, which split files would each have to produce again.
"""

from __future__ import annotations

import collections
import enum
import io
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.parsing import AttributeDict
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException
from torch.multiprocessing import ProcessRaisedException

from lightning_smp import CheckpointError
from lightning_smp import checkpoint as ckpt
from lightning_smp.accounting import CommCounter
from lightning_smp.callbacks.memory import strategy_mesh
from lightning_smp.checkpoint import convert, safety, saving
from lightning_smp.names import FULL, MESH_AXES, OTHER_AXIS, SHARD_AXIS, SHARDED, STATE_DICT_TYPES
from tests.checkpoint_runs import (
    STRATEGIES,
    CkptModel,
    K,
    N,
    assert_same_optimizer,
    assert_same_state,
    assert_same_tensors,
    probe,
    run,
)
from tests.helpers import (
    FSDP_VERSIONS,
    PARITY_BOUND,
    kill_when_ready,
    weight_difference,
)

# ------------------------------------------------------------------------------------------------ writers (shared)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Degree 2 on 4 ranks, K steps, once per format; ModelCheckpoint with top-k, every-n-steps and last."""
    out = {}
    for kind in STATE_DICT_TYPES:
        folder = tmp_path_factory.mktemp(f"writer_{kind}")
        callback = ModelCheckpoint(dirpath=folder / "ckpts", monitor="train_loss", save_top_k=2,
                                   every_n_train_steps=1, save_last=True)
        run(folder, 4, 2, tag="writer", kind=kind, max_steps=K, callbacks=(callback,))
        out[kind] = folder
    return out


@pytest.fixture(scope="module")
def written_by(written: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Path]]:
    """``written`` for each engine: ``{fsdp_version: {kind: folder}}`` (FSDP1's are ``written`` itself)."""
    out = {1: written, 2: {}}
    for kind in STATE_DICT_TYPES:
        folder = tmp_path_factory.mktemp(f"writer_fsdp2_{kind}")
        callback = ModelCheckpoint(dirpath=folder / "ckpts", save_top_k=0, every_n_train_steps=K, save_last=True)
        run(folder, 4, 2, tag="writer", kind=kind, max_steps=K, callbacks=(callback,),
            strategy_kwargs={"fsdp_version": 2})
        out[2][kind] = folder
    return out


@pytest.mark.timeout(180)
def test_model_checkpoint_top_k_and_last_in_both_formats(written: dict[str, Path]) -> None:
    for kind, folder in written.items():
        names = sorted(p.name for p in (folder / "ckpts").iterdir())
        # steps 1 to 4 were saved; all but the best two were removed (folders for sharded), last.ckpt kept
        assert len(names) == 3 and "last.ckpt" in names, names
        for name in names:
            path = folder / "ckpts" / name
            assert ckpt.checkpoint_kind(path) == kind
        assert not [p for p in (folder / "ckpts").iterdir() if p.name.startswith(".")]  # no temporaries left
        reference = probe(folder, "writer", "end")
        assert reference["global_step"] == K
    # both writers trained identically: the formats differ only on disk
    assert_same_state(probe(written[SHARDED], "writer", "end"), probe(written[FULL], "writer", "end"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_sharded_checkpoint_tensors_are_written_once_by_replica_group_zero(written_by: dict[int, dict[str, Path]],
                                                                          version: int) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = written_by[version][SHARDED] / "ckpts" / "last.ckpt"
    sizes = {p.name: p.stat().st_size for p in folder.glob("__*.distcp")}
    # degree 2 on 4 ranks: replica group 0 is ranks 0 and 1; ranks 2 and 3 (replica 1) write no bytes
    assert sizes.get("__2_0.distcp", 0) == 0 and sizes.get("__3_0.distcp", 0) == 0, sizes
    assert sizes["__0_0.distcp"] > 0 and sizes["__1_0.distcp"] > 0, sizes
    metadata = safety.SafeFileSystemReader(folder).read_metadata()
    files = {info.relative_path for info in metadata.storage_data.values()}
    assert files == {"__0_0.distcp", "__1_0.distcp"}
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            stored = sum(torch.Size(c.sizes).numel() for c in meta.chunks)
            assert stored == torch.Size(meta.size).numel(), key  # every element exactly once, no duplicate chunk
    model_keys = {k for k in metadata.state_dict_metadata if k.startswith("model.")}
    assert model_keys == {f"model.net.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")}
    assert any(k.startswith("optimizer_0.state.net.0.weight.exp_avg") for k in metadata.state_dict_metadata)


class FullSaveCounter(Callback):
    """Saves a full checkpoint at the end of fit, counting the collectives each rank issues meanwhile per mesh axis
    (the library's :class:`~lightning_smp.accounting.CommCounter`, as the memory report counts a step)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module) -> None:
        with CommCounter(strategy_mesh(trainer.strategy)) as counter:
            trainer.save_checkpoint(self.folder / "full_once.ckpt")
        torch.save(counter.counts(), self.folder / f"counts_rank{trainer.global_rank}.pt")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_full_checkpoint_is_assembled_once(tmp_path: Path, version: int) -> None:
    run(tmp_path, 4, 2, tag="once", kind=FULL, max_steps=2, callbacks=(FullSaveCounter(tmp_path),),
        strategy_kwargs={"fsdp_version": version})
    counts = [torch.load(tmp_path / f"counts_rank{r}.pt") for r in range(4)]
    moved = [{axis: {op: c["count"] for op, c in counts[r][axis].items() if c["count"]} for axis in MESH_AXES}
             for r in range(4)]
    # replica group 0 (ranks 0, 1) gathers the shards inside its shard group; replica group 1 (ranks 2, 3) issues
    # no collective on either mesh axis at all
    state_bytes = sum(t.numel() * t.element_size() for t in probe(tmp_path, "once", "end")["model"].values())
    for r in (0, 1):
        assert counts[r][SHARD_AXIS]["all_gather"]["bytes"] >= state_bytes, moved
    assert moved[2] == moved[3] == {axis: {} for axis in MESH_AXES}, moved
    # what runs on the world group is the ranks' agreement on the save (objects), the same on every rank: no rank
    # gathers state there that the others do not
    assert all(counts[r][OTHER_AXIS] == counts[0][OTHER_AXIS] for r in range(4)), [c[OTHER_AXIS] for c in counts]
    saved = torch.load(tmp_path / "full_once.ckpt", weights_only=True)
    assert_same_tensors(saved["state_dict"], probe(tmp_path, "once", "end")["model"])
    assert_same_optimizer(saved["optimizer_states"][0], probe(tmp_path, "once", "end")["optimizers"][0])


# ------------------------------------------------------------------------------------------------ exact resume


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = {}
    for name in STRATEGIES:
        folder = tmp_path_factory.mktemp(f"uninterrupted_{name}")
        run(folder, 4, 2, tag="ref", name=name, max_steps=N)
        out[name] = probe(folder, "ref", "end")
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", STATE_DICT_TYPES)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_resume_is_exact(tmp_path: Path, uninterrupted: dict[str, dict], name: str, kind: str) -> None:
    ckpts = tmp_path / "ckpts"
    first = ModelCheckpoint(dirpath=ckpts, save_top_k=0, every_n_train_steps=2, save_last=True)
    run(tmp_path, 4, 2, tag="part1", kind=kind, name=name, max_steps=K, callbacks=(first,))
    last = ckpts / "last.ckpt"
    assert ckpt.checkpoint_kind(last) == kind  # saved at step 2, then replaced at step 4 by the same run

    second = ModelCheckpoint(dirpath=ckpts, save_top_k=0, every_n_train_steps=2, save_last=True)
    run(tmp_path, 4, 2, tag="part2", kind=kind, name=name, max_steps=N, ckpt_path=last, callbacks=(second,))
    start, end, reference = probe(tmp_path, "part2", "start"), probe(tmp_path, "part2", "end"), uninterrupted[name]
    # loop state: K steps finish epoch 0 on 4 ranks (4 batches per epoch); the resumed run starts epoch 1
    assert (start["global_step"], start["epoch"]) == (K, 1)
    assert_same_state(start, probe(tmp_path, "part1", "end"))
    assert end["losses"] == reference["losses"][K:]  # the loss curve continues where it stopped, bitwise
    assert (end["global_step"], end["epoch"]) == (reference["global_step"], reference["epoch"])
    assert_same_state(end, reference)
    # the resumed run continued the same run: it replaced its own last.ckpt instead of writing last-v1.ckpt
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt"]
    assert ckpt.run_id_of(last) is not None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", STATE_DICT_TYPES)
def test_optimizer_without_state_saves_and_resumes(tmp_path: Path, kind: str) -> None:
    # plain SGD keeps no per-parameter state (Lightning's FSDP loader raises IndexError on it)
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=0, every_n_train_steps=2, save_last=True)
    torch.manual_seed(0)
    run(tmp_path, 2, 2, tag="sgd1", kind=kind, max_steps=2, callbacks=(callback,), model=CkptModel(optimizer="sgd"))
    run(tmp_path, 4, 2, tag="sgd2", kind=kind, max_steps=3, ckpt_path=tmp_path / "ckpts" / "last.ckpt",
        model=CkptModel(optimizer="sgd"))
    start = probe(tmp_path, "sgd2", "start")
    assert start["global_step"] == 2 and start["optimizers"][0]["state"] == {}
    assert_same_state(start, probe(tmp_path, "sgd1", "end"))


class GateOnlyModel(CkptModel):
    """Fine-tunes a one-element gate only while the rest still requires grad. As its own FSDP unit, the element lies
    in the first rank of each shard group, so the other rank keeps no optimizer state at all; in one unit with the
    rest, the optimizer holds part of a flat parameter (torch's FSDP1 optimizer state dicts refuse that alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(1, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.gate(torch.ones(1, 1, device=x.device))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.gate.parameters(), lr=self.lr)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("units", ["gate_a_unit", "one_unit"])
@pytest.mark.parametrize("kind", STATE_DICT_TYPES)
def test_optimizer_over_part_of_the_model_saves_and_resumes(tmp_path: Path, kind: str, units: str) -> None:
    # gate_a_unit: ranks 1 and 3 hold no Adam state; saving must not leave them out of the collective (it used to hang)
    # one_unit: FSDP1 raised "net.0.weight is not in the optimizer state" at the first save and at the end of fit
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=0, every_n_train_steps=K, save_last=True)
    wrap = {"strategy_kwargs": {"auto_wrap_policy": {torch.nn.Linear} if units == "gate_a_unit" else None}}
    torch.manual_seed(0)
    run(tmp_path, 4, 2, tag="head1", kind=kind, max_steps=K, callbacks=(callback,), model=GateOnlyModel(), **wrap)
    torch.manual_seed(0)
    run(tmp_path, 4, 2, tag="head2", kind=kind, max_steps=K + 2, ckpt_path=tmp_path / "ckpts" / "last.ckpt",
        model=GateOnlyModel(), **wrap)
    torch.manual_seed(0)
    run(tmp_path, 4, 2, tag="head_whole", kind=kind, max_steps=K + 2, model=GateOnlyModel(), **wrap)
    start = probe(tmp_path, "head2", "start")
    assert start["global_step"] == K and start["optimizers"][0]["state"]
    assert_same_state(start, probe(tmp_path, "head1", "end"))
    assert_same_state(probe(tmp_path, "head2", "end"), probe(tmp_path, "head_whole", "end"))


# ------------------------------------------------------------------------------------------------ resharding


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("devices", "degree"), [(4, 2), (4, 4), (4, 1), (2, 2), (2, 1)],
                         ids=["4r_d2", "4r_d4", "4r_d1", "2r_d2", "2r_d1"])
def test_sharded_checkpoint_resumes_at_any_degree_and_world_size(tmp_path: Path, written: dict[str, Path],
                                                                 devices: int, degree: int) -> None:
    source = written[SHARDED] / "ckpts" / "last.ckpt"
    run(tmp_path, devices, degree, tag="resharded", max_steps=K + 2, ckpt_path=source)
    start = probe(tmp_path, "resharded", "start")
    assert start["global_step"] == K
    assert_same_state(start, probe(written[SHARDED], "writer", "end"))
    end = probe(tmp_path, "resharded", "end")
    assert end["global_step"] == K + 2 and all(torch.isfinite(torch.tensor(end["losses"])))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("devices", "degree"), [(4, 4), (4, 1), (2, 2)], ids=["4r_d4", "4r_d1", "2r_d2"])
def test_full_checkpoint_resumes_at_any_degree(tmp_path: Path, written: dict[str, Path], devices: int,
                                               degree: int) -> None:
    source = written[FULL] / "ckpts" / "last.ckpt"
    run(tmp_path, devices, degree, tag="from_full", kind=SHARDED, max_steps=K + 1, ckpt_path=source)
    assert_same_state(probe(tmp_path, "from_full", "start"), probe(written[FULL], "writer", "end"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("writer", "reader", "kind", "devices", "degree"), [
    pytest.param(1, 2, SHARDED, 4, 4, id="fsdp1_to_fsdp2_sharded_4r_d4"),
    pytest.param(1, 2, SHARDED, 2, 1, id="fsdp1_to_fsdp2_sharded_2r_d1"),
    pytest.param(1, 2, FULL, 4, 2, id="fsdp1_to_fsdp2_full_4r_d2"),
    pytest.param(2, 1, SHARDED, 4, 4, id="fsdp2_to_fsdp1_sharded_4r_d4"),
    pytest.param(2, 1, SHARDED, 2, 2, id="fsdp2_to_fsdp1_sharded_2r_d2"),
    pytest.param(2, 1, FULL, 4, 1, id="fsdp2_to_fsdp1_full_4r_d1"),
    pytest.param(2, 2, SHARDED, 2, 2, id="fsdp2_to_fsdp2_sharded_2r_d2"),
    pytest.param(2, 2, FULL, 4, 4, id="fsdp2_to_fsdp2_full_4r_d4"),
])
def test_checkpoint_moves_between_engines(tmp_path: Path, written_by: dict[int, dict[str, Path]], writer: int,
                                          reader: int, kind: str, devices: int, degree: int) -> None:
    """A checkpoint of either engine resumes exactly under the other, at another degree and world size, the
    optimizer state included, and training goes on from there."""
    source = written_by[writer][kind] / "ckpts" / "last.ckpt"
    run(tmp_path, devices, degree, tag="moved", kind=kind, max_steps=K + 2, ckpt_path=source,
        strategy_kwargs={"fsdp_version": reader})
    start, end = probe(tmp_path, "moved", "start"), probe(tmp_path, "moved", "end")
    assert start["global_step"] == K
    assert_same_state(start, probe(written_by[writer][kind], "writer", "end"))
    assert end["global_step"] == K + 2 and all(torch.isfinite(torch.tensor(end["losses"])))


@pytest.fixture(scope="module")
def written_at_degree_1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The DDP engine's checkpoints: degree 1 on 4 ranks, K steps, once per format."""
    out = {}
    for kind in STATE_DICT_TYPES:
        folder = tmp_path_factory.mktemp(f"writer_ddp_{kind}")
        callback = ModelCheckpoint(dirpath=folder / "ckpts", save_top_k=0, every_n_train_steps=K, save_last=True)
        run(folder, 4, 1, tag="writer", kind=kind, max_steps=K, callbacks=(callback,))
        out[kind] = folder
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("kind", "reader", "devices", "degree"), [
    pytest.param(SHARDED, 2, 4, 4, id="sharded_to_fsdp2_4r_d4"),
    pytest.param(FULL, 1, 2, 2, id="full_to_fsdp1_2r_d2"),
])
def test_the_ddp_engine_s_checkpoint_resumes_under_fsdp(tmp_path: Path, written_at_degree_1: dict[str, Path],
                                                        kind: str, reader: int, devices: int, degree: int) -> None:
    """Degree 1's checkpoints (whole tensors, every rank a replica) resume exactly as shards of the other engines, at
    another degree and world size, the optimizer state included (the reverse is in the tests above: their d1
    readers run on the DDP engine)."""
    source = written_at_degree_1[kind] / "ckpts" / "last.ckpt"
    run(tmp_path, devices, degree, tag="moved", kind=kind, max_steps=K + 2, ckpt_path=source,
        strategy_kwargs={"fsdp_version": reader})
    start, end = probe(tmp_path, "moved", "start"), probe(tmp_path, "moved", "end")
    assert start["global_step"] == K
    assert_same_state(start, probe(written_at_degree_1[kind], "writer", "end"))
    assert end["global_step"] == K + 2 and all(torch.isfinite(torch.tensor(end["losses"])))


@pytest.mark.timeout(60)
def test_engines_write_the_same_checkpoint(written_by: dict[int, dict[str, Path]]) -> None:
    """Same model, data and degree: both engines' full files hold the same keys and shapes, and their sharded
    folders the same tensor keys; the values agree within twice the parity bound (each is within it of DDP's)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    full = {v: torch.load(written_by[v][FULL] / "ckpts" / "last.ckpt", weights_only=True) for v in (1, 2)}
    assert weight_difference(full[1]["state_dict"], full[2]["state_dict"]) <= 2 * PARITY_BOUND
    keys = {v: {k for k, m in safety.SafeFileSystemReader(written_by[v][SHARDED] / "ckpts" / "last.ckpt")
                .read_metadata().state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)} for v in (1, 2)}
    assert keys[1] == keys[2]


@pytest.mark.timeout(60)
def test_full_checkpoint_loads_on_a_single_device_for_inference(written: dict[str, Path]) -> None:
    reference = probe(written[FULL], "writer", "end")
    checkpoint = torch.load(written[FULL] / "ckpts" / "last.ckpt", weights_only=True)
    model = CkptModel()
    model.load_state_dict(checkpoint["state_dict"])
    assert_same_tensors(model.state_dict(), reference["model"])
    # the optimizer state is in torch's standard layout: a plain optimizer of the plain model takes it
    optimizer = model.configure_optimizers()
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    assert_same_optimizer(optimizer.state_dict(), reference["optimizers"][0])
    with torch.no_grad():
        x = torch.randn(3, 16)
        assert model(x).shape == (3, 4)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", STATE_DICT_TYPES)
def test_validate_and_predict_load_the_checkpoint(tmp_path: Path, written: dict[str, Path], kind: str) -> None:
    source = written[kind] / "ckpts" / "last.ckpt"
    reference = probe(written[kind], "writer", "end")["model"]
    torch.manual_seed(123)  # a model that differs from the checkpoint until it is loaded
    run(tmp_path, 4, 2, tag="v", fn="validate", ckpt_path=source, model=CkptModel())
    assert_same_tensors(probe(tmp_path, "v", "validate")["model"], reference)
    torch.manual_seed(123)
    run(tmp_path, 2, 1, tag="p", fn="predict", ckpt_path=source, model=CkptModel())
    assert_same_tensors(probe(tmp_path, "p", "predict")["model"], reference)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_load_from_checkpoint_reads_either_kind(written_by: dict[int, dict[str, Path]], version: int) -> None:
    written = written_by[version]
    full_path, sharded_path = (written[kind] / "ckpts" / "last.ckpt" for kind in (FULL, SHARDED))
    full = torch.load(full_path, weights_only=True)
    assembled = ckpt.read_full(sharded_path)
    assert_same_tensors(assembled["state_dict"], full["state_dict"])
    assert_same_optimizer(assembled["optimizer_states"][0], full["optimizer_states"][0])
    assert assembled["global_step"] == full["global_step"] == K
    for path in (full_path, sharded_path):
        model = ckpt.load_from_checkpoint(CkptModel, path, map_location="cpu")
        assert type(model) is CkptModel
        assert_same_tensors(model.state_dict(), full["state_dict"])
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        ckpt.load_from_checkpoint(CkptModel, written[FULL] / "missing.ckpt")


@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_consolidate_sharded_to_full(tmp_path: Path, written_by: dict[int, dict[str, Path]], version: int) -> None:
    written = written_by[version]
    source = written[SHARDED] / "ckpts" / "last.ckpt"
    full = torch.load(written[FULL] / "ckpts" / "last.ckpt", weights_only=True)

    ours = tmp_path / "ours.ckpt"
    if version == FSDP_VERSIONS[0]:  # the `python -m` entry point once: the engines differ only in what they wrote
        done = subprocess.run([sys.executable, "-m", "lightning_smp.checkpoint", "consolidate", str(source), str(ours)],
                              check=False, capture_output=True, text=True, timeout=100)
        assert done.returncode == 0, done.stderr
    else:
        assert convert.main(["consolidate", str(source), str(ours)]) == 0
    converted = torch.load(ours, weights_only=True)
    assert_same_tensors(converted["state_dict"], full["state_dict"])
    assert_same_optimizer(converted["optimizer_states"][0], full["optimizer_states"][0])
    assert converted["global_step"] == full["global_step"] == K
    assert converted["loops"] == full["loops"]
    assert converted[ckpt.RUN_KEY]["state_dict_type"] == FULL
    # the same command refuses to overwrite
    assert convert.main(["consolidate", str(source), str(ours)]) == 2

    # Lightning's own utility reads our folders too (optimizer keyed by name there)
    theirs = tmp_path / "theirs.ckpt"
    argv = sys.argv
    sys.argv = ["consolidate_checkpoint", str(source), "--output_file", str(theirs)]
    try:
        runpy.run_module("lightning.pytorch.utilities.consolidate_checkpoint", run_name="__main__")
    finally:
        sys.argv = argv
    lightning_full = torch.load(theirs, weights_only=True)
    assert_same_tensors(dict(lightning_full["state_dict"]), full["state_dict"])
    assert_same_optimizer(ckpt.optimizer_state_by_index(lightning_full["optimizer_states"][0]),
                          full["optimizer_states"][0])


# ------------------------------------------------------------------------------------------------ nothing lost


def _kill_scenario(folder: Path, kind: str, ready: Path) -> None:
    """In a new session: a 2-rank fit saving last.ckpt every step; the second save hangs mid-write."""
    os.setsid()
    import torch.distributed.checkpoint.filesystem as dcp_fs

    saves = {"n": 0}
    if kind == FULL:
        real_write = saving.write_file

        def write_file(obj: Any, path: Path) -> None:
            saves["n"] += 1
            if saves["n"] < 2:
                return real_write(obj, path)
            import io

            buffer = io.BytesIO()
            torch.save(obj, buffer)
            with open(path, "wb") as f:  # half of the bytes, then the process is killed
                f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                f.flush()
                os.fsync(f.fileno())
            ready.write_text(str(os.getpid()))
            time.sleep(600)

        saving.write_file = write_file
    else:
        real_write_data = dcp_fs.FileSystemWriter.write_data

        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            saves["n"] += 1
            future = real_write_data(self, plan, planner)
            if saves["n"] >= 2:
                future.wait()  # the shards are on disk, DCP's .metadata and our meta.pt are not
                if int(os.environ.get("RANK", "0")) == 0:
                    ready.write_text(str(os.getpid()))
                time.sleep(600)
            return future

        dcp_fs.FileSystemWriter.write_data = write_data
    callback = ModelCheckpoint(dirpath=folder / "ckpts", save_top_k=0, every_n_train_steps=1, save_last=True)
    run(folder, 2, 2, tag="killed", kind=kind, max_steps=3, callbacks=(callback,))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", STATE_DICT_TYPES)
def test_save_killed_midway_leaves_previous_checkpoint_loadable(tmp_path: Path, kind: str) -> None:
    # the writer and every rank die mid-write
    kill_when_ready(_kill_scenario, (tmp_path, kind, tmp_path / "ready"), tmp_path / "ready", "the second save")
    ckpts = tmp_path / "ckpts"
    leftovers = [p for p in ckpts.iterdir() if p.name.startswith(".last.ckpt.tmp-")]
    assert len(leftovers) == 1  # the interrupted write went to a temporary name ...
    last = ckpts / "last.ckpt"
    assert ckpt.checkpoint_kind(last) == kind  # ... and the previous checkpoint is still there
    # and it loads: a new run resumes from step 1
    run(tmp_path / "resume", 2, 2, tag="after_kill", kind=kind, max_steps=2, ckpt_path=last)
    assert probe(tmp_path / "resume", "after_kill", "start")["global_step"] == 1


class SaveAtEnd(Callback):
    """Calls ``trainer.save_checkpoint(path)`` at the end of fit on every rank and records what each rank got."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        try:
            trainer.save_checkpoint(self.path)
            outcome = "saved"
        except CheckpointError as err:
            outcome = f"CheckpointError: {err}"
        torch.save(outcome, self.path.parent / f"outcome_rank{trainer.global_rank}.pt")


class FailingSaveAtEnd(Callback):
    """At the end of fit, saves once with rank 0's file writes failing (a full disk); records each rank's outcome."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        original = saving.write_file

        def disk_full(obj: Any, where: Path) -> None:
            raise OSError(28, "No space left on device")

        if trainer.global_rank == 0:
            saving.write_file = disk_full
        try:
            trainer.save_checkpoint(self.path)
            outcome = "saved"
        except RuntimeError as err:
            outcome = str(err)
        finally:
            saving.write_file = original
        torch.save(outcome, self.path.parent / f"failed_rank{trainer.global_rank}.pt")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", STATE_DICT_TYPES)
def test_failed_write_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path: Path, kind: str) -> None:
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=0, every_n_train_steps=2, save_last=True)
    target = tmp_path / "ckpts" / "last.ckpt"
    run(tmp_path, 4, 2, tag="fail", kind=kind, max_steps=2, callbacks=(callback, FailingSaveAtEnd(target)))
    outcomes = [torch.load(tmp_path / "ckpts" / f"failed_rank{r}.pt") for r in range(4)]
    assert len(set(outcomes)) == 1, outcomes  # the same error on every rank, none left waiting
    assert outcomes[0].startswith(f"Saving the checkpoint {str(target)!r} failed on rank 0: OSError")
    assert not [p for p in (tmp_path / "ckpts").iterdir() if ".tmp-" in p.name]
    # the checkpoint ModelCheckpoint wrote at step 2 is intact and resumes
    run(tmp_path, 4, 2, tag="after_fail", kind=kind, max_steps=3, ckpt_path=target)
    assert_same_state(probe(tmp_path, "after_fail", "start"), probe(tmp_path, "fail", "end"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", STATE_DICT_TYPES)
def test_name_collision_never_overwrites_another_run(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "model.ckpt"
    run(tmp_path / "a", 4, 2, tag="a", kind=kind, max_steps=2, callbacks=(SaveAtEnd(target),))
    before = {p.relative_to(tmp_path): p.read_bytes() for p in [target, *target.rglob("*")] if p.is_file()}
    first_id = ckpt.run_id_of(target)
    assert first_id

    run(tmp_path / "b", 4, 2, tag="b", kind=kind, max_steps=3, callbacks=(SaveAtEnd(target),))
    outcomes = [torch.load(tmp_path / f"outcome_rank{r}.pt") for r in range(4)]
    assert len(set(outcomes)) == 1, outcomes  # every rank failed the same way, none hung
    assert outcomes[0].startswith("CheckpointError") and "another run" in outcomes[0]
    assert str(target) in outcomes[0]
    after = {p.relative_to(tmp_path): p.read_bytes() for p in [target, *target.rglob("*")] if p.is_file()}
    assert after == before and ckpt.run_id_of(target) == first_id

    # something that is not a checkpoint at all is not overwritten either
    stranger = tmp_path / "notes.ckpt"
    stranger.write_text("my notes")
    run(tmp_path / "c", 2, 2, tag="c", kind=kind, max_steps=1, callbacks=(SaveAtEnd(stranger),))
    assert "already holds something that is not a checkpoint of this run; refusing to overwrite it." in torch.load(
        tmp_path / "outcome_rank0.pt")
    assert stranger.read_text() == "my notes"


class WiderHead(CkptModel):
    def __init__(self) -> None:
        super().__init__()
        self.net[2] = torch.nn.Linear(33, 5)


class ExtraLayer(CkptModel):
    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(4, 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", STATE_DICT_TYPES)
def test_mismatched_model_names_first_mismatching_key(tmp_path: Path, written: dict[str, Path], kind: str) -> None:
    source = written[kind] / "ckpts" / "last.ckpt"
    with pytest.raises(CheckpointError, match=r"first mismatching key 'net\.2\.weight': the checkpoint has shape \(4, 33\),"
                                        r" the model expects \(5, 33\)"):
        run(tmp_path, 2, 2, tag="wide", fn="validate", ckpt_path=source, model=WiderHead())
    with pytest.raises(CheckpointError, match=r"first mismatching key 'extra\.weight': the model has it"):
        run(tmp_path, 2, 2, tag="extra", fn="validate", ckpt_path=source, model=ExtraLayer())


class Evil:
    """Unpickling this creates a file: proof that a loader ran code from the checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


@pytest.mark.timeout(120)
def test_loading_never_unpickles_code(tmp_path: Path, written: dict[str, Path]) -> None:
    import shutil

    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "code_ran"
    # a full checkpoint with an object in it
    evil_full = tmp_path / "evil.ckpt"
    checkpoint = torch.load(written[FULL] / "ckpts" / "last.ckpt", weights_only=True)
    checkpoint["hyper_parameters"] = {"payload": Evil(marker)}
    torch.save(checkpoint, evil_full)
    # torch's UnpicklingError inside a rank, as the fork launcher reports it
    with pytest.raises(ProcessRaisedException, match="Weights only load failed|Unsupported global"):
        run(tmp_path / "r1", 2, 2, tag="e1", fn="validate", ckpt_path=evil_full)
    # a sharded checkpoint whose DCP .metadata is a pickle with an object in it
    evil_sharded = tmp_path / "evil_sharded.ckpt"
    shutil.copytree(written[SHARDED] / "ckpts" / "last.ckpt", evil_sharded)
    (evil_sharded / ".metadata").write_bytes(__import__("pickle").dumps(Evil(marker)))
    with pytest.raises(ProcessRaisedException, match="refusing to unpickle pathlib.*Path.touch|refusing to unpickle"):
        run(tmp_path / "r2", 2, 2, tag="e2", fn="validate", ckpt_path=evil_sharded)
    # a non-tensor entry inside DCP data (how optimizer param_groups are stored) goes through weights_only too
    folder = tmp_path / "dcp_bytes"
    dcp.save({"x": {"groups": [{"lr": 0.1, "params": [0, 1]}], "obj": Evil(marker)}}, checkpoint_id=folder,
             no_dist=True)
    template: dict[str, Any] = {"x": {"groups": [{"lr": 0.0, "params": [5]}]}}
    dcp.load(template, storage_reader=safety.SafeFileSystemReader(folder), planner=safety.SafeLoadPlanner(
        allow_partial_load=True), no_dist=True)
    assert template["x"]["groups"] == [{"lr": 0.1, "params": [0, 1]}]
    with pytest.raises(CheckpointException, match="Weights only load failed|Unsupported global"):
        dcp.load({"x": {"obj": 0}}, storage_reader=safety.SafeFileSystemReader(folder),
                 planner=safety.SafeLoadPlanner(allow_partial_load=True), no_dist=True)
    assert not marker.exists()


class HParamsModel(CkptModel):
    def __init__(self, loss: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()


@pytest.mark.timeout(120)
def test_saving_refuses_objects_that_only_unpickling_could_restore(tmp_path: Path) -> None:
    target = tmp_path / "h.ckpt"
    torch.manual_seed(0)
    run(tmp_path, 2, 2, tag="h", kind=FULL, max_steps=1, model=HParamsModel(loss=torch.nn.MSELoss()),
        callbacks=(SaveAtEnd(target),))
    outcome = torch.load(tmp_path / "outcome_rank0.pt")
    assert "checkpoint['hyper_parameters']['loss'] is a torch.nn.modules.loss.MSELoss" in outcome
    assert "save_hyperparameters(ignore=" in outcome
    assert not target.exists() and not list(tmp_path.glob(".h.ckpt.tmp-*"))
    # plain hyperparameters (a dict subclass included) are saved and load back with weights_only=True
    plain = tmp_path / "plain.ckpt"
    torch.manual_seed(0)
    run(tmp_path / "p", 2, 2, tag="h2", kind=FULL, max_steps=1, model=HParamsModel(loss="mse"),
        callbacks=(SaveAtEnd(plain),))
    assert torch.load(plain, weights_only=True)["hyper_parameters"] == {"loss": "mse"}


class CfgModel(CkptModel):
    """Hyperparameters given as one OmegaConf config, as a config-driven project does."""

    def __init__(self, cfg: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters(cfg)


@pytest.mark.timeout(120)
def test_omegaconf_hyperparameters_are_saved_as_plain_values(tmp_path: Path) -> None:
    cfg = OmegaConf.create({"lr": 0.1, "layers": [4, 8], "name": "${model}", "model": "tiny"})
    for kind in (FULL, SHARDED):
        target = tmp_path / f"{kind}.ckpt"
        torch.manual_seed(0)
        run(tmp_path / kind, 2, 2, tag=kind, kind=kind, max_steps=1, model=CfgModel(cfg), callbacks=(SaveAtEnd(target),))
        assert torch.load(tmp_path / "outcome_rank0.pt") == "saved"
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)
    # resolved interpolations, plain containers, and the config's class by name
    assert full["hyper_parameters"] == {"lr": 0.1, "layers": [4, 8], "name": "tiny", "model": "tiny"}
    assert full["hparams_type"] == "omegaconf.dictconfig.DictConfig"
    meta = torch.load(tmp_path / "sharded.ckpt" / ckpt.META_FILENAME, weights_only=True)
    assert meta["hyper_parameters"] == full["hyper_parameters"]
    # Lightning's own loader (weights_only by default) rebuilds the model with the same values
    loaded = CfgModel.load_from_checkpoint(tmp_path / "full.ckpt")
    assert dict(loaded.hparams) == full["hyper_parameters"] and loaded.hparams.lr == 0.1
    from_folder = ckpt.load_from_checkpoint(CfgModel, tmp_path / "sharded.ckpt")
    assert dict(from_folder.hparams) == full["hyper_parameters"]
    assert_same_tensors(from_folder.state_dict(), full["state_dict"])


@pytest.mark.timeout(120)
def test_unsavable_hyperparameters_fail_at_fit_start(tmp_path: Path) -> None:
    seen = tmp_path / "steps"

    class CountSteps(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen.touch()

    every_epoch = ModelCheckpoint(dirpath=tmp_path / "ckpts")
    with pytest.raises(CheckpointError, match=r"ModelCheckpoint could not save this run: "
                       r"checkpoint\['hyper_parameters'\]\['loss'\] is a torch\.nn\.modules\.loss\.MSELoss"):
        run(tmp_path, 2, 2, tag="early", max_steps=1, model=HParamsModel(loss=torch.nn.MSELoss()),
            callbacks=(every_epoch, CountSteps()))
    assert not seen.exists() and not (tmp_path / "ckpts").exists()
    # without a ModelCheckpoint that saves, nothing is saved, so nothing is refused
    run(tmp_path / "off", 2, 2, tag="off", max_steps=1, model=HParamsModel(loss=torch.nn.MSELoss()))
    run(tmp_path / "top0", 2, 2, tag="top0", max_steps=1, model=HParamsModel(loss=torch.nn.MSELoss()),
        callbacks=(ModelCheckpoint(dirpath=tmp_path / "none", save_top_k=0),))
    assert not (tmp_path / "none").exists()


Point = collections.namedtuple("Point", "x y")


class Color(enum.Enum):
    RED = 1


@pytest.mark.parametrize("value", [
    1, "x", b"x", 1.5, 2 + 1j, None, True, torch.ones(2), torch.float16, torch.device("cpu"), torch.Size([2]),
    [1, [2]], (1, (2, "a")), {1, 2}, {(1, 2): 3}, {"a": {"b": [1]}}, AttributeDict(a=1),
    OmegaConf.create({"a": [1, {"b": 2}]}), frozenset({1}), Point(1, 2), Path("p"), Color.RED, object(),
    {(1, Path("p")): 1}, [Point(1, 2)], torch.nn.ReLU(),
], ids=repr)
def test_save_check_agrees_with_weights_only_loading(value: Any) -> None:
    """The check before a save accepts exactly what torch.load(weights_only=True) loads back."""
    written = ckpt.plain_checkpoint({"hyper_parameters": {"v": value}})
    buffer = io.BytesIO()
    torch.save(written, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
        loads = True
    except Exception:  # noqa: BLE001 - any refusal counts
        loads = False
    assert (safety.unsafe_entry(written) is None) == loads


def test_unsafe_entry_and_record_helpers() -> None:
    assert safety.unsafe_entry({"a": [1, 2.0, "x", None, torch.ones(1), (torch.float32, torch.device("cpu"))]}) is None
    assert "checkpoint['a'][1]" in safety.unsafe_entry({"a": [1, object()]})
    by_name = {"state": {"b": {"m": torch.ones(1)}}, "param_groups": [{"lr": 1.0, "params": ["a", "b"]}]}
    by_index = ckpt.optimizer_state_by_index(by_name)
    assert by_index["param_groups"] == [{"lr": 1.0, "params": [0, 1]}]
    assert list(by_index["state"]) == [1] and torch.equal(by_index["state"][1]["m"], torch.ones(1))
