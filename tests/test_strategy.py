"""The strategy's Lightning glue, checked without starting processes."""

import inspect
import warnings

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.distributed.fsdp import CPUOffload, MixedPrecision

import lightning_smp
from lightning_smp import HybridShardConfigError, HybridShardFSDPStrategy, HybridShardPrecision
from lightning_smp.launcher import HybridShardMultiProcessingLauncher
from lightning_smp.names import FULL, FULL_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2, SHARDED
from tests.helpers import cpu_trainer


def test_names_are_registered_once_and_fsdp_is_untouched():
    for name in ("smp_hybrid", "smp_hybrid_zero2", "smp_hybrid_notebook"):
        assert StrategyRegistry[name]["strategy"] is HybridShardFSDPStrategy
    HybridShardFSDPStrategy.register_strategies(StrategyRegistry)  # a second time is harmless
    assert HybridShardFSDPStrategy.get_registered_strategies().count("smp_hybrid") == 1
    assert StrategyRegistry["fsdp"]["strategy"] is FSDPStrategy
    assert not any(name.startswith("smp") for name in FSDPStrategy.get_registered_strategies())
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        cpu_trainer("fsdp", devices=2)


@pytest.mark.parametrize(
    ("name", "requested", "start_method"),
    [("smp_hybrid", HYBRID_SHARD, "popen"), ("smp_hybrid_zero2", HYBRID_SHARD_ZERO2, "popen"),
     ("smp_hybrid_notebook", HYBRID_SHARD, "fork")],
)
def test_names_work_on_cpu(name, requested, start_method):
    trainer = cpu_trainer(name, devices=4)
    strategy = trainer.strategy
    assert type(strategy) is HybridShardFSDPStrategy
    assert strategy.layout.requested_strategy == requested
    assert strategy.start_method == start_method
    assert strategy.layout.mesh_shape == (1, 4)  # degree 0 on one node: shard inside the node


def test_constructor_lists_every_fsdp_parameter():
    ours = inspect.signature(HybridShardFSDPStrategy.__init__).parameters
    theirs = inspect.signature(FSDPStrategy.__init__).parameters
    for name, param in theirs.items():
        assert name in ours, name
        assert ours[name].kind == param.kind, name
        if name not in ("sharding_strategy", "state_dict_type"):  # our defaults differ, documented
            assert ours[name].default == param.default, name
    assert ours["sharding_strategy"].default == HYBRID_SHARD
    assert ours["state_dict_type"].default == SHARDED
    assert ours["hybrid_shard_degree"].default is None
    for name in theirs:
        if name not in ("self", "kwargs"):
            assert f"{name}" in HybridShardFSDPStrategy.__doc__, f"{name} is not documented"


def test_fsdp_settings_pass_through_untouched():
    policy = {torch.nn.Linear}
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    strategy = HybridShardFSDPStrategy(
        hybrid_shard_degree=2, auto_wrap_policy=policy, activation_checkpointing_policy={torch.nn.Linear},
        cpu_offload=True, mixed_precision=mp, state_dict_type=SHARDED, limit_all_gathers=False,
        use_orig_params=False, process_group_backend="cpu:gloo", timeout=torch.distributed.constants.default_pg_timeout,
    )
    assert strategy.cpu_offload == CPUOffload(offload_params=True)
    assert strategy.mixed_precision is mp
    assert strategy.kwargs["limit_all_gathers"] is False
    assert strategy.kwargs["use_orig_params"] is False
    assert strategy.kwargs["auto_wrap_policy"].__class__.__name__ == "ModuleWrapPolicy"
    assert strategy._activation_checkpointing_kwargs
    assert strategy._state_dict_type == SHARDED
    assert strategy.process_group_backend == "cpu:gloo"


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        # checked by lightning_smp.degree, .mesh and .launcher, whose tests assert the whole message: here the
        # strategy must raise the library's error naming the parameter and the value it was given
        pytest.param({"hybrid_shard_degree": -2}, ["hybrid_shard_degree=-2"], id="negative"),
        pytest.param({"hybrid_shard_degree": True}, ["hybrid_shard_degree=True"], id="bool"),
        pytest.param({"hybrid_shard_degree": 1.5}, ["hybrid_shard_degree=1.5"], id="float"),
        pytest.param({"hybrid_shard_degree": 2, "device_mesh": (1, 4)}, ["hybrid_shard_degree=2", "device_mesh"],
                     id="mesh"),
        pytest.param({"device_mesh": (2, 0)}, ["device_mesh=(2, 0)"], id="mesh0"),
        pytest.param({"sharding_strategy": "HALF"}, ["sharding_strategy='HALF'"], id="ss"),
        pytest.param({"start_method": "thread"}, ["start_method='thread'"], id="start"),
        # written here, by the strategy itself: the whole message
        pytest.param({"state_dict_type": "both"},
                     [f"state_dict_type='both' is not supported. Valid values: {SHARDED!r}, {FULL!r}."], id="sdt"),
        pytest.param({"broadcast_buffers": "yes"}, ["broadcast_buffers='yes' (str) is not a boolean. Fix: pass True or False"],
                     id="broadcast_buffers"),
    ],
)
def test_static_errors_at_construction(kwargs, fragments):
    with pytest.raises(HybridShardConfigError) as err:
        HybridShardFSDPStrategy(**kwargs)
    assert [f for f in fragments if f not in str(err.value)] == []


