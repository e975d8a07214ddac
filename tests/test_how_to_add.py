"""The steps of ``docs/architecture.md``, "How to add", followed as written: an option, an accumulation mode (an engine:
``tests/test_ddp_engine.py::test_a_fourth_engine_needs_only_its_class_and_its_registration``). Each test makes only
the edit the steps name (here as a subclass or a registration, where the steps edit a source file) and then checks
every place the steps say the new thing reaches."""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from pathlib import Path

import pytest
import torch

import lightning_smp
from lightning_smp import HybridShardConfigError
from lightning_smp.config.keys import IMPLEMENTED, SMPConfig
from lightning_smp.config.options import StrategyOptions, acting_in, option, option_fields
from lightning_smp.core import HybridShardCore
from lightning_smp.engines import ShardingPlan
from lightning_smp.frontend import with_options
from lightning_smp.names import ACTS_IN

PACKAGE = Path(lightning_smp.__file__).parent


def _check_delay(value: object, name: str = "reduce_delay") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HybridShardConfigError(f"{name}={value!r} is not a number of steps >= 0. Fix: pass 0, 1, 2, ...")
    return value


# step 1 of "an option": one field, with its type, default, check and documentation
@dataclasses.dataclass(frozen=True)
class DelayOptions(StrategyOptions):
    reduce_delay: int = option(0, check=_check_delay, acts_in=("front_ends",),
                               doc="steps to wait before the first reduction (a test option).")


@with_options
class DelayStrategy(lightning_smp.HybridShardFSDPStrategy):
    """The Trainer strategy with one option more."""

    options_type = DelayOptions


