"""``hybrid_shard_degree="auto"``: the planner's choice in real multi-process runs (Trainer, Fabric, plain FSDP),
for budgets on both sides of every threshold, the error when nothing fits, and every configuration source."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

import lightning_smp
from lightning_smp import HybridShardConfigError, HybridShardFSDPStrategy
from lightning_smp.config import ENV_CONFIG, ENV_SAGEMAKER, resolve_config, set_cli_config
from lightning_smp.names import AUTO, SHARD_AXIS
from lightning_smp.testing import run_distributed
from tests.helpers import FSDP_VERSIONS, GLOO_TIMEOUT, cpu_trainer

WORLD = 4
WIDTH, HIDDEN, BLOCKS = 1024, 2048, 3  # 3 x 4.2 M = 12.6 M parameters


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class WideModel(L.LightningModule):
    """Tens of millions of parameters in three FSDP units; ``example_input_array`` lets the planner trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block() for _ in range(BLOCKS)])
        self.example_input_array = torch.zeros(2, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, WIDTH)), batch_size=2)


def _plan(version: int, traced: bool = True) -> lightning_smp.Plan:
    """What the strategy will plan (``traced``: with the model's example input, as the strategies do; plain FSDP
    calls have none), computed here on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = WideModel()
    return lightning_smp.plan(model, world_size=WORLD, devices_per_node=WORLD, budget_bytes=10**15,
                              fsdp_version=version, auto_wrap_policy={Block},
                              example_input=torch.zeros(2, WIDTH) if traced else None)


class ChoiceRecorder(Callback):
    """Each rank's degree, shard group and plan, written to ``<folder>/rank<k>.json``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        record = {"degree": strategy.layout.degree, "property": strategy.hybrid_shard_degree,
                  "shard_group": dist.get_process_group_ranks(strategy.device_mesh.get_group(SHARD_AXIS))
                  if strategy.layout.replicate > 1 else list(range(WORLD)),
                  "budget": strategy.degree_plan.budget_bytes, "activations": strategy.degree_plan.activations}
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _thresholds(version: int, traced: bool = True) -> list[tuple[int, int | None]]:
    """(budget, expected degree) on both sides of every threshold: a budget that just fits degree d with the 10%
    headroom picks d; a byte less picks the next degree. Just below degree 4 the planner would turn activation
    checkpointing on (``test_trainer_turns_checkpointing_on_when_nothing_fits_without_it``); below degree 4's model
    state alone nothing fits, whatever is checkpointed (``None``)."""
    rows = {r.degree: r for r in _plan(version, traced).rows}
    peaks = {degree: row.peak_bytes for degree, row in rows.items()}
    assert list(peaks) == [1, 2, 4] and peaks[1] > peaks[2] > peaks[4]
    cases: list[tuple[int, int | None]] = []
    for degree, below in ((1, 2), (2, 4)):
        budget = math.ceil(peaks[degree] * 1.1)
        cases += [(budget, degree), (budget - 1, below)]
    return [*cases, (math.ceil(peaks[4] * 1.1), 4), (rows[4].model_state_bytes, None)]


