"""lightning_smp.init() for plain PyTorch FSDP scripts: the patched FSDP(...) call on real gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_smp
from lightning_smp.names import FULL_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2, NO_SHARD, SHARD_GRAD_OP
from tests.helpers import PROCESS_TIMEOUT, fit_and_record, free_port, parity_bound, run_distributed

REPO = Path(__file__).resolve().parents[1]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 3))


def _wrap_and_step(rank: int, world_size: int, config: dict | None, fsdp_kwargs: dict) -> dict:
    """Configure, wrap a differently seeded model per rank with a plain FSDP call, take one SGD step."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if config is not None:
        lightning_smp.init(config)
    kwargs = dict(fsdp_kwargs)
    if kwargs.pop("own_world_mesh", False):
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cpu", (world_size,))
    if kwargs.pop("own_world_group", False):
        kwargs["process_group"] = dist.group.WORLD
    model = FSDP(_model(seed=rank), device_id=torch.device("cpu"), **kwargs)
    inner_pg = getattr(model, "_inter_node_pg", None)
    facts = {
        "strategy": model.sharding_strategy.name,
        "shard_group": dist.get_process_group_ranks(model.process_group),
        "replicate_group": dist.get_process_group_ranks(inner_pg) if inner_pg is not None else None,
        "local_numel": model._handle.flat_param.numel(),
        # plain lists: tensors sent through the result queue would need the (exited) child's shared memory
        "shard_before": model._handle.flat_param.detach().tolist(),
    }
    g = torch.Generator().manual_seed(rank)  # different data per rank: replicas only agree if gradients are reduced
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        facts["full_after"] = {k: v.detach().tolist() for k, v in model.state_dict().items()}
    facts["patched"] = lightning_smp.is_initialized()
    return facts


NUMEL = 8 * 13 + 13 + 13 * 3 + 3  # 159 parameters, one flat parameter


@pytest.mark.timeout(PROCESS_TIMEOUT)
@pytest.mark.parametrize(
    ("config", "fsdp_kwargs", "strategy", "groups", "local_numel"),
    [
        # SMP's override: FULL_SHARD asked, degree 2 on 4 ranks runs HYBRID_SHARD in shard groups of 2
        pytest.param({"hybrid_shard_degree": 2}, {"sharding_strategy": FULL_SHARD}, HYBRID_SHARD,
                     [[0, 1], [0, 1], [2, 3], [2, 3]], 80, id="degree2_overrides_full_shard"),
        pytest.param({"hybrid_shard_degree": 2}, {"sharding_strategy": HYBRID_SHARD_ZERO2},
                     HYBRID_SHARD_ZERO2, [[0, 1], [0, 1], [2, 3], [2, 3]], 80, id="degree2_zero2_kept"),
        # degree 1: NO_SHARD over the whole world, not over size-1 groups that would never synchronise
        pytest.param({"hybrid_shard_degree": 1}, {}, NO_SHARD, [[0, 1, 2, 3]] * 4, NUMEL, id="degree1_no_shard"),
        pytest.param({"hybrid_shard_degree": 4}, {}, FULL_SHARD, [[0, 1, 2, 3]] * 4, 40, id="degree_world"),
        # degree 0 is SMP's "native PyTorch": the call is left exactly as written
        pytest.param({"hybrid_shard_degree": 0}, {"sharding_strategy": SHARD_GRAD_OP}, SHARD_GRAD_OP,
                     [[0, 1, 2, 3]] * 4, 40, id="degree0_native"),
        # a user's own mesh or process group wins over the configured degree
        pytest.param({"hybrid_shard_degree": 2}, {"own_world_mesh": True}, FULL_SHARD, [[0, 1, 2, 3]] * 4, 40,
                     id="own_device_mesh_wins"),
        pytest.param({"hybrid_shard_degree": 2}, {"own_world_group": True}, FULL_SHARD, [[0, 1, 2, 3]] * 4, 40,
                     id="own_process_group_wins"),
    ],
)
def test_plain_fsdp_call_follows_the_configured_degree(config, fsdp_kwargs, strategy, groups, local_numel):
    from torch.distributed.fsdp import ShardingStrategy

    if "sharding_strategy" in fsdp_kwargs:
        fsdp_kwargs = {**fsdp_kwargs, "sharding_strategy": ShardingStrategy[fsdp_kwargs["sharding_strategy"]]}
    results = run_distributed(_wrap_and_step, 4, config, fsdp_kwargs)
    assert [r["strategy"] for r in results] == [strategy] * 4
    assert [r["shard_group"] for r in results] == groups
    assert [r["local_numel"] for r in results] == [local_numel] * 4
    if strategy in (HYBRID_SHARD, HYBRID_SHARD_ZERO2):
        assert [r["replicate_group"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # every rank ends with the same full model although each was seeded and fed differently
    for r in results[1:]:
        for key, value in results[0]["full_after"].items():
            assert r["full_after"][key] == value, key
    patched = config["hybrid_shard_degree"] > 0 and not {"own_world_mesh", "own_world_group"} & set(fsdp_kwargs)
    if patched and strategy != FULL_SHARD:
        # replicas started from rank 0's weights: a rank's shard equals its replica peer's before the first step
        stride = 1 if strategy == NO_SHARD else len(groups[0])
        for rank, r in enumerate(results):
            assert r["shard_before"] == results[(rank + stride) % 4]["shard_before"], rank
    assert all(r["patched"] for r in results)


@pytest.mark.timeout(PROCESS_TIMEOUT)
def test_lightning_strategy_uses_init_config_and_is_left_alone_by_the_patch(tmp_path):
    """init() sets the strategy's degree (no constructor argument); the strategy's own FSDP call keeps its mesh."""
    lightning_smp.init({"hybrid_shard_degree": 2})
    strategy = lightning_smp.HybridShardFSDPStrategy(start_method="fork")
    _, _, records = fit_and_record(strategy, tmp_path, devices=4, max_steps=2)
    assert [r["shard_group"] for r in records] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["replicate_group"] for r in records] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["fsdp_strategy"] for r in records] == [HYBRID_SHARD] * 4


