"""The core's seams: one vocabulary, one error hierarchy, the engine interface, the collectives handle."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

import lightning_smp
from lightning_smp import names
from lightning_smp.collectives import Collectives
from lightning_smp.config import KNOWN_KEYS, SMPConfig, SMPSection
from lightning_smp.engines import ENGINES, Engine, engine_of
from lightning_smp.engines.base import Accounting, Capabilities, PlainAPI, StateDicts, Training, Wrapping
from lightning_smp.errors import (
    CheckpointError,
    GradientSyncError,
    HybridShardConfigError,
    LightningSMPError,
    UnitOrderError,
    UnsupportedOptionError,
)
from lightning_smp.forking import rank_error
from lightning_smp.names import FULL


def test_each_option_is_defined_once():
    """names.py as written: no ``Literal`` lists a value twice and no two spell the same value (``typing.get_args``
    drops a repeated value, so the tuples read back from them cannot show it), and every tuple is its Literal's."""
    import ast
    import inspect

    spelled: dict[object, str] = {}
    for node in ast.walk(ast.parse(inspect.getsource(names))):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript)
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "Literal"):
            continue
        literal = node.targets[0].id  # type: ignore[attr-defined]
        items = node.value.slice.elts if isinstance(node.value.slice, ast.Tuple) else [node.value.slice]
        for value in (item.value for item in items if isinstance(item, ast.Constant)):  # a Name: another Literal
            assert value not in spelled, f"{value!r} is spelled in {spelled[value]} and in {literal}"
            spelled[value] = literal
    assert len(spelled) >= 15  # every Literal of names.py was read
    for values, literal in [(names.MESH_AXES, "MeshAxis"), (names.SHARDING_STRATEGIES, "ShardingStrategyName"),
                            (names.STATE_DICT_TYPES, "StateDictType"),
                            (names.GRADIENT_ACCUMULATIONS, "GradientAccumulation"), (names.FSDP_VERSIONS, "FSDPVersion")]:
        assert values == typing.get_args(getattr(names, literal))
        assert all(spelled[value] == literal for value in values)


def test_start_methods_are_the_platforms_and_the_script_launcher():
    import multiprocessing as mp

    assert set(names.START_METHODS) == {"popen", *mp.get_all_start_methods()}


def test_names_spell_the_values_torch_and_lightning_use():
    from torch.distributed.fsdp import ShardingStrategy

    assert set(names.SHARDING_STRATEGIES) == {s.name for s in ShardingStrategy}
    assert (names.REPLICATE_AXIS, names.SHARD_AXIS) == names.MESH_AXES == lightning_smp.MESH_AXES
    assert [n for n, _, _ in names.STRATEGY_NAMES] == ["smp_hybrid", "smp_hybrid_zero2", "smp_hybrid_notebook",
                                                      "smp_hybrid_fsdp2"]


@pytest.mark.parametrize(
    ("error", "builtins"),
    [
        (HybridShardConfigError, (ValueError,)),
        (UnsupportedOptionError, (HybridShardConfigError, ValueError, TypeError)),
        (CheckpointError, (ValueError, RuntimeError)),
        (GradientSyncError, (RuntimeError,)),
        (UnitOrderError, (RuntimeError,)),
    ],
)
def test_every_error_is_a_library_error_and_the_builtin_lightning_raises(error, builtins):
    assert issubclass(error, LightningSMPError)
    for builtin in builtins:
        assert issubclass(error, builtin)
    assert not issubclass(CheckpointError, HybridShardConfigError)  # a checkpoint problem is not a config mistake


def test_storage_options_is_a_type_error_as_in_lightning(tmp_path):
    from lightning_smp.checkpoint import CheckpointRun, save

    with pytest.raises(TypeError, match=r"storage_options=\{'x': 1\} is not supported") as err:
        save({}, tmp_path / "x.ckpt", kind=FULL, collectives=Collectives(), run=CheckpointRun(),
             storage_options={"x": 1})
    assert isinstance(err.value, UnsupportedOptionError)
    assert not (tmp_path / "x.ckpt").exists()


def test_a_precision_plugin_of_another_kind_is_a_type_error_as_in_lightning():
    from lightning.pytorch.plugins.precision import Precision

    with pytest.raises(TypeError, match="needs an `FSDPPrecision` plugin, found Precision") as err:
        lightning_smp.HybridShardFSDPStrategy(precision_plugin=Precision())
    assert isinstance(err.value, UnsupportedOptionError)


@pytest.mark.parametrize("error", [HybridShardConfigError, UnsupportedOptionError, CheckpointError])
def test_an_error_raised_in_a_rank_comes_back_as_the_same_type(error):
    try:
        raise error("first line: the value\nand a second line")
    except LightningSMPError as raised:
        import traceback

        rebuilt = rank_error("".join(traceback.format_exception(raised)))
    assert type(rebuilt) is error
    assert str(rebuilt) == "first line: the value\nand a second line"
    assert rank_error("Traceback ...\nValueError: not ours") is None


ROLES = [Wrapping, Training, StateDicts, PlainAPI]


