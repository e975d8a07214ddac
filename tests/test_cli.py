"""``lightning-smp`` / ``python -m lightning_smp``: LightningCLI with an ``smp:`` section and the example configs."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import lightning_smp
from lightning_smp import HybridShardConfigError, HybridShardFSDPStrategy
from lightning_smp.cli import HybridShardCLI, main
from lightning_smp.config import ENV_CLI, ENV_CONFIG, SMPConfig, resolve_config
from lightning_smp.config.keys import IMPLEMENTED_KEYS, UNIMPLEMENTED_KEYS
from lightning_smp.names import FULL_SHARD, HYBRID_SHARD, SHARD_GRAD_OP
from tests.helpers import PROCESS_TIMEOUT

# the tests pass args while pytest's own argv is set; that is intended here
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "examples" / "configs"

#: what each example must resolve to on 4 CPU ranks: (mesh shape, FSDP sharding strategy, fsdp_version); ``None``:
#: the planner chooses in the ranks (hybrid_shard_degree="auto", see test_auto_config_fits_what_plan_predicts)
EXPECTED: dict[str, tuple | None] = {
    "hybrid_auto.yaml": None,
    "hybrid_cpu.yaml": ((2, 2), HYBRID_SHARD, 1),
    "hybrid_class_path.yaml": ((2, 2), HYBRID_SHARD, 1),
    "hybrid_zero2_notebook.yaml": ((1, 4), SHARD_GRAD_OP, 1),
    "hybrid_fsdp2_accumulation.yaml": ((2, 2), HYBRID_SHARD, 2),
    # one replica group (2 ranks) of a fault-tolerant job; a plain 2-rank run without torchft's variables
    "fault_tolerance.yaml": ((1, 2), FULL_SHARD, 2),
    # two replica groups of two ranks syncing every 4 steps (each group's FSDP2 on its own ranks)
    "replica_sync.yaml": ((2, 2), HYBRID_SHARD, 2),
}


def _cli(*args: str, tmp_path: Path) -> HybridShardCLI:
    """Parse and instantiate (no subcommand, nothing runs); the Trainer resolves the layout."""
    return HybridShardCLI(args=[*args, f"--trainer.default_root_dir={tmp_path}"], run=False)


def test_every_example_config_is_tested():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.filterwarnings("ignore:.*tensor_parallel_degree=1 is ignored")
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_config_parses_to_the_documented_layout(name, tmp_path):
    cli = _cli("--config", str(CONFIGS / name), tmp_path=tmp_path)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, HybridShardFSDPStrategy)
    expected = EXPECTED[name]
    if expected is None:
        assert strategy.hybrid_shard_degree == "auto" and strategy.core.config.memory_budget == 1_700_000
        return
    mesh_shape, fsdp_strategy, version = expected
    assert strategy.layout.mesh_shape == mesh_shape
    assert strategy.layout.sharding_strategy == fsdp_strategy
    assert strategy.fsdp_version == version
    assert type(cli.model).__name__ == "TinyGPT" and type(cli.datamodule).__name__ == "MarkovDataModule"


@pytest.mark.parametrize("value", [False, True])
def test_broadcast_buffers_from_the_command_line(value, tmp_path):
    override = f"--trainer.strategy.init_args.broadcast_buffers={str(value).lower()}"
    cli = _cli("--config", str(CONFIGS / "hybrid_class_path.yaml"), override, tmp_path=tmp_path)
    assert cli.trainer.strategy.options.broadcast_buffers is value


@pytest.mark.parametrize(
    ("name", "override", "shape"),
    [
        pytest.param("hybrid_cpu.yaml", "--smp.hybrid_shard_degree=4", (1, 4), id="smp_section"),
        pytest.param("hybrid_cpu.yaml", "--smp={hybrid_shard_degree: 1}", (4, 1), id="smp_section_whole"),
        pytest.param("hybrid_class_path.yaml", "--trainer.strategy.init_args.hybrid_shard_degree=4", (1, 4),
                     id="init_args"),
        pytest.param("hybrid_cpu.yaml", "--smp.fsdp_version=2", (2, 2), id="smp_section_fsdp_version"),
        pytest.param("hybrid_class_path.yaml", "--trainer.strategy.init_args.fsdp_version=2", (2, 2),
                     id="init_args_fsdp_version"),
    ],
)
def test_command_line_overrides(name, override, shape, tmp_path):
    cli = _cli("--config", str(CONFIGS / name), override, tmp_path=tmp_path)
    assert cli.trainer.strategy.layout.mesh_shape == shape
    assert cli.trainer.strategy.fsdp_version == (2 if "fsdp_version" in override else 1)


def test_precedence_inside_the_cli(tmp_path):
    """init_args > smp section > init() > environment, all in one run."""
    os.environ[ENV_CONFIG] = '{"hybrid_shard_degree": 1}'
    lightning_smp.init({"hybrid_shard_degree": 4})
    # the smp: section (2) beats init() (4) and the environment (1)
    assert _cli("--config", str(CONFIGS / "hybrid_cpu.yaml"), tmp_path=tmp_path).trainer.strategy.layout.degree == 2
    # without a section, init() (4) beats the environment (1)
    cli = _cli("--config", str(CONFIGS / "hybrid_cpu.yaml"), "--smp=null", tmp_path=tmp_path)
    assert cli.trainer.strategy.layout.degree == 4
    # init_args (1 is explicit) beat the smp: section (4), with a warning naming both
    with pytest.warns(UserWarning, match=r"init_args.hybrid_shard_degree=1 overrides smp.hybrid_shard_degree=4"):
        cli = _cli("--config", str(CONFIGS / "hybrid_class_path.yaml"), "--smp.hybrid_shard_degree=4",
                   "--trainer.strategy.init_args.hybrid_shard_degree=1", tmp_path=tmp_path)
    assert cli.trainer.strategy.layout.degree == 1


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        pytest.param("--smp.hybrid_shard_dgree=2", "unknown SMP config key 'hybrid_shard_dgree'. Did you mean"
                     " 'hybrid_shard_degree'?", id="typo"),
        pytest.param("--smp={hybrid_shard_degree: 4, evry: 2}", "unknown SMP config key 'evry'.", id="typo_in_mapping"),
        pytest.param("--smp.hybrid_shard_degree=two", "hybrid_shard_degree='two' (str) is not a degree.", id="string"),
        pytest.param("--smp.hybrid_shard_degree=2.5", "hybrid_shard_degree=2.5 (float) is not an integer.",
                     id="float"),
        pytest.param("--smp.hybrid_shard_degree=true", "hybrid_shard_degree=True (bool) is not an integer.",
                     id="bool"),
        pytest.param("--smp.sm_activation_offloading=3",
                     "sm_activation_offloading=3 (int) is not valid; SMP expects true or false.", id="not_bool"),
    ],
)
@pytest.mark.parametrize("command", ["fit", "plan"])
def test_a_section_the_parser_cannot_type_is_refused_with_the_library_s_error(command, override, expected, tmp_path):
    """Both commands take the section from the same declarations, and what jsonargparse cannot type (an unknown key,
    a value of another type) is refused by the library's check, naming the source, the key and the value, with a
    "did you mean" (not jsonargparse's usage text)."""
    args = [command, "--config", str(CONFIGS / "hybrid_cpu.yaml"), override]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, f"--trainer.default_root_dir={tmp_path}"] if command == "fit" else args)
    assert str(exit_info.value.code).startswith(f"lightning-smp{' plan' * (command == 'plan')}: error: LightningCLI"
                                                f" `smp:` section: {expected}")
    assert ENV_CLI not in os.environ