def _meta_init(rank: int, world_size: int) -> list:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    lightning_smp.init({"hybrid_shard_degree": 2})
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 13), nn.Linear(13, 3))

    def materialise(module: nn.Module) -> None:  # FSDP calls it once per module that has meta tensors
        torch.manual_seed(1000 + rank)  # every rank materialises different values
        module.to_empty(device="cpu", recurse=False)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    model = FSDP(model, param_init_fn=materialise, device_id=torch.device("cpu"))
    return [dist.get_process_group_ranks(model.process_group), model._handle.flat_param.detach().tolist()]


@pytest.mark.timeout(PROCESS_TIMEOUT)
def test_meta_device_model_replicas_start_equal():
    results = run_distributed(_meta_init, 4)
    assert [r[0] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # replica 1 (ranks 2, 3) received replica 0's shards; inside a replica the two shards differ
    assert all(v == v for r in results for v in r[1])  # materialised, no uninitialised memory (NaN)
    assert results[0][1] == results[2][1] and results[1][1] == results[3][1]
    assert results[0][1] != results[1][1]


@pytest.mark.slow
@pytest.mark.timeout(PROCESS_TIMEOUT)
def test_plain_fsdp_example_under_torchrun_matches_ddp(tmp_path):
    """examples/plain_fsdp.py on 4 CPU ranks: shard groups of 2, HYBRID_SHARD, the same weights as DDP."""
    facts = tmp_path / "facts"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
           str(REPO / "examples" / "plain_fsdp.py"), "--degree", "2", "--steps", "6", "--check-ddp",
           "--facts", str(facts)]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=PROCESS_TIMEOUT - 20, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = [json.loads((facts / f"rank{r}.json").read_text()) for r in range(4)]
    assert [f["shard_group"] for f in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [len(f["shard_group"]) for f in ranks] == [2] * 4
    assert [f["replicate_group"] for f in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert {f["sharding_strategy"] for f in ranks} == {HYBRID_SHARD}
    # the two shard groups hold the same shard sizes; both replicas end with the same model
    assert ranks[0]["local_flat_numel"] == ranks[2]["local_flat_numel"]
    assert len({f["weights_hash"] for f in ranks}) == 1
    for f in ranks:  # the run above: 6 SGD steps at 0.5 on 4 ranks
        assert f["max_abs_diff_vs_ddp"] <= parity_bound(f["parameters"], steps=6, lr=0.5)
        assert f["losses"] == pytest.approx(f["ddp_losses"], abs=parity_bound(f["parameters"], steps=6, lr=0.5))
    assert "shard group of rank 0: [0, 1], FSDP ran HYBRID_SHARD" in out.stdout


def _wrapped_by_hand(rank: int, world_size: int, how: str) -> dict:
    """The first layer wrapped by hand (``FSDP(layer)`` or ``enable_wrap``/``wrap``), the last left to the outer
    ``FSDP(model)``; every rank seeded differently. The full weights right after wrapping, on every rank."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import enable_wrap, wrap

    lightning_smp.init({"hybrid_shard_degree": 2})
    model = _model(seed=rank)
    cpu = torch.device("cpu")
    if how == "fsdp_each_layer":
        model[0] = FSDP(model[0], device_id=cpu)
    else:
        with enable_wrap(wrapper_cls=FSDP, device_id=cpu):
            model[0] = wrap(model[0])
    model = FSDP(model, device_id=cpu)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        return {k.replace("_fsdp_wrapped_module.", ""): v.detach().tolist() for k, v in model.state_dict().items()}


@pytest.mark.timeout(PROCESS_TIMEOUT)
@pytest.mark.parametrize("how", ["fsdp_each_layer", "enable_wrap"])
def test_units_wrapped_by_hand_keep_rank0s_weights(how):
    """DDP semantics for a script that wraps layers itself: the hand-wrapped unit and the rest both start from global
    rank 0's model (the outer call must not send rank 0's shards of the inner unit over the other ranks' shards)."""
    results = run_distributed(_wrapped_by_hand, 4, how)
    expected = {k: v.tolist() for k, v in _model(seed=0).state_dict().items()}
    assert all(r == expected for r in results)


#: a value of every SMP key that only the strategies act on (their declaration's front_ends)
STRATEGIES_ONLY = {"async_save": True,
                   "fault_tolerance": {"lighthouse": "127.0.0.1:29510", "group": 0, "groups": 1},
                   "replica_sync": {"every": 2}}


def test_every_key_the_strategies_alone_act_on_is_declared_so():
    from lightning_smp.config.keys import IMPLEMENTED

    assert {f.name for f in IMPLEMENTED if "init" not in f.metadata["front_ends"]} == set(STRATEGIES_ONLY)


@pytest.mark.parametrize("call", ["fsdp1", "fully_shard"])
@pytest.mark.parametrize("key", sorted(STRATEGIES_ONLY))
def test_a_plain_call_refuses_what_only_the_strategies_act_on(key, call):
    """init() is a configuration source for the strategies too, so it takes every key; a plain FSDP(...) or
    fully_shard(...) call, which cannot act on async_save or fault_tolerance, refuses them on every rank, naming the
    key and where it acts, before anything is sharded."""
    assert run_distributed(_plain_call_with, 2, {"hybrid_shard_degree": 2, key: STRATEGIES_ONLY[key]}, call) == [
        f"UnsupportedOptionError: {key}="] * 2


def _plain_call_with(rank: int, world_size: int, config: dict, call: str) -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    from lightning_smp.errors import UnsupportedOptionError

    lightning_smp.init(config)
    try:
        FSDP(_model(0)) if call == "fsdp1" else fully_shard(_model(0))
    except UnsupportedOptionError as err:
        assert "acts in the Trainer's HybridShardFSDPStrategy and Fabric's HybridShardFSDPStrategy" in str(err)
        plain = "FSDP" if call == "fsdp1" else "fully_shard"
        assert f"a plain {plain}(...) call cannot act on it" in str(err) and "Fix: train with one of those" in str(err)
        return f"{type(err).__name__}: {str(err).split('=')[0]}="
    finally:
        lightning_smp.shutdown()
    return "accepted"