@pytest.mark.parametrize(("devices", "num_nodes", "degree"), [(4, 1, 3), (2, 1, 4), (3, 2, 4)])
def test_world_size_errors_at_trainer_creation(devices, num_nodes, degree):
    # the message is lightning_smp.degree's (asserted in tests/test_degree.py); the strategy passes the degree and
    # the world size num_nodes x devices
    with pytest.raises(HybridShardConfigError) as err:
        cpu_trainer(HybridShardFSDPStrategy(hybrid_shard_degree=degree), devices=devices, num_nodes=num_nodes)
    assert f"hybrid_shard_degree={degree} " in str(err.value)
    assert f"world_size={devices * num_nodes} " in str(err.value)


def test_device_mesh_tuple_is_a_degree_and_is_checked_against_the_world():
    assert cpu_trainer(HybridShardFSDPStrategy(device_mesh=(2, 2))).strategy.layout.mesh_shape == (2, 2)
    # the messages are lightning_smp.degree's (asserted in tests/test_degree.py)
    with pytest.raises(HybridShardConfigError, match=r"^hybrid_shard_degree=8 "):
        cpu_trainer(HybridShardFSDPStrategy(device_mesh=(1, 8)))
    # the replica count must fit too, not only the shard degree
    with pytest.raises(HybridShardConfigError, match=r"^device_mesh .*\(1, 2\)"):
        cpu_trainer(HybridShardFSDPStrategy(device_mesh=(1, 2)))


def test_override_is_announced_once_naming_both():
    with pytest.warns(UserWarning, match=f"hybrid_shard_degree=2 overrides sharding_strategy={FULL_SHARD}: FSDP runs"
                                          f" {HYBRID_SHARD}"):
        trainer = cpu_trainer(HybridShardFSDPStrategy(hybrid_shard_degree=2, sharding_strategy=FULL_SHARD))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.strategy._configure_launcher()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no override, no warning
        cpu_trainer(HybridShardFSDPStrategy(hybrid_shard_degree=2, sharding_strategy=HYBRID_SHARD_ZERO2))


def test_device_mesh_before_setup_is_a_clear_error():
    strategy = cpu_trainer(HybridShardFSDPStrategy(hybrid_shard_degree=2)).strategy
    with pytest.raises(HybridShardConfigError, match="not available before setup"):
        _ = strategy.device_mesh
    with pytest.raises(HybridShardConfigError, match="resolved when the Trainer is created"):
        _ = HybridShardFSDPStrategy().layout


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-mixed"])
def test_precision_plugin_is_upgraded(precision):
    strategy = cpu_trainer(HybridShardFSDPStrategy(hybrid_shard_degree=2), precision=precision).strategy
    assert isinstance(strategy.precision_plugin, HybridShardPrecision)
    assert strategy.precision_plugin.precision == precision
    assert (strategy.precision_plugin.scaler is not None) is (precision == "16-mixed")
    assert strategy.precision_plugin is strategy.precision_plugin  # not rebuilt on every access


def test_launchers(monkeypatch):
    assert isinstance(cpu_trainer(HybridShardFSDPStrategy()).strategy.launcher, _SubprocessScriptLauncher)
    fork = cpu_trainer(HybridShardFSDPStrategy(start_method="fork")).strategy.launcher
    assert isinstance(fork, HybridShardMultiProcessingLauncher)
    # processes started by torchrun: Lightning's FSDP creates no launcher there, so ranks never cap their threads
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    trainer = cpu_trainer(HybridShardFSDPStrategy(hybrid_shard_degree=2))
    assert trainer.strategy.cluster_environment.creates_processes_externally
    assert isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher)


def test_package_exports():
    for name in lightning_smp.__all__:
        assert hasattr(lightning_smp, name), name