@pytest.mark.parametrize("engine", ENGINES, ids=lambda engine: engine.name)
def test_every_registered_engine_plays_every_role(engine):
    """Each role's members, with the protocol's parameters in its order, on every engine in the registry; the roles
    together are the interface, and none is listed in two."""
    import inspect

    assert isinstance(engine, Engine) and isinstance(engine.capabilities, Capabilities)
    assert engine.capabilities.default_accumulation in names.GRADIENT_ACCUMULATIONS
    assert set(engine.capabilities.accumulations) <= set(names.GRADIENT_ACCUMULATIONS)
    members = {role: [name for name in vars(role) if not name.startswith("_") and callable(vars(role)[name])]
               for role in ROLES}
    listed = [name for names_ in members.values() for name in names_]
    assert len(listed) == len(set(listed)) and len(listed) >= 20
    for role, role_members in members.items():
        assert isinstance(engine, role)
        for name in role_members:
            wanted = list(inspect.signature(getattr(role, name)).parameters)
            assert list(inspect.signature(getattr(engine, name)).parameters) == wanted[1:], (role.__name__, name)
    assert isinstance(engine, Accounting)  # every engine shipped also reads back what it holds
    plain = torch.nn.Linear(2, 2)
    assert engine_of(plain) is None and not engine.has_wrapped(plain) and not engine.parameters_sharded(plain)
    assert engine.sharding(plain) is None and not engine.is_shard_tensor(plain.weight)


def test_collectives_in_one_process_return_their_input():
    one = Collectives.current()
    assert (one.rank, one.world_size, one.distributed) == (0, 1, False)
    assert one.broadcast({"a": 1}) == {"a": 1}
    assert one.all_gather("x") == ["x"]
    assert one.any(True) is True and one.any(False) is False
    one.barrier()


def test_one_list_of_smp_keys_types_the_config_and_the_cli_section():
    config_fields = {f.name: f for f in dataclasses.fields(SMPConfig)}
    assert set(config_fields) == set(KNOWN_KEYS)
    section = dataclasses.fields(SMPSection)
    assert [f.name for f in section] == list(config_fields)
    assert all(f.default is None for f in section)  # a key left out of the smp: section is not set there
    hints = typing.get_type_hints(SMPSection)
    # the parser takes a degree or "auto", nothing else (OmegaConf's SMPConfig field is int | str)
    assert hints["hybrid_shard_degree"] == typing.Optional[typing.Union[int, typing.Literal["auto"]]]  # noqa: UP007
    assert hints["memory_budget"] == typing.Optional[typing.Union[int, str]]  # noqa: UP007
    assert hints["sm_activation_offloading"] == typing.Optional[bool]  # noqa: UP007


def test_the_configuration_is_resolved_once_when_the_trainer_is_created(monkeypatch):
    from lightning_smp.config import ENV_CONFIG
    from tests.helpers import cpu_trainer

    monkeypatch.setenv(ENV_CONFIG, '{"hybrid_shard_degree": 2}')
    strategy = lightning_smp.HybridShardFSDPStrategy()
    cpu_trainer(strategy, devices=4)
    monkeypatch.setenv(ENV_CONFIG, '{"hybrid_shard_degree": 4}')  # a later change does not reach this Trainer
    assert strategy.hybrid_shard_degree == 2
    assert strategy.layout.mesh_shape == (2, 2)


def test_zero_grad_discards_through_every_wrapper_and_pickles_as_the_plain_optimizer():
    """The front ends' ``zero_grad`` routing: called through the optimizer, Lightning's wrapper and Fabric's, with
    the caller's arguments; the strategy set up last owns the discard; a pickled copy is the plain optimizer."""
    import pickle

    from lightning.fabric.wrappers import _FabricOptimizer
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from lightning_smp.optimizers import discard_on_zero_grad

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    calls: list[str] = []
    assert discard_on_zero_grad(optimizer, lambda: calls.append("first")) is optimizer
    model(torch.ones(1, 2)).sum().backward()
    optimizer.zero_grad(set_to_none=False)
    assert calls == ["first"] and model.weight.grad is not None and not model.weight.grad.any()
    discard_on_zero_grad(optimizer, lambda: calls.append("second"))
    LightningOptimizer(optimizer).zero_grad()
    _FabricOptimizer(optimizer, strategy=None).zero_grad()  # type: ignore[arg-type]
    assert calls == ["first", "second", "second"] and model.weight.grad is None
    assert isinstance(optimizer, torch.optim.AdamW) and type(optimizer).__name__ == "AdamW"
    copied = pickle.loads(pickle.dumps(optimizer))
    assert type(copied) is torch.optim.AdamW and copied.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_no_test_module_imports_another():
    """What several test modules share lives in a helper module (helpers, oracles, modules, fabric_loops,
    checkpoint_runs); a test module imported by another would run its module-level setup twice and ties their edits."""
    import ast
    from pathlib import Path

    offenders = []
    for path in sorted(Path(__file__).parent.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            offenders += [f"{path.name} imports {t}" for t in targets if t.split(".")[-1].startswith("test_")]
    assert not offenders, offenders


@pytest.mark.parametrize(("mode", "passes", "held"), [
    pytest.param(names.NO_SYNC, (1, 1), 4000, id="no_sync"),
    pytest.param(names.EVERY_MICRO_BATCH, (4, 4), 0, id="every_micro_batch"),
    pytest.param(names.DEFER_ALL_REDUCE, (4, 1), 1000, id="defer_all_reduce"),
])
def test_each_accumulation_mode_is_described_once(mode, passes, held):
    """One record per mode: the collective passes of a 4-micro-batch step, and what a rank holds between micro-batches
    of a 4000-byte gradient on shard groups of 4 (nothing extra with nothing sharded)."""
    from lightning_smp.accumulation import ACCUMULATION_MODES, accumulation_mode

    assert tuple(ACCUMULATION_MODES) == names.GRADIENT_ACCUMULATIONS
    record = accumulation_mode(mode)
    assert record.passes(4) == passes and record.passes(1) == (1, 1)
    assert record.held_between(4000, 4) == held and record.held_between(4000, 1) == 0
    assert record.holds_unsharded == (mode == names.NO_SYNC)
    with pytest.raises(ValueError, match="unknown gradient accumulation 'sometimes'"):
        accumulation_mode("sometimes")