@pytest.mark.parametrize("command", ["fit", "plan"])
def test_both_commands_document_every_smp_key_as_a_flag(command, capsys):
    """`--smp.help` documents --smp.KEY for every declared key (replica_sync among them, also for `plan --params`),
    with the key's own documentation; `--help` lists the keys."""
    from lightning_smp.config.keys import KEY_DOCS

    for flag in ("--smp.help", "--help"):
        with pytest.raises(SystemExit):
            main([command, flag])
        text = " ".join(capsys.readouterr().out.split())
        for key, doc in KEY_DOCS.items():
            if flag == "--help":
                assert f" {key}," in text or f" {key}." in text or f" {key};" in text, (key, command)
            else:
                assert f"--smp.{key} " in text and " ".join(doc.split()[:5]) in text, (key, command)


#: A value of each SMP key this library implements, other than its default (test_every_smp_key_resolves_alike_in_fit
#: _and_plan fails for a key declared without one).
EXAMPLES = {"hybrid_shard_degree": "auto", "fsdp_version": 2, "memory_budget": "1.2MB", "links": "aws-p4d",
            "async_save": True, "fault_tolerance": {"lighthouse": "localhost:29510", "group": 1, "groups": 2},
            "replica_sync": {"every": 20, "backup": "cpu"}}