@pytest.mark.timeout(4 * GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_trainer_chooses_the_degree_a_budget_just_fits_on_both_sides_of_each_threshold(tmp_path, version):
    cases = _thresholds(version)
    assert [expected for _, expected in cases] == [1, 2, 2, 4, 4, None]
    for index, (budget, expected) in enumerate(cases):
        folder = tmp_path / str(index)
        strategy = HybridShardFSDPStrategy(hybrid_shard_degree="auto", memory_budget=budget, fsdp_version=version,
                                           auto_wrap_policy={Block}, start_method="fork")
        trainer = cpu_trainer(strategy, folder, WORLD, max_steps=1, callbacks=[ChoiceRecorder(folder)])
        if expected is None:
            with pytest.raises(HybridShardConfigError, match=rf"no hybrid_shard_degree fits memory_budget={budget} "
                                                             r"bytes .* at degree 4 .*What would help"):
                trainer.fit(WideModel(), _loader())
            continue
        trainer.fit(WideModel(), _loader())
        records = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(WORLD)]
        assert {r["degree"] for r in records} == {expected} and {r["property"] for r in records} == {expected}
        assert records[0]["shard_group"] == list(range(expected)) and records[0]["budget"] == budget
        assert records[0]["activations"] == "measured on fake tensors"
        # the launching process learns the choice too
        assert trainer.strategy.layout.degree == expected and trainer.strategy.degree_plan.degree == expected


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_trainer_plans_on_links_it_calibrates_on_its_own_ranks(tmp_path):
    """``links="calibrate"``: the 4 ranks measure their links and compute when the model is set up, every rank
    gets the same figures, and the degree is the fastest that fits on them."""
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree="auto", memory_budget=10**12, links="calibrate",
                                       auto_wrap_policy={Block}, start_method="fork")
    trainer = cpu_trainer(strategy, tmp_path, WORLD, max_steps=1, callbacks=[ChoiceRecorder(tmp_path)])
    trainer.fit(WideModel(), _loader())
    chosen = trainer.strategy.degree_plan
    assert chosen.links.description.startswith(f"calibrated: 1 node(s) x {WORLD} rank(s), cpu (gloo)")
    assert chosen.links.overlap is False and chosen.links.device_flops > 0 and chosen.links.intra_bandwidth > 0
    assert set(chosen.links.engine_costs) == {"fsdp1", "fsdp2"}  # the engines' own work, timed on these cores
    fastest = min(r.step_seconds for r in chosen.rows)
    assert chosen.row(chosen.degree).step_seconds <= fastest * 1.05 and chosen.row(1).compute_seconds > 0
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert {r["degree"] for r in records} == {chosen.degree}


