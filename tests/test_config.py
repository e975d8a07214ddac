"""SMP configuration sources, their precedence, and every error they can raise (lightning_smp.config).

Above 300 lines because it is the one test module of lightning_smp.config, whose messages are asserted only here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

import lightning_smp
from lightning_smp import HybridShardConfigError, HybridShardFSDPStrategy, SMPConfig
from lightning_smp.config import (
    ENV_CLI,
    ENV_CONFIG,
    ENV_INIT,
    ENV_SAGEMAKER,
    KNOWN_KEYS,
    config_source,
    configured_degree,
    resolve_config,
    set_cli_config,
)
from lightning_smp.config.keys import UNIMPLEMENTED_KEYS
from tests.helpers import cpu_trainer

ALL_ENV = (ENV_CONFIG, ENV_SAGEMAKER, ENV_CLI, ENV_INIT)


# ---------------------------------------------------------------------------------------------- precedence

SOURCES = ("sagemaker", "env_inline", "env_file", "init_dict", "init_file", "cli", "explicit")
LABELS = {
    "sagemaker": "environment variable SM_HP_MP_PARAMETERS",
    "env_inline": "environment variable LIGHTNING_SMP_CONFIG",
    "env_file": "(from environment variable LIGHTNING_SMP_CONFIG)",
    "init_dict": "lightning_smp.init(config)",
    "init_file": "lightning_smp.init(config)",
    "cli": "LightningCLI `smp:` section",
    "explicit": "HybridShardFSDPStrategy(hybrid_shard_degree=...)",
}


def _apply(source: str, degree: int, tmp_path) -> None:
    if source == "sagemaker":
        os.environ[ENV_SAGEMAKER] = json.dumps({"hybrid_shard_degree": degree})
    elif source == "env_inline":
        os.environ[ENV_CONFIG] = json.dumps({"hybrid_shard_degree": degree})
    elif source == "env_file":
        path = tmp_path / "env_smp.yaml"
        path.write_text(f"hybrid_shard_degree: {degree}\n")
        os.environ[ENV_CONFIG] = str(path)
    elif source == "init_dict":
        lightning_smp.init({"hybrid_shard_degree": degree})
    elif source == "init_file":
        path = tmp_path / "init_smp.json"
        path.write_text(json.dumps({"hybrid_shard_degree": degree}))
        lightning_smp.init(str(path))
    elif source == "cli":
        set_cli_config({"hybrid_shard_degree": degree})


def _combos():
    # each source alone, and each source together with every source below it: the highest must win
    cases = []
    for i, source in enumerate(SOURCES):
        cases.append(pytest.param((source,), id=f"{source}_alone"))
        if i:
            cases.append(pytest.param(SOURCES[: i + 1], id=f"{source}_over_lower"))
    # init_dict and init_file are the same level: the later init() call replaces the earlier one
    return [c for c in cases if not (c.values[0] and set(c.values[0]) >= {"init_dict", "init_file"})] + [
        pytest.param(("sagemaker", "env_inline", "init_file", "cli", "explicit"), id="all_levels")
    ]


@pytest.mark.parametrize("sources", _combos())
def test_highest_source_wins(sources, tmp_path):
    # distinct degrees per source (2, 3, 4, ...), so the winner is identified by its value
    degrees = {s: 2 + i for i, s in enumerate(sources)}
    explicit = None
    for source in sources:
        if source == "explicit":
            explicit = degrees[source]
        else:
            _apply(source, degrees[source], tmp_path)
    winner = sources[-1]
    assert configured_degree(explicit=explicit) == degrees[winner]
    assert LABELS[winner] in config_source(explicit=None if explicit is None else {"hybrid_shard_degree": explicit})
    # the strategy asks the same question
    assert HybridShardFSDPStrategy(hybrid_shard_degree=explicit).hybrid_shard_degree == degrees[winner]


def test_default_is_native_and_config_is_a_dataclass():
    assert resolve_config() == SMPConfig(hybrid_shard_degree=0)
    assert config_source() == "default"
    assert HybridShardFSDPStrategy().hybrid_shard_degree == 0


def test_lightning_smp_config_beats_sagemaker_env():
    os.environ[ENV_SAGEMAKER] = '{"hybrid_shard_degree": 8}'
    os.environ[ENV_CONFIG] = '{"hybrid_shard_degree": 2}'
    assert configured_degree() == 2
    del os.environ[ENV_CONFIG]
    assert configured_degree() == 8


def test_init_without_argument_reads_environment_and_replaces_earlier_init():
    os.environ[ENV_SAGEMAKER] = '{"hybrid_shard_degree": 4, "tensor_parallel_degree": 1}'
    with pytest.warns(UserWarning, match="SM_HP_MP_PARAMETERS: tensor_parallel_degree=1 is ignored"):
        lightning_smp.init({"hybrid_shard_degree": 2})  # the environment is checked too, though overridden
    assert configured_degree() == 2
    lightning_smp.init()  # like torch.sagemaker.init(): the SageMaker job's JSON decides
    assert configured_degree() == 4
    assert config_source() == "environment variable SM_HP_MP_PARAMETERS"


def test_init_twice_patches_once_and_shutdown_restores():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    original = FSDP.__init__
    lightning_smp.init({"hybrid_shard_degree": 2})
    patched = FSDP.__init__
    assert patched is not original and lightning_smp.is_initialized()
    lightning_smp.init({"hybrid_shard_degree": 4})
    assert FSDP.__init__ is patched  # not wrapped twice
    assert configured_degree() == 4
    lightning_smp.shutdown()
    assert FSDP.__init__ is original and not lightning_smp.is_initialized()
    assert configured_degree() == 0 and ENV_INIT not in os.environ
    lightning_smp.shutdown()  # harmless when nothing is patched
    assert FSDP.__init__ is original


def test_cli_and_init_sources_reach_child_processes():
    """Sources set in memory are exported, so a rank started by spawn or a re-run script sees them too."""
    os.environ[ENV_CONFIG] = '{"hybrid_shard_degree": 1}'
    lightning_smp.init({"hybrid_shard_degree": 2})
    set_cli_config({"hybrid_shard_degree": 4})
    code = ("from lightning_smp.config import configured_degree, config_source;"
            "print(configured_degree(), '|', config_source())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.stdout.strip().splitlines()[-1] == "4 | LightningCLI `smp:` section"


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "value",
    [pytest.param("two", id="string"), pytest.param(2.5, id="float"), pytest.param(True, id="bool"),
     pytest.param(-2, id="negative")],
)
@pytest.mark.parametrize("source", ["init_dict", "init_yaml", "env_inline", "env_file", "sagemaker", "cli"])
def test_wrong_types_name_source_and_key(source, value, tmp_path):
    where = {
        "init_dict": "lightning_smp.init(config)",
        "init_yaml": f"config file '{tmp_path / 'smp.yaml'}'",
        "env_inline": "environment variable LIGHTNING_SMP_CONFIG",
        "env_file": f"config file '{tmp_path / 'smp.json'}' (from environment variable LIGHTNING_SMP_CONFIG)",
        "sagemaker": "environment variable SM_HP_MP_PARAMETERS",
        "cli": "LightningCLI `smp:` section",
    }[source]
    with pytest.raises(HybridShardConfigError) as err:
        if source == "init_dict":
            lightning_smp.init({"hybrid_shard_degree": value})
        elif source == "init_yaml":
            (tmp_path / "smp.yaml").write_text(f"hybrid_shard_degree: {json.dumps(value)}\n")
            lightning_smp.init(tmp_path / "smp.yaml")
        elif source == "env_inline":
            os.environ[ENV_CONFIG] = json.dumps({"hybrid_shard_degree": value})
            configured_degree()
        elif source == "env_file":
            (tmp_path / "smp.json").write_text(json.dumps({"hybrid_shard_degree": value}))
            os.environ[ENV_CONFIG] = str(tmp_path / "smp.json")
            configured_degree()
        elif source == "sagemaker":
            os.environ[ENV_SAGEMAKER] = json.dumps({"hybrid_shard_degree": value})
            configured_degree()
        else:
            set_cli_config({"hybrid_shard_degree": value})
    # the source and the key with the value as it arrived (its type included: 'two' is not two); the wording of
    # the degree check is asserted where it is written (tests/test_degree.py)
    assert str(err.value).startswith(f"{where}: hybrid_shard_degree={value!r}")
    assert ENV_CLI not in os.environ and ENV_INIT not in os.environ  # nothing half-applied


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param("init", "lightning_smp.init(config): unknown SMP config key 'hybrid_shard_dgree'. Did you mean"
                     " 'hybrid_shard_degree'?", id="init"),
        pytest.param("env", "environment variable LIGHTNING_SMP_CONFIG: unknown SMP config key 'hybrid_shard_dgree'."
                     " Did you mean 'hybrid_shard_degree'?", id="env"),
        pytest.param("cli", "LightningCLI `smp:` section: unknown SMP config key 'hybrid_shard_dgree'. Did you mean"
                     " 'hybrid_shard_degree'?", id="cli"),
    ],
)
def test_unknown_key_suggests_the_right_one(source, expected):
    bad = {"hybrid_shard_dgree": 2}
    with pytest.raises(HybridShardConfigError) as err:
        if source == "init":
            lightning_smp.init(bad)
        elif source == "env":
            os.environ[ENV_CONFIG] = json.dumps(bad)
            configured_degree()
        else:
            set_cli_config(bad)
    assert str(err.value).startswith(expected)
    assert f"Known keys: {', '.join(KNOWN_KEYS)}." in str(err.value)


def test_a_key_both_implemented_and_not_is_refused_on_import():
    from lightning_smp.config.keys import check_key_lists

    with pytest.raises(RuntimeError, match="async_save both implemented .* Fix: remove its UNIMPLEMENTED_KEYS rule"):
        check_key_lists(["hybrid_shard_degree", "async_save"], ["async_save"], ["hybrid_shard_degree", "async_save"])
    with pytest.raises(RuntimeError, match=r"fields without a rule \['links'\]"):
        check_key_lists(["hybrid_shard_degree"], [], ["hybrid_shard_degree", "links"])


def test_unknown_key_without_close_match_lists_known_keys():
    with pytest.raises(HybridShardConfigError, match=r"unknown SMP config key 'pipeline'\. Known keys: ") as err:
        lightning_smp.init({"pipeline": 2})
    assert "Did you mean" not in str(err.value)


@pytest.mark.parametrize("option", ["replica_sync", "fault_tolerance"])
def test_a_mistyped_key_inside_a_mapping_option_gets_a_suggestion(option):
    """Every key of a mapping option, mistyped (a letter dropped), is refused with its own name suggested, as a
    mistyped SMP key is; a key close to none gets the list alone."""
    from dataclasses import fields

    from lightning_smp.config.fault_tolerance import FaultTolerance
    from lightning_smp.config.replica_sync import ReplicaSync

    record = {"replica_sync": ReplicaSync, "fault_tolerance": FaultTolerance}[option]
    known = ", ".join(f.name for f in fields(record))
    for key in (f.name for f in fields(record)):
        typo = key[:len(key) // 2] + key[len(key) // 2 + 1:]
        with pytest.raises(HybridShardConfigError) as err:
            set_cli_config({option: {typo: 1}})
        assert str(err.value) == (f"LightningCLI `smp:` section: {option}: unknown key {typo!r}. Did you mean {key!r}?"
                                  f" Known keys: {known}.")
    with pytest.raises(HybridShardConfigError) as err:
        set_cli_config({option: {"pipeline": 1}})
    assert str(err.value).endswith(f"{option}: unknown key 'pipeline'. Known keys: {known}.")


def test_malformed_json_and_yaml_name_the_source(tmp_path):
    os.environ[ENV_CONFIG] = '{"hybrid_shard_degree": 2,}'
    with pytest.raises(HybridShardConfigError, match=r"^environment variable LIGHTNING_SMP_CONFIG: malformed JSON: "):
        configured_degree()
    del os.environ[ENV_CONFIG]
    os.environ[ENV_SAGEMAKER] = "{hybrid_shard_degree: 2"
    with pytest.raises(HybridShardConfigError, match=r"^environment variable SM_HP_MP_PARAMETERS: malformed JSON: "):
        configured_degree()
    del os.environ[ENV_SAGEMAKER]
    bad_yaml = tmp_path / "smp.yaml"
    bad_yaml.write_text("hybrid_shard_degree: [2\n")
    with pytest.raises(HybridShardConfigError) as err:
        lightning_smp.init(bad_yaml)
    assert str(err.value).startswith(f"config file '{bad_yaml}': malformed YAML: ")
    bad_json = tmp_path / "smp.json"
    bad_json.write_text("{'hybrid_shard_degree': 2}")
    with pytest.raises(HybridShardConfigError) as err:
        lightning_smp.init(str(bad_json))
    assert str(err.value).startswith(f"config file '{bad_json}': malformed JSON: ")


def test_missing_file_and_non_mapping(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(HybridShardConfigError) as err:
        lightning_smp.init(missing)
    assert str(err.value) == f"config file '{missing}' does not exist. Fix: pass an existing JSON or YAML file."
    os.environ[ENV_CONFIG] = str(missing)
    with pytest.raises(HybridShardConfigError) as err:
        configured_degree()
    assert str(err.value).startswith(f"config file '{missing}' (from environment variable LIGHTNING_SMP_CONFIG)"
                                     " does not exist.")
    del os.environ[ENV_CONFIG]
    listed = tmp_path / "list.yaml"
    listed.write_text("- 2\n")
    with pytest.raises(HybridShardConfigError, match=r"the SMP config must be a mapping .* got list \[2\]"):
        lightning_smp.init(listed)
    with pytest.raises(HybridShardConfigError, match=r"must be a dict, a path to a JSON/YAML file or a JSON string"):
        lightning_smp.init(2)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("tensor_parallel_degree", 4, ("tensor_parallel_degree=4 is not supported: this library implements SMP's"
                                       " sharded data parallelism only")),
        ("context_parallel_degree", 2, "context_parallel_degree=2 is not supported: "),
        ("expert_parallel_degree", 8, "expert_parallel_degree=8 is not supported: "),
        ("sm_activation_offloading", True, ("sm_activation_offloading=True is not supported: SMP's activation"
                                            " offloading is not implemented")),
        ("tensor_parallel_degree", "4", "tensor_parallel_degree='4' (str) is not valid; SMP expects an integer >= 1."),
        ("tensor_parallel_degree", 0, "tensor_parallel_degree=0 (int) is not valid; SMP expects an integer >= 1."),
        ("sm_activation_offloading", "yes", ("sm_activation_offloading='yes' (str) is not valid; SMP expects true"
                                             " or false.")),
        ("random_seed", 1.5, "random_seed=1.5 (float) is not valid; SMP expects an integer >= 0."),
    ],
)
def test_unimplemented_smp_features_that_change_training_fail(key, value, expected):
    with pytest.raises(HybridShardConfigError) as err:
        lightning_smp.init({"hybrid_shard_degree": 2, key: value})
    assert str(err.value).startswith(f"lightning_smp.init(config): {expected}")
    assert configured_degree() == 0  # the failed init() set nothing


def _harmless(key: str) -> object:
    """A value of an SMP key this library does not implement that changes nothing: its smallest (int) or false."""
    rule = UNIMPLEMENTED_KEYS[key]
    value = rule.minimum if rule.kind is int else False
    assert not rule.changes_training(value), key
    return value


@pytest.mark.parametrize(("key", "value"), [(key, _harmless(key)) for key in UNIMPLEMENTED_KEYS])
def test_harmless_smp_keys_warn_and_keep_the_degree(key, value):
    with pytest.warns(UserWarning, match=rf"^lightning_smp.init\(config\): {key}={value!r} is ignored: "):
        lightning_smp.init({"hybrid_shard_degree": 2, key: value})
    assert configured_degree() == 2


def test_environment_warnings_are_not_repeated_every_resolution():
    os.environ[ENV_SAGEMAKER] = '{"hybrid_shard_degree": 2, "random_seed": 7}'
    with pytest.warns(UserWarning, match="random_seed=7 is ignored"):
        assert configured_degree() == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert configured_degree() == 2  # cached: the Trainer and every rank resolve it again


def test_overridden_source_is_still_checked():
    os.environ[ENV_CONFIG] = '{"hybrid_shard_degre": 2}'
    with pytest.raises(HybridShardConfigError, match=rf"^{LABELS['env_inline']}: .*'hybrid_shard_degre'"):
        _ = HybridShardFSDPStrategy(hybrid_shard_degree=2).hybrid_shard_degree


def test_errors_surface_at_trainer_creation_before_any_process():
    os.environ[ENV_CONFIG] = '{"hybrid_shard_degree": 3}'
    with pytest.raises(HybridShardConfigError, match=r"^hybrid_shard_degree=3\b.*\bworld_size=4\b"):
        cpu_trainer(HybridShardFSDPStrategy(start_method="fork"), devices=4)
    os.environ[ENV_CONFIG] = '{"tensor_parallel_degree": 2}'
    with pytest.raises(HybridShardConfigError, match=rf"^{LABELS['env_inline']}: tensor_parallel_degree=2\b"):
        cpu_trainer("smp_hybrid_notebook", devices=4)
    os.environ[ENV_CONFIG] = '{"hybrid_shard_degree": 2}'
    trainer = cpu_trainer("smp_hybrid_notebook", devices=4)
    assert trainer.strategy.layout.mesh_shape == (2, 2)


def test_editing_the_config_file_is_seen(tmp_path):
    path = tmp_path / "smp.json"
    path.write_text('{"hybrid_shard_degree": 2}')
    os.environ[ENV_CONFIG] = str(path)
    assert configured_degree() == 2
    path.write_text('{"hybrid_shard_degree": 4}')
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert configured_degree() == 4


def test_the_fault_tolerant_layout_refusal_names_the_degree_given_and_what_it_resolved_to():
    """hybrid_shard_degree=0 on 2 nodes of 2 ranks is native hybrid sharding: groups of 2, two replicas in one job,
    which fault_tolerance refuses naming the 0 given, the 2 it resolved to and why."""
    from lightning_smp.config.fault_tolerance import FaultTolerance, check_fault_tolerant_layout
    from lightning_smp.degree import resolve_layout

    settings = FaultTolerance.from_mapping({"lighthouse": "localhost:29510", "group": 0, "groups": 2})
    with pytest.raises(HybridShardConfigError) as refused:
        check_fault_tolerant_layout(settings, resolve_layout(4, 0, devices_per_node=2), fixed_by=None, auto=False)
    assert str(refused.value) == (
        "fault_tolerance: each replica group runs as its own job of hybrid_shard_degree ranks, but this job has 4 ranks"
        " and hybrid_shard_degree=0, which resolves to 2 (native FSDP rules: 0 with HYBRID_SHARD shards inside each"
        " node, and a node here has 2 rank(s)): 2 replicas of its own. Fix: launch each group with 2 ranks (one"
        " torchrun per group), or pass hybrid_shard_degree=4.")