def _example(key: str):
    """:data:`EXAMPLES`' value, or for a key this library does not implement the value its rule calls harmless."""
    if key in IMPLEMENTED_KEYS:
        return EXAMPLES[key]
    rule = UNIMPLEMENTED_KEYS[key]
    value = False if rule.kind is bool else rule.minimum
    assert not rule.changes_training(value)
    return value


def _fit_resolves(args: list[str], capsys) -> SMPConfig:
    """What `lightning-smp fit` resolves from ``args``, without training: parsed (--print_config stops there), its
    section exported as for the ranks, and merged as every rank's strategy merges it (the registered name of the
    configs used here passes no SMP key of its own)."""
    with pytest.raises(SystemExit) as exit_info:
        HybridShardCLI(args=["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    capsys.readouterr()
    return resolve_config()


@pytest.mark.filterwarnings("ignore:.*is ignored")
@pytest.mark.parametrize("form", ["key", "mapping"])
@pytest.mark.parametrize("key", [f.name for f in dataclasses.fields(SMPConfig)])
def test_every_smp_key_resolves_alike_in_fit_and_plan(key, form, capsys):
    """`lightning-smp fit` and `lightning-smp plan` take every declared SMP key, as --smp.KEY VALUE and as --smp
    "{KEY: VALUE}", over the config file's smp: section (hybrid_shard_degree: 2, kept), and resolve the same
    configuration, holding the key's checked value."""
    from lightning_smp.planner.cli import _parser, smp_config

    value = _example(key)
    value = value if isinstance(value, str) else json.dumps(value)  # (as typed: auto, 1.2MB, {"every": 20, ...})
    args = ["--config", str(CONFIGS / "hybrid_cpu.yaml"), f"--smp.{key}={value}" if form == "key" else
            f"--smp={{{key}: {value}}}"]
    fit = _fit_resolves(args, capsys)
    os.environ.pop(ENV_CLI)  # (the plan reads its own section, never a fit's)
    planned = smp_config(_parser().parse_args(args))
    assert planned == fit
    if key in IMPLEMENTED_KEYS:
        assert getattr(planned, key) == IMPLEMENTED_KEYS[key](_example(key)) != getattr(SMPConfig(), key)
    if key != "hybrid_shard_degree":
        assert planned.hybrid_shard_degree == 2  # the file's section, under the flag


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        # the messages are lightning_smp.config's and .degree's (asserted in their tests): here the source and key
        pytest.param("--smp.tensor_parallel_degree=2", "LightningCLI `smp:` section: tensor_parallel_degree=2 ",
                     id="tensor_parallel"),
        pytest.param("--smp.hybrid_shard_degree=-1", "LightningCLI `smp:` section: hybrid_shard_degree=-1 ",
                     id="negative"),
        pytest.param("--smp.hybrid_shard_degree=3", "hybrid_shard_degree=3 ", id="divisor"),
        # an smp: section under another strategy would be ignored, silently (a run without what it asks for)
        pytest.param("--trainer.strategy=ddp", "the smp: section sets hybrid_shard_degree, but trainer.strategy is"
                     " DDPStrategy, not a lightning_smp strategy", id="not_an_smp_strategy"),
    ],
)
def test_cli_errors_name_the_source_and_key(override, expected, tmp_path):
    """What typing cannot know (SMP semantics, the world size) is checked by the library, naming the source."""
    args = ["fit", "--config", str(CONFIGS / "hybrid_cpu.yaml"), override, f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert str(exit_info.value.code).startswith(f"lightning-smp: error: {expected}")
    assert ENV_CLI not in os.environ  # main() does not leak the section into the rest of the process
    with pytest.raises(HybridShardConfigError):  # the class itself raises the library's exception
        HybridShardCLI(args=args[1:], run=False)


def _printed(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_print_config_shows_the_resolved_degree(capsys):
    printed = _printed(capsys, "--config", str(CONFIGS / "hybrid_cpu.yaml"), "--print_config")
    assert printed["smp"] == {"hybrid_shard_degree": 2}
    assert printed["trainer"]["strategy"] == "smp_hybrid"
    # a degree that comes from the environment is written out, so the printed config reproduces the run
    os.environ[ENV_CONFIG] = '{"hybrid_shard_degree": 4}'
    printed = _printed(capsys, "--config", str(CONFIGS / "hybrid_class_path.yaml"),
                       "--trainer.strategy.init_args.hybrid_shard_degree=null", "--print_config")
    assert printed["smp"] == {"hybrid_shard_degree": 4}
    # an explicit init_args value is what runs, and what is shown
    printed = _printed(capsys, "--config", str(CONFIGS / "hybrid_class_path.yaml"),
                       "--trainer.strategy.init_args.hybrid_shard_degree=1", "--print_config=skip_default")
    assert printed["smp"] == {"hybrid_shard_degree": 1}
    assert printed["trainer"]["strategy"]["init_args"]["hybrid_shard_degree"] == 1


def test_every_option_is_in_the_cli_help_and_the_printed_config(capsys):
    """The options are declared once (lightning_smp.config.options) and reach the CLI through each strategy's
    signature and docstring: --print_config shows every one under init_args, and the strategy's help documents each
    (its declared doc's first words)."""
    from lightning_smp.config.options import declarations

    declared = declarations()
    printed = _printed(capsys, "--config", str(CONFIGS / "hybrid_class_path.yaml"), "--print_config")
    init_args = printed["trainer"]["strategy"]["init_args"]
    assert {name for name, *_ in declared} <= set(init_args)
    assert init_args["hybrid_shard_degree"] == 2 and init_args["broadcast_buffers"] is True
    with pytest.raises(SystemExit):
        main(["fit", "--trainer.strategy.help", "lightning_smp.HybridShardFSDPStrategy"])
    text = " ".join(capsys.readouterr().out.split())
    for name, _, _, doc in declared:
        assert f"--trainer.strategy.{name} " in text
        assert " ".join(doc.split()[:6]) in text, name


@pytest.mark.timeout(PROCESS_TIMEOUT)
@pytest.mark.parametrize("config", ["hybrid_cpu.yaml", "hybrid_fsdp2_accumulation.yaml"])
def test_cli_fit_with_fork_ranks_uses_the_smp_section(tmp_path, config):
    """The smp: section reaches the ranks (either engine): each one records its shard group."""
    records = tmp_path / "records"
    main([
        "fit", "--config", str(CONFIGS / config), "--trainer.strategy=smp_hybrid_notebook",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
        f'--trainer.callbacks=[{{"class_path": "tests.helpers.RankRecorder", "init_args": {{"folder": "{records}"}}}}]',
    ])
    import torch

    ranks = [torch.load(records / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert [r["shard_group"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["fsdp_strategy"] for r in ranks] == [HYBRID_SHARD] * 4
    micro_batches = 4 if "fsdp2" in config else 1  # the FSDP2 example accumulates 4 per optimizer step
    assert [len(r["losses"]) for r in ranks] == [2 * micro_batches] * 4
    assert [r["counters"][0] for r in ranks] == [2] * 4
    assert ENV_CLI not in os.environ


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=PROCESS_TIMEOUT - 20, env=env, cwd=cwd)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(PROCESS_TIMEOUT)
def test_console_script_trains_on_four_cpu_ranks(tmp_path):
    """`lightning-smp fit --config examples/configs/hybrid_cpu.yaml` through the script launcher (4 processes)."""
    script = Path(sys.executable).parent / "lightning-smp"
    out = _run([str(script), "fit", "--config", str(CONFIGS / "hybrid_cpu.yaml"), "--trainer.max_steps=3",
                "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
                f"--trainer.default_root_dir={tmp_path}"], cwd=tmp_path)
    assert "hybrid_shard_degree=2: 2 replica(s) x 2 shard(s) over 4 rank(s)" in out.stdout + out.stderr
    run_dir = tmp_path / "lightning_logs" / "version_0"
    with open(run_dir / "metrics.csv") as f:
        losses = [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]
    assert len(losses) == 3
    # the saved config holds the typed section (SMPConfig's keys; those not set are null)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["smp"]
    assert {k: v for k, v in saved.items() if v is not None} == {"hybrid_shard_degree": 2}
    assert set(saved) == {f.name for f in dataclasses.fields(SMPConfig)}


@pytest.mark.slow
@pytest.mark.timeout(PROCESS_TIMEOUT)
def test_auto_config_fits_what_plan_predicts(tmp_path):
    """`lightning-smp plan --config hybrid_auto.yaml` predicts the degree `lightning-smp fit` then chooses in every
    rank (script launcher: 4 processes, each planning alone from the same model, world and budget)."""
    script = str(Path(sys.executable).parent / "lightning-smp")
    planned = _run([script, "plan", "--config", str(CONFIGS / "hybrid_auto.yaml"), "--json", str(tmp_path / "p.json")],
                   cwd=tmp_path)
    degree = yaml.safe_load((tmp_path / "p.json").read_text())["degree"]
    assert degree == 2 and "degree 2 has the least predicted step time" in planned.stdout
    out = _run([script, "fit", "--config", str(CONFIGS / "hybrid_auto.yaml"), "--trainer.enable_progress_bar=false",
                f"--trainer.default_root_dir={tmp_path}"], cwd=tmp_path)
    text = out.stdout + out.stderr
    assert "hybrid_shard_degree='auto' chose 2." in text and "Degree plan: 4 rank(s)" in text
    assert "hybrid_shard_degree=2: 2 replica(s) x 2 shard(s) over 4 rank(s)" in text
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as f:
        assert len([row for row in csv.DictReader(f) if row.get("train_loss")]) == 4


@pytest.mark.slow
@pytest.mark.timeout(PROCESS_TIMEOUT)
def test_python_dash_m_prints_resolved_config(tmp_path):
    out = _run([sys.executable, "-m", "lightning_smp", "fit", "--config", str(CONFIGS / "hybrid_class_path.yaml"),
                "--trainer.strategy.init_args.hybrid_shard_degree=4", "--print_config"], cwd=tmp_path)
    printed = yaml.safe_load(out.stdout)
    assert printed["smp"] == {"hybrid_shard_degree": 4}
    assert printed["trainer"]["strategy"]["class_path"] == "lightning_smp.HybridShardFSDPStrategy"


def test_the_replica_sync_example_trains_and_saves_its_section(tmp_path, monkeypatch):
    """`lightning-smp fit --config examples/configs/replica_sync.yaml` (its ranks forked here): the smp section's
    replica_sync reaches the strategy, every step is logged, and the saved config holds the section."""
    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(CONFIGS / "replica_sync.yaml"), "--trainer.strategy.init_args.start_method=fork",
          "--trainer.enable_progress_bar=false", "--trainer.max_steps=6", f"--trainer.default_root_dir={tmp_path}"])
    run_dir = tmp_path / "lightning_logs" / "version_0"
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len([row for row in rows if row.get("train_loss")]) == 6
    assert len([row for row in rows if row.get("val_loss")]) == 1  # at step 6, after the sync
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["smp"]
    assert saved["replica_sync"] == {"every": 4, "delay": 2, "compress": "int8"} and saved["hybrid_shard_degree"] == 2