class LongActivations(WideModel):
    """Micro-batches of 512 rows: activations that checkpointing the blocks shrinks several times over."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(512, WIDTH)


class CheckpointRecorder(Callback):
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        wrapped = sum(type(m).__name__ == "CheckpointWrapper" for m in pl_module.modules())
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps({"wrapped": wrapped}))


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_trainer_turns_checkpointing_on_when_nothing_fits_without_it(tmp_path, version):
    with torch.device("meta"):
        model = LongActivations()
    kwargs = {"world_size": WORLD, "devices_per_node": WORLD, "fsdp_version": version, "auto_wrap_policy": {Block},
              "example_input": model.example_input_array, "optimizer": "adam"}
    plain = lightning_smp.plan(model, budget_bytes=10**15, may_checkpoint=False, **kwargs)
    checkpointed = lightning_smp.plan(model, budget_bytes=10**15, checkpoint={Block}, **kwargs)
    budget = math.ceil(checkpointed.row(4).peak_bytes * 1.1)
    assert min(r.peak_bytes for r in plain.rows) * 1.1 > budget  # nothing fits without checkpointing
    with pytest.raises(HybridShardConfigError, match="no hybrid_shard_degree fits"):
        lightning_smp.plan(model, budget_bytes=budget, may_checkpoint=False, **kwargs)
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree="auto", memory_budget=budget, fsdp_version=version,
                                       auto_wrap_policy={Block}, start_method="fork")
    trainer = cpu_trainer(strategy, tmp_path, WORLD, max_steps=1, callbacks=[CheckpointRecorder(tmp_path)])
    trainer.fit(LongActivations(), _loader())
    chosen = trainer.strategy.degree_plan
    assert chosen.degree == 4 and chosen.activation_checkpointing == (f"{Block.__module__}.Block",)
    assert chosen.reason.startswith(f"nothing fits without activation checkpointing: turned on for {Block.__module__}")
    assert chosen.row(4).activation_bytes < plain.row(4).activation_bytes and chosen.row(4).fits
    # every rank trained with the blocks checkpointed, as planned
    assert [json.loads((tmp_path / f"rank{r}.json").read_text())["wrapped"] for r in range(WORLD)] == [BLOCKS] * WORLD


def _fabric_auto(fabric: L.Fabric) -> dict[str, Any]:
    model = fabric.setup_module(WideModel())
    strategy = fabric.strategy
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
    loss = model(torch.randn(2, WIDTH, device=fabric.device)).pow(2).mean()
    fabric.backward(loss)
    optimizer.step()
    chosen = strategy.degree_plan
    return {"degree": strategy.layout.degree, "plan": chosen.degree, "optimizer": chosen.optimizer,
            "links": chosen.links.description, "fastest": min(r.step_seconds for r in chosen.rows),
            "step": chosen.row(chosen.degree).step_seconds}


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_fabric_chooses_from_the_module_it_sets_up():
    from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy

    budget, expected = _thresholds(1)[3]  # just fits degree 4, not 2
    strategy = FabricStrategy(hybrid_shard_degree="auto", memory_budget=budget, auto_wrap_policy={Block},
                              start_method="fork")
    result = L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD).launch(_fabric_auto)
    # Fabric's fork launcher returns rank 0's result; the optimizer is read from the module's configure_optimizers
    assert {k: result[k] for k in ("degree", "plan", "optimizer")} == {"degree": expected, "plan": expected,
                                                                       "optimizer": "adam"}


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_fabric_plans_on_links_it_calibrates_on_its_own_ranks():
    """``links="calibrate"`` under Fabric: measured when the module is set up, and the fastest degree on them."""
    from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy

    strategy = FabricStrategy(hybrid_shard_degree="auto", memory_budget=10**12, links="calibrate",
                              auto_wrap_policy={Block}, start_method="fork")
    result = L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD).launch(_fabric_auto)
    assert result["links"].startswith(f"calibrated: 1 node(s) x {WORLD} rank(s), cpu (gloo)")
    assert result["degree"] == result["plan"] and result["step"] <= result["fastest"] * 1.05


def _plain_fsdp_auto(rank: int, world_size: int, budget: int) -> int:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    lightning_smp.init({"hybrid_shard_degree": "auto", "memory_budget": budget})
    try:
        torch.manual_seed(rank)
        model = FSDP(WideModel(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)
        return len(dist.get_process_group_ranks(model.process_group))
    finally:
        lightning_smp.shutdown()


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_plain_fsdp_call_under_init_chooses_from_the_outermost_module():
    budget, expected = _thresholds(1, traced=False)[1]  # just too little for degree 1: degree 2
    assert run_distributed(_plain_fsdp_auto, WORLD, budget) == [expected] * WORLD


# ------------------------------------------------------------------ every configuration source, and bad input


@pytest.fixture
def clean_sources(monkeypatch):
    for name in (ENV_CONFIG, ENV_SAGEMAKER):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    set_cli_config(None)
    lightning_smp.shutdown()


@pytest.mark.parametrize("source", ["argument", "cli", "init", "env_json", "env_file", "sagemaker"])
def test_every_configuration_source_accepts_auto_a_budget_and_async_save(clean_sources, tmp_path, source):
    values = {"hybrid_shard_degree": "auto", "memory_budget": "1.5GB", "async_save": True, "links": "aws-p4d"}
    kwargs: dict[str, Any] = {}
    if source == "argument":
        kwargs = {"hybrid_shard_degree": "AUTO", "memory_budget": "1.5GB", "async_save": True, "links": "aws-p4d"}
    elif source == "cli":
        set_cli_config(values)
    elif source == "init":
        lightning_smp.init(values)
    elif source == "env_json":
        clean_sources.setenv(ENV_CONFIG, json.dumps(values))
    elif source == "env_file":
        (tmp_path / "smp.yaml").write_text("hybrid_shard_degree: auto\nmemory_budget: 1.5GB\nasync_save: true\n"
                                           "links: aws-p4d\n")
        clean_sources.setenv(ENV_CONFIG, str(tmp_path / "smp.yaml"))
    else:
        clean_sources.setenv(ENV_SAGEMAKER, json.dumps(values))
    if source != "argument":  # the argument source is checked through the strategy below
        assert resolve_config(None).hybrid_shard_degree == AUTO
    strategy = cpu_trainer(HybridShardFSDPStrategy(**kwargs), devices=WORLD).strategy
    assert strategy.hybrid_shard_degree == AUTO and strategy.degree_plan is None
    assert strategy.core.config.memory_budget == 1_500_000_000 and strategy.core.config.links == "aws-p4d"
    assert strategy.async_save is True
    with pytest.raises(HybridShardConfigError, match="layout is not known yet: it is chosen by the planner"):
        strategy.layout  # noqa: B018


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"hybrid_shard_degree": "automatic"}, r"hybrid_shard_degree='automatic' \(str\) is not a degree"),
    ({"hybrid_shard_degree": "auto", "memory_budget": "40 potatoes"},
     r"memory_budget='40 potatoes' is not an amount of memory. Fix: .*'40GB'"),
    ({"hybrid_shard_degree": "auto", "memory_budget": 0}, r"memory_budget=0 is not positive"),
    ({"hybrid_shard_degree": "auto", "device_mesh": (2, 2)}, r"'auto' and device_mesh were both given"),
    ({"hybrid_shard_degree": "auto", "links": "h200-nvlink"},
     r"links='h200-nvlink': links='h200-nvlink' is not a link preset or a JSON file.* Or 'calibrate'"),
    ({"hybrid_shard_degree": "auto", "links": 3}, r"links=3 \(int\) is not a link preset, a JSON file or 'calibrate'"),
])
def test_bad_auto_settings_fail_at_construction(kwargs, match):
    with pytest.raises(HybridShardConfigError, match=match):
        HybridShardFSDPStrategy(**kwargs)


def test_a_budget_without_auto_warns_that_it_is_unused(clean_sources):
    with pytest.warns(UserWarning, match=r"memory_budget=1000000000 is used only with hybrid_shard_degree='auto'"):
        cpu_trainer(HybridShardFSDPStrategy(hybrid_shard_degree=2, memory_budget="1GB"), devices=WORLD)


def test_each_unused_planner_option_warns_once(clean_sources):
    """memory_budget and links both set without 'auto': a warning for each (one flag had silenced the second), and
    neither again when the strategy sets up a second time."""
    import warnings

    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, memory_budget="1GB", links="aws-p4d")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy._warn_override_once(None)
        strategy._warn_override_once(None)
    unused = [str(w.message).split(" ")[0] for w in caught if "is used only with" in str(w.message)]
    assert unused == ["memory_budget=1000000000", "links=aws-p4d"]


def _plain_fully_shard_auto(rank: int, world_size: int) -> str:
    from torch.distributed.fsdp import fully_shard

    lightning_smp.init({"hybrid_shard_degree": "auto"})
    try:
        fully_shard(torch.nn.Linear(4, 4))
    except HybridShardConfigError as err:
        return str(err)
    finally:
        lightning_smp.shutdown()
    return "no error"


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_plain_fully_shard_refuses_auto_on_every_rank():
    messages = run_distributed(_plain_fully_shard_auto, 2)
    assert len(set(messages)) == 1 and "cannot be chosen inside a plain fully_shard(...) call" in messages[0]


# ------------------------------------------------------------------ every rank agrees, or every rank fails alike


def _core_choice(rank: int, world_size: int, widths: list[int], broken_rank: int | None) -> str:
    """``core.choose_degree`` on ``world_size`` ranks, each with its own model width: what each rank raised."""
    from lightning_smp.config.options import StrategyOptions
    from lightning_smp.core import HybridShardCore

    options = StrategyOptions.from_arguments(
        {"hybrid_shard_degree": "auto", "fsdp_version": 1, "memory_budget": 200_000}, engine_options={})
    core = HybridShardCore.from_options(options, engine_options={})
    core.configure(1, world_size)
    model = torch.nn.Sequential(torch.nn.Linear(widths[rank], widths[rank]), torch.nn.Linear(widths[rank], 4))
    bad_input = torch.zeros(2, 3) if rank == broken_rank else torch.zeros(2, widths[rank])  # 3 columns cannot pass
    try:
        chosen = core.choose_degree(model, num_nodes=1, devices=world_size, device=torch.device("cpu"),
                                    precision="32-true", example_input=bad_input, optimizer="sgd")
    except HybridShardConfigError as err:
        return str(err)
    return f"chose {chosen.degree}"


def _alone(width: int) -> int:
    """What one rank of :func:`_core_choice` plans for its model, planned here in one process."""
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))
    return lightning_smp.plan(model, world_size=WORLD, devices_per_node=WORLD, budget_bytes=200_000,
                              optimizer="sgd", example_input=torch.zeros(2, width)).degree


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_ranks_that_would_choose_differently_all_fail_alike():
    """Rank 1's model is larger (its degree would differ): no rank builds a mesh, every rank raises the same error."""
    widths = [64, 160, 64, 64]
    expected = [_alone(width) for width in widths]
    assert len(set(expected)) == 2
    messages = run_distributed(_core_choice, WORLD, widths, None)
    assert len(set(messages)) == 1, messages
    assert f"chose different degrees on different ranks ({expected}, by rank)" in messages[0]


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_a_rank_that_cannot_plan_fails_every_rank():
    messages = run_distributed(_core_choice, WORLD, [64] * 4, 2)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("hybrid_shard_degree='auto' could not be planned on rank 2: example_input could not"
                                  " be traced through Sequential")
    assert run_distributed(_core_choice, WORLD, [64] * 4, None) == [f"chose {_alone(64)}"] * WORLD