def test_a_new_option_is_one_field():
    # the constructor's signature, typed, with its default: what IDEs, help() and LightningCLI read
    parameter = inspect.signature(DelayStrategy.__init__).parameters["reduce_delay"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default == 0
    assert typing.get_type_hints(DelayStrategy.__init__)["reduce_delay"] is int
    assert "reduce_delay: steps to wait before the first reduction" in DelayStrategy.__doc__
    # its check, before anything is built, and its value where the code reads it
    with pytest.raises(HybridShardConfigError, match=r"reduce_delay=-1 is not a number of steps"):
        DelayStrategy(reduce_delay=-1)
    strategy = DelayStrategy(hybrid_shard_degree=2, reduce_delay=3)
    assert strategy.options.reduce_delay == 3 and strategy.core.options is strategy.options
    assert strategy.config.hybrid_shard_degree == 2  # (an SMP key: strategy.config, resolved from every source)
    # every other option and Lightning's own arguments are as they were, and the parent class is untouched
    parent = inspect.signature(lightning_smp.HybridShardFSDPStrategy.__init__).parameters
    assert "reduce_delay" not in parent
    assert list(inspect.signature(DelayStrategy.__init__).parameters) == [*parent][:-1] + ["reduce_delay", "kwargs"]
    assert DelayStrategy(None, None, None, None, None, None, None, None, None, None, None, None, "FULL_SHARD",
                         "full").options.state_dict_type == "full"


def test_the_constructors_hold_every_option_as_written_from_the_declarations():
    """What static type checkers and IDEs read: both constructors' option parameters, in their source, are what
    ``python -m lightning_smp.generate`` writes from the declarations (run it after adding an option)."""
    from lightning_smp import fabric
    from lightning_smp.config.options import DOC_BEGIN, DOC_END, GENERATED_IN
    from lightning_smp.generate import docstring_source, generated_part, lightning_positional, signature_source

    positional = lightning_positional()
    assert positional == ("sharding_strategy", "state_dict_type", "device_mesh")
    for name in GENERATED_IN:
        source = (PACKAGE / name).read_text()
        indent, written = generated_part(source)
        assert written == signature_source(indent, positional), f"run python -m lightning_smp.generate ({name})"
        indent, written = generated_part(source, DOC_BEGIN, DOC_END)
        assert written == docstring_source(indent), f"run python -m lightning_smp.generate ({name})"
    for cls in (lightning_smp.HybridShardFSDPStrategy, fabric.HybridShardFSDPStrategy):
        # Lightning's positional options keep their place and kind
        parameters = inspect.signature(cls.__init__).parameters.values()
        assert tuple(p.name for p in parameters if p.name in positional
                     and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD) == positional
        hints = typing.get_type_hints(cls.__init__)  # (the names the generated annotations use resolve)
        assert hints["hybrid_shard_degree"] == int | typing.Literal["auto"] | None
        # the runtime docstring: the options' entries, without the two lines around them
        assert "    fault_tolerance: this library's key" in cls.__doc__ and DOC_BEGIN not in cls.__doc__


def _values_of(hint: object) -> list[object]:
    """The values a type names one by one (``bool``, a ``Literal``, unions of them)."""
    if hint is bool:
        return [True, False]
    if typing.get_origin(hint) is typing.Literal:
        return list(typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [value for arg in typing.get_args(hint) for value in _values_of(arg)]
    return []


def _plan_with(options: StrategyOptions):
    core = HybridShardCore.from_options(options, engine_options={})
    core.configure(1, 2)
    return core.plan(torch.device("cpu"), mixed_precision=None, cpu_offload=None, options={}, precision="32-true")


@pytest.mark.parametrize("name", acting_in("engines"))
def test_an_option_that_acts_in_the_engines_reaches_them(name):
    """Step "an engine must honour it": its declaration says ``acts_in=("engines",)``, the engines' ``ShardingPlan``
    has a field of its name, and a value other than its default arrives there through the core, with no line of its
    own in ``core.plan``."""
    assert name in {f.name for f in dataclasses.fields(ShardingPlan)}, f"{name} acts in the engines: a ShardingPlan field"
    declared = {f.name: f for f in (*IMPLEMENTED, *option_fields())}[name]
    hints = typing.get_type_hints(SMPConfig) | typing.get_type_hints(StrategyOptions)
    others = [value for value in _values_of(hints[name]) if value != declared.default]
    assert others, f"{name}: no value of {hints[name]} other than its default to send"
    for value in others:
        assert getattr(_plan_with(StrategyOptions.from_arguments({name: value}, engine_options={})), name) == value


def test_an_option_that_acts_in_the_engines_without_a_path_fails_loudly():
    """An option declared to act in the engines but missing from ``ShardingPlan`` stops the first plan, naming it."""

    @dataclasses.dataclass(frozen=True)
    class EngineDelayOptions(StrategyOptions):
        reduce_delay: int = option(0, check=_check_delay, acts_in=("engines",), doc="a test option.")

    assert acting_in("engines", EngineDelayOptions)[-1] == "reduce_delay"
    with pytest.raises(TypeError, match="reduce_delay"):
        _plan_with(EngineDelayOptions.from_arguments({"reduce_delay": 2}, engine_options={}))


def test_one_check_serves_every_option_of_its_kind():
    """A check is called with the option's name: two boolean options share ``check_boolean`` and each error names its
    own option; a check that cannot take the name is refused when it is declared."""
    from lightning_smp.config.keys import check_boolean

    @dataclasses.dataclass(frozen=True)
    class TwoFlags(StrategyOptions):
        first_flag: bool = option(False, check=check_boolean, acts_in=("front_ends",), doc="a test option.")
        second_flag: bool = option(True, check=check_boolean, acts_in=("front_ends",), doc="a test option.")

    for name in ("first_flag", "second_flag"):
        with pytest.raises(HybridShardConfigError, match=rf"^{name}='no' \(str\) is not a boolean"):
            TwoFlags.from_arguments({name: "no"}, engine_options={})
    assert TwoFlags.from_arguments({"second_flag": False}, engine_options={}).second_flag is False
    with pytest.raises(RuntimeError, match="must take \\(value, name\\)"):
        option(0, check=lambda value: value, acts_in=("front_ends",), doc="")  # type: ignore[arg-type]


@pytest.mark.parametrize("acting", ["trainer", "fabric"])
def test_every_front_end_refuses_a_key_it_does_not_act_on_by_its_declaration(monkeypatch, acting):
    """``smp_key(..., front_ends=...)`` is the one rule: a front end not listed refuses the key when it is configured
    (``init()``'s plain calls: ``tests/test_plain_fsdp.py``), naming the key and where it acts."""
    import lightning as L
    from lightning.fabric import Fabric

    import lightning_smp.config.keys as keys
    import lightning_smp.fabric
    from lightning_smp import UnsupportedOptionError

    monkeypatch.setitem(keys.ACTING_FRONT_ENDS, "async_save", (acting,))
    refusing = {"trainer": lambda: L.Trainer(strategy=lightning_smp.HybridShardFSDPStrategy(async_save=True),
                                             accelerator="cpu", devices=2, logger=False),
                "fabric": lambda: Fabric(strategy=lightning_smp.fabric.HybridShardFSDPStrategy(async_save=True),
                                         accelerator="cpu", devices=2)}
    other = "fabric" if acting == "trainer" else "trainer"
    with pytest.raises(UnsupportedOptionError, match=re.escape(
            f"async_save=True is set in the configuration, but {keys.FRONT_END_NAMES[other]} cannot act on it:"
            f" async_save acts in {keys.FRONT_END_NAMES[acting]}")):
        refusing[other]()
    refusing[acting]()  # the one that acts on it takes it


def test_every_option_declares_where_it_acts():
    with pytest.raises(RuntimeError, match="acts_in=.*must be a tuple of one or more of"):
        option(0, check=_check_delay, acts_in=("the moon",), doc="")  # type: ignore[arg-type]
    for declared in (*IMPLEMENTED, *option_fields()):
        assert set(declared.metadata["acts_in"]) <= set(ACTS_IN) and declared.metadata["acts_in"]


def test_a_new_option_is_written_into_both_constructors(tmp_path):
    """Step 1's command, on copies of the two front ends: the new option's parameter, typed, with its default, lands
    in both constructors and nothing else in them changes; a second run changes nothing."""
    import shutil

    from lightning_smp.config.options import DOC_BEGIN, DOC_END, GENERATED_IN
    from lightning_smp.generate import generated_part, lightning_positional, write_constructors

    for name in GENERATED_IN:
        shutil.copy(PACKAGE / name, tmp_path / name)
    assert write_constructors(tmp_path, lightning_positional(), DelayOptions) == [tmp_path / n for n in GENERATED_IN]
    for name in GENERATED_IN:
        before, after = (PACKAGE / name).read_text(), (tmp_path / name).read_text()
        (_, old), (indent, new) = generated_part(before), generated_part(after)
        assert new.splitlines()[-2] == f"{indent}reduce_delay: int = 0,"
        (_, old_doc), (_, new_doc) = generated_part(before, DOC_BEGIN, DOC_END), generated_part(after, DOC_BEGIN, DOC_END)
        assert f"{indent}reduce_delay: steps to wait before the first reduction" in new_doc
        assert after.replace(new, "").replace(new_doc, "") == before.replace(old, "").replace(old_doc, "")
    assert write_constructors(tmp_path, lightning_positional(), DelayOptions) == []


def test_a_constructor_written_before_an_option_was_added_still_takes_it_at_run_time_silently():
    """Generation is a tool, not a runtime concern: a front end edited without rewriting its options does not warn
    when imported (``test_the_constructors_hold_every_option_as_written_from_the_declarations`` fails instead); at
    run time its signature and docstring are the declarations' all the same. A user's own constructor likewise."""
    import warnings

    class Stale(lightning_smp.HybridShardFSDPStrategy):
        """A strategy whose constructor was written before an option was added.

        Arguments:
            (the options, written from their declarations by python -m lightning_smp.generate:)
            hybrid_shard_degree: the degree.
            (end of the options)
        """

        def __init__(self, accelerator=None, *, hybrid_shard_degree=None, **kwargs):
            super().__init__(accelerator, hybrid_shard_degree=hybrid_shard_degree, **kwargs)

    class Users(lightning_smp.HybridShardFSDPStrategy):  # a user's own constructor: nothing of the command's
        """A user's strategy."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with_options(Stale)
        with_options(Users)
    for cls in (Stale, Users):
        assert "broadcast_buffers" in inspect.signature(cls.__init__).parameters
        assert "broadcast_buffers: ``True`` (default" in cls.__doc__


def test_the_documentation_s_tables_are_written_from_the_declarations():
    """``docs/configuration.md``'s table of the options and its table of SMP keys, ``docs/fault-tolerance.md``'s of
    the ``fault_tolerance`` keys: what ``python -m
    lightning_smp.generate`` writes (run it after adding an option or a key); a table hand-edited away from the
    declarations fails here."""
    from lightning_smp.config.fault_tolerance import FaultTolerance
    from lightning_smp.generate import TABLES, table, table_begin, table_end

    for name, page in TABLES.items():
        text = (PACKAGE.parent / page).read_text()
        written = text[text.index(table_begin(name)) + len(table_begin(name)):text.index(table_end(name))]
        assert written.strip() == table(name), f"run python -m lightning_smp.generate ({name})"
    for declared in dataclasses.fields(FaultTolerance):  # each with its meaning, from the record's docstring
        assert re.search(rf"\| `{declared.name}` \| .* \| \w.{{20,}} \|", table("fault tolerance keys"))
    options = table("strategy options")
    for declared in lightning_smp.config.options.declarations():
        assert f"| `{declared[0]}` |" in options
    keys = table("smp keys")
    for key in lightning_smp.config.KNOWN_KEYS:
        assert f"| `{key}` |" in keys


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_generator_rewrites_a_stale_tree_and_says_nothing_else(tmp_path):
    """``python -m lightning_smp.generate`` on a copy of the tree whose front ends and tables are stale: it rewrites
    them (to the text the tests hold) and prints only what it rewrote, no warning, though it imports the stale
    package itself."""
    import shutil
    import subprocess
    import sys

    from lightning_smp.config.options import GENERATED_IN
    from lightning_smp.generate import TABLES

    shutil.copytree(PACKAGE, tmp_path / "lightning_smp", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "docs").mkdir()
    for page in set(TABLES.values()):  # every page with a generated table
        shutil.copy(PACKAGE.parent / page, tmp_path / page)
    stale = tmp_path / "lightning_smp" / "strategy.py"
    stale.write_text(stale.read_text().replace("        broadcast_buffers: bool = True,\n", "", 1))
    page = tmp_path / "docs" / "configuration.md"
    page.write_text(page.read_text().replace("| `links` |", "| `links (old)` |"))
    done = subprocess.run([sys.executable, "-W", "always", "-m", "lightning_smp.generate", "--checkout", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"rewrote {stale}", f"rewrote {page}"] and not done.stderr.strip()
    for name in GENERATED_IN:
        assert (tmp_path / "lightning_smp" / name).read_text() == (PACKAGE / name).read_text()
    assert page.read_text() == (PACKAGE.parent / "docs" / "configuration.md").read_text()


def test_a_new_option_reaches_the_cli(capsys):
    from lightning_smp.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--config", "examples/configs/hybrid_class_path.yaml",
              "--trainer.strategy.class_path", "tests.test_how_to_add.DelayStrategy",
              "--trainer.strategy.init_args.reduce_delay", "2", "--print_config"])
    import yaml

    init_args = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]["init_args"]
    assert init_args["reduce_delay"] == 2 and init_args["hybrid_shard_degree"] == 2


def test_a_new_accumulation_mode_is_one_record(monkeypatch):
    """Steps of "an accumulation mode": its name (``names.GradientAccumulation``), its record
    (``accumulation.ACCUMULATION_MODES``), and the engines that implement it list it in their capabilities. The
    planner's figures, the textbook and the engine's accumulation context then follow the record: here a second name
    for what ``defer_all_reduce`` does."""
    import lightning_smp.accumulation as accumulation
    import lightning_smp.config.options as options
    from lightning_smp import names
    from lightning_smp.degree import resolve_layout
    from lightning_smp.engines import FSDP2Engine, engine_for
    from lightning_smp.planner.step import transient_bytes

    alias = "reduce_scatter_each"
    record = dataclasses.replace(accumulation.ACCUMULATION_MODES[names.DEFER_ALL_REDUCE], name=alias)
    monkeypatch.setattr(options, "GRADIENT_ACCUMULATIONS", (*names.GRADIENT_ACCUMULATIONS, alias))
    monkeypatch.setattr(accumulation, "ACCUMULATION_MODES", {**accumulation.ACCUMULATION_MODES, alias: record})
    engine = engine_for(2)
    capabilities = engine.capabilities
    monkeypatch.setattr(engine, "capabilities",
                        dataclasses.replace(capabilities, accumulations=(*capabilities.accumulations, alias)))

    strategy = lightning_smp.HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=2,
                                                     gradient_accumulation=alias)
    assert strategy.options.gradient_accumulation == alias
    with pytest.raises(HybridShardConfigError, match=f"gradient_accumulation='{alias}' needs fsdp_version=2"):
        lightning_smp.HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=1, gradient_accumulation=alias)
    units = [[torch.nn.Parameter(torch.zeros(64, 64))], [torch.nn.Parameter(torch.zeros(64))]]
    layout = resolve_layout(8, 2)
    for reader in (lambda mode: engine.prediction.step_textbook(units, layout, 4, mode, "32-true"),
                   lambda mode: transient_bytes(units, False, layout, engine.prediction, 4, mode, "32-true")):
        assert reader(alias) == reader(names.DEFER_ALL_REDUCE) != reader(names.NO_SYNC)
    assert isinstance(engine, FSDP2Engine)


def test_a_new_accumulation_mode_reaches_the_engine(monkeypatch):
    """The FSDP2 engine's accumulation context reads the record: the alias turns off the all-reduce only, as
    ``defer_all_reduce`` does (on a one-rank process group, in this process)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import lightning_smp.accumulation as accumulation
    from lightning_smp import names
    from lightning_smp.engines import engine_for
    from lightning_smp.engines.fsdp2.groups import fsdp_modules
    from lightning_smp.testing import free_port

    alias = "reduce_scatter_each"
    record = dataclasses.replace(accumulation.ACCUMULATION_MODES[names.DEFER_ALL_REDUCE], name=alias)
    monkeypatch.setattr(accumulation, "ACCUMULATION_MODES", {**accumulation.ACCUMULATION_MODES, alias: record})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    engine = engine_for(2)

    def flags(mode: str) -> list[tuple[bool, bool]]:
        with engine.accumulation_context(model, mode):
            return [(m._get_fsdp_state()._fsdp_param_group.reduce_grads,
                     m._get_fsdp_state()._fsdp_param_group.all_reduce_grads) for m in fsdp_modules(model)]

    assert flags(alias) == flags(names.DEFER_ALL_REDUCE) == [(True, False), (True, False)]
    assert flags(names.NO_SYNC) == [(False, False), (False, False)]  # no reduction at all
