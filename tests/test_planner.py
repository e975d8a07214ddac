"""The planner's model-state prediction (lightning_smp.planner) against what each rank really holds, byte for byte,
for both engines, several degrees and models (tied and frozen parameters, wrapped blocks)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_smp import HybridShardConfigError, HybridShardFSDPStrategy, MemorySavingsCallback
from lightning_smp.links import DEFAULT_PRESET
from lightning_smp.planner import model_state, optimizer_state_layout, plan
from tests.helpers import FSDP_VERSIONS, GLOO_TIMEOUT, TinyModel, cpu_trainer, make_loader
from tests.modules import FeatureModel, LoRABlock, token_loader

WORLD = 4
REPO = Path(__file__).resolve().parents[1]


class GPT2Module(L.LightningModule):
    """Hugging Face GPT-2 (tied input and output embeddings), built from a config: a third-party model."""

    def __init__(self) -> None:
        super().__init__()
        from tests.fabric_loops import tiny_gpt2

        self.model = tiny_gpt2()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _gpt2_loader() -> torch.utils.data.DataLoader:
    tokens = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(list(tokens), batch_size=2)


def _gpt2_block() -> set[type]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return {GPT2Block}


MODELS = {
    "tiny_adam": (TinyModel, make_loader, lambda: None, "adam"),
    "features_sgd_momentum": (FeatureModel, token_loader, lambda: {LoRABlock}, "sgd_momentum"),
    "hf_gpt2_adamw": (GPT2Module, _gpt2_loader, _gpt2_block, "adamw"),
}


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("model_key", sorted(MODELS))
@pytest.mark.parametrize("version", FSDP_VERSIONS)
@pytest.mark.parametrize("degree", [1, 2, 4])
def test_predicted_model_state_equals_the_measured_one(tmp_path, model_key, version, degree):
    cls, loader, policy_of, optimizer = MODELS[model_key]
    policy = policy_of()
    with torch.device("meta"):  # planning builds nothing
        planned = model_state(cls(), world_size=WORLD, hybrid_shard_degree=degree, fsdp_version=version,
                              auto_wrap_policy=policy, optimizer=optimizer)
    callback = MemorySavingsCallback(print_table=False, filename=None)
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=version, start_method="fork",
                                       auto_wrap_policy=policy)
    torch.manual_seed(0)
    cpu_trainer(strategy, tmp_path, WORLD, max_steps=1, callbacks=[callback]).fit(cls(), loader())
    measured = callback.reports["first_step"]
    for state, record in zip(planned, measured, strict=True):
        assert (state.params_bytes, state.grads_bytes, state.optimizer_bytes) == (
            record["params_bytes"], record["grads_bytes"], record["optimizer_bytes"]), state.rank
        assert state.total_bytes == record["total_bytes"]
    if degree == 2:  # (an axis spanning the world also carries Lightning's own reductions: compare the hybrid case)
        from lightning_smp.names import REPLICATE_AXIS, SHARD_AXIS


        with torch.device("meta"):
            row = plan(cls(), world_size=WORLD, budget_bytes=10**12, fsdp_version=version,
                       auto_wrap_policy=policy, optimizer=optimizer).row(degree)
        for record in measured:
            assert row.shard_bytes == sum(e["bytes"] for e in record["comm"][SHARD_AXIS].values())
            assert row.replicate_bytes == sum(e["bytes"] for e in record["comm"][REPLICATE_AXIS].values())


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_predicted_traffic_under_mixed_precision_equals_the_counted_one(tmp_path, version):
    """bf16-mixed gathers in bf16 and reduces in fp32 on both engines (DDP's numbers): the planner's bytes on each
    axis are what a real step counts (it had counted a 16-bit reduction, half the reduce-scatter and replica bytes)."""
    from lightning_smp.names import REPLICATE_AXIS, SHARD_AXIS

    callback = MemorySavingsCallback(print_table=False, filename=None)
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=version, start_method="fork")
    torch.manual_seed(0)
    cpu_trainer(strategy, tmp_path, WORLD, max_steps=1, callbacks=[callback], precision="bf16-mixed").fit(
        TinyModel(), make_loader())
    with torch.device("meta"):
        row = plan(TinyModel(), world_size=WORLD, budget_bytes=10**12, fsdp_version=version,
                   precision="bf16-mixed").row(2)
    for record in callback.reports["first_step"]:
        assert row.shard_bytes == sum(e["bytes"] for e in record["comm"][SHARD_AXIS].values())
        assert row.replicate_bytes == sum(e["bytes"] for e in record["comm"][REPLICATE_AXIS].values())


def test_optimizer_state_layouts():
    net = torch.nn.Linear(2, 2)
    assert optimizer_state_layout(torch.optim.AdamW(net.parameters())) == (2, 4)
    assert optimizer_state_layout(torch.optim.Adam(net.parameters(), amsgrad=True)) == (3, 4)  # + max_exp_avg_sq
    assert optimizer_state_layout(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)) == (1, 0)
    assert optimizer_state_layout(torch.optim.SGD(net.parameters(), lr=0.1)) == (0, 0)
    with pytest.raises(HybridShardConfigError, match="optimizer='lion' is not one the planner knows"):
        optimizer_state_layout("lion")


def test_the_fastest_fitting_degree_is_recommended_on_both_sides_of_each_threshold():
    """In one node every degree's traffic takes the same link: degree 1 (the DDP engine: the same bytes as degree 2,
    in one bucket instead of one all-reduce per unit) is fastest, and from there the larger the group the more it
    sends. So the degree a budget just fits is the one chosen; a byte less and it no longer fits."""
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)])
    full = plan(model, world_size=8, budget_bytes=10**12, auto_wrap_policy={torch.nn.Linear})
    peaks = {r.degree: r.peak_bytes for r in full.rows}
    assert list(peaks) == [1, 2, 4, 8] and peaks[1] > peaks[2] > peaks[4] > peaks[8]
    steps = {r.degree: r.step_seconds for r in full.rows}
    assert steps[1] < steps[2] < steps[4] < steps[8]
    for degree in (1, 2, 4, 8):
        # a budget just large enough for this degree (with 10% headroom) picks it; a byte less picks the next
        budget = math.ceil(peaks[degree] * 1.1)
        chosen = plan(model, world_size=8, budget_bytes=budget, auto_wrap_policy={torch.nn.Linear})
        assert chosen.degree == degree and chosen.reason.startswith(f"degree {degree} has the least predicted step")
        if degree < 8:
            below = plan(model, world_size=8, budget_bytes=budget - 2, auto_wrap_policy={torch.nn.Linear})
            assert below.degree > degree
    with pytest.raises(HybridShardConfigError, match="no hybrid_shard_degree fits memory_budget=1000 bytes"):
        plan(model, world_size=8, budget_bytes=1000)


def test_accumulation_costs_in_the_plan():
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    kwargs = {"world_size": 4, "budget_bytes": 10**12, "auto_wrap_policy": {torch.nn.Linear}}

    def rows(version: int, micro_batches: int) -> dict[int, Any]:
        return {r.degree: r for r in plan(model, fsdp_version=version, micro_batches=micro_batches, **kwargs).rows}

    full = sum(p.numel() * 4 for p in model.parameters())
    fsdp1, fsdp2 = rows(1, 4), rows(2, 4)
    # on top of one micro-batch's transients: FSDP1 no_sync holds the unsharded gradient, FSDP2 a 1/degree buffer
    for degree in (2, 4):
        assert fsdp1[degree].transient_bytes - rows(1, 1)[degree].transient_bytes == full
        assert fsdp2[degree].transient_bytes - rows(2, 1)[degree].transient_bytes == full // degree
    # without sharding there is nothing to accumulate apart
    assert fsdp1[1].transient_bytes == rows(1, 1)[1].transient_bytes
    # both cross the replicas once per optimizer step
    assert fsdp1[2].replicate_bytes == fsdp2[2].replicate_bytes > 0


def test_gathered_units_at_the_peak_per_engine():
    """The unsharded parameters at the end of forward (what benchmarks/planner_peak.py measures): FSDP1 the root and
    the unit computing, FSDP2 the root and three times the unit (its buffer, its copy, the next unit's prefetched
    buffer), ZeRO-2 every unit; nothing at degree 1 (the DDP engine)."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(64, 128, bias=False)  # the root's own parameters
            self.blocks = torch.nn.Sequential(*[torch.nn.Linear(128, 128, bias=False) for _ in range(3)])

    with torch.device("meta"):
        model = Net()
    root, block = 64 * 128 * 4, 128 * 128 * 4
    kwargs = {"world_size": 4, "budget_bytes": 10**12, "auto_wrap_policy": {torch.nn.Sequential}}

    def transient(version: int, degree: int, strategy: str = "HYBRID_SHARD") -> int:
        return plan(model, fsdp_version=version, sharding_strategy=strategy, **kwargs).row(degree).transient_bytes

    blocks = 3 * block  # the Sequential: one unit under this policy; the head stays with the root
    assert transient(1, 2) == root + blocks and transient(2, 4) == root + 3 * blocks
    assert transient(1, 2, "_HYBRID_SHARD_ZERO2") == root + blocks  # every unit
    assert transient(2, 2, "_HYBRID_SHARD_ZERO2") == root + blocks + 2 * blocks
    assert transient(1, 1) == transient(2, 1) == 0  # degree 1 runs on the DDP engine: nothing is gathered
    kwargs["auto_wrap_policy"] = {torch.nn.Linear}  # every Linear its own unit, the head too: the root holds none
    assert transient(1, 2) == block and transient(2, 2) == 3 * block
    kwargs["auto_wrap_policy"] = None  # one unit, the root
    assert transient(1, 2) == transient(2, 2) == root + blocks


# ---------------------------------------------------------------------------------------------- activations, budgets


def test_activations_traced_on_fake_tensors_equal_the_real_ones():
    """The fake trace of a meta-device copy sees the same activation peak as the same tracker on a real forward and
    backward; parameter gradients on their way to ``.grad`` are left out (the planner counts them with the unit)."""
    from lightning_smp.planner import measure_activations
    from lightning_smp.planner.activations import ActivationTracker

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                                   torch.nn.Linear(64, 4096))

    torch.manual_seed(0)
    real, batch = build(), torch.randn(8, 64)
    with torch.device("meta"):
        meta = build()
    tracker = ActivationTracker()
    tracker.track_external(real)
    with tracker:
        real(batch).float().sum().backward()
    assert measure_activations(meta, batch) == measure_activations(real, batch) == tracker.peak() > 0
    assert all(p.grad is None for p in meta.parameters())  # the model itself is untouched
    # with the gradients in flight the trace would peak higher: the head's weight gradient (64 x 4096 floats) is a
    # temporary when the backward starts, while the forward's tensors are still alive
    assert tracker.peak() < max(tracker.timeline) <= tracker.peak() + sum(p.numel() * 4 for p in real.parameters())
    assert len(tracker.gradient_windows) == len(list(real.parameters()))
    # the forward's own tensors: inputs saved for backward and the outputs (8 rows each)
    assert tracker.peak() >= 8 * (256 + 256 + 64 + 4096) * 4


@pytest.mark.parametrize("collector", ["enabled", "disabled", "eager"])
def test_a_checkpointed_trace_equals_the_real_one_whatever_the_collector_does(collector):
    """Fake tensors live in reference cycles that real ones do not: activation checkpointing's discarded forward
    outputs were freed only when the collector happened to run, so the traced peak depended on the process's history
    (a test's order changed the planner's choice). The trace equals a real run's whether the collector is on, off, or
    runs at every allocation."""
    import gc

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from lightning_smp.planner import measure_activations
    from lightning_smp.planner.activations import ActivationTracker

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    def checkpoint(module: torch.nn.Module) -> None:
        apply_activation_checkpointing(module, check_fn=lambda m: isinstance(m, Block))

    real, batch = torch.nn.Sequential(*[Block() for _ in range(4)]), torch.randn(128, 64)
    checkpoint(real)
    tracker = ActivationTracker()
    tracker.track_external(real)
    with tracker:
        real(batch).float().sum().backward()
    with torch.device("meta"):
        meta = torch.nn.Sequential(*[Block() for _ in range(4)])
    plain = measure_activations(meta, batch)
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    try:
        if collector == "disabled":
            gc.disable()
        elif collector == "eager":
            gc.set_threshold(1)
        traced = [measure_activations(meta, batch, checkpoint=checkpoint) for _ in range(2)]
    finally:
        gc.set_threshold(*threshold)
        if enabled:
            gc.enable()
    assert traced == [tracker.peak(), tracker.peak()]
    assert tracker.peak() < plain  # checkpointing saves what it should

@pytest.mark.parametrize(("text", "expected"), [("40GB", 40 * 10**9), ("400MB", 400 * 10**6), ("1.5GiB", 3 * 2**29),
                                                ("123", 123), (2**30, 2**30), (" 2 tb ", 2 * 10**12)])
def test_budgets_parse(text, expected):
    from lightning_smp.planner import parse_bytes

    assert parse_bytes(text) == expected


def test_the_cpu_default_budget_shares_the_available_ram():
    import psutil

    from lightning_smp.planner import default_budget

    whole = default_budget(torch.device("cpu"), 1)
    assert 0 < default_budget(torch.device("cpu"), 4) <= whole // 4 + psutil.virtual_memory().total // 100


def test_link_presets_time_ring_collectives():
    from lightning_smp.links import LINK_PRESETS
    from lightning_smp.planner.links import collective_seconds, group_spans_nodes

    link = LINK_PRESETS["h100-nvlink-ib400"]
    # one all-reduce of 8 GB over 8 ranks: 2 * 7 ring steps and 2 * 7/8 of the bytes sent per rank
    axis = {"all_reduce": {"count": 1, "ring_bytes": 2 * 7 / 8 * 8e9}}
    assert collective_seconds(axis, 8, link.inter_bandwidth, link.inter_latency) == pytest.approx(
        14 * link.inter_latency + 14e9 / link.inter_bandwidth)
    # 16 ranks on 2 nodes of 8: shard groups of 4 stay inside a node, of 16 span; replicas of degree 8 span
    assert not group_spans_nodes(16, 4, True, 8) and group_spans_nodes(16, 16, True, 8)
    assert group_spans_nodes(16, 8, False, 8) and not group_spans_nodes(8, 2, False, 8)
    # shard groups of 3 on nodes of 4 cross a node boundary
    assert group_spans_nodes(12, 3, True, 4)


def test_the_plan_reports_both_axes_and_their_links():
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    result = plan(model, world_size=16, devices_per_node=8, budget_bytes="1TB", auto_wrap_policy={torch.nn.Linear},
                  links="aws-p4d")
    # across p4d's EFA (6.25 GB/s per GPU, NVLink 300) the node-sized group sends least over the slow link
    assert result.degree == 8 and [r.degree for r in result.rows] == [1, 2, 4, 8, 16]
    assert result.row(8).step_seconds < min(r.step_seconds for r in result.rows if r.degree != 8)
    row = result.row(16)
    assert (row.shard_link, row.replicate_link) == ("inter-node", "-") and row.replicate_bytes == 0
    assert result.row(8).shard_link == "intra-node" and result.row(8).replicate_link == "inter-node"
    assert result.row(8).shard_seconds < row.shard_seconds  # the same bytes, on the faster link


# ---------------------------------------------------------------------------------------------- lightning-smp plan


def _cli(capsys, *argv: str) -> str:
    from lightning_smp.cli import main

    main(["plan", *argv])
    return capsys.readouterr().out


def test_cli_plans_from_a_parameter_count(capsys, tmp_path):
    out = _cli(capsys, "--params", "7B", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq_len", "4096",
               "--nodes", "1", "--devices", "8", "--memory_budget", "40GB", "--preset", "aws-p4d",
               "--precision", "bf16-mixed", "--activation_checkpointing", "true", "--json", str(tmp_path / "p.json"),
               "--plot", str(tmp_path / "p.png"))
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["degree"] == 4 and [r["degree"] for r in data["rows"]] == [1, 2, 4, 8]
    assert "Degree plan: 8 rank(s), 8 per node" in out and f"degree {data['degree']} has the least predicted" in out
    # the step's compute: one micro-batch of 4096 tokens, 2 FLOPs per parameter and token and 4 s h per layer (the
    # attention) forward, twice that backward and the forward again (checkpointing), at 40% of an A100's BF16 peak
    forward = 4096 * (2 * 7e9 + 4 * 32 * 4096 * 4096)
    assert data["rows"][2]["compute_seconds"] == pytest.approx(4 * forward / (0.4 * 312e12), rel=0.01)
    # a 7B model's parameters: within 1% of the count asked for
    params = data["rows"][0]["model_state_bytes"] / 16  # fp32 parameters, gradients and two Adam moments
    assert abs(params - 7e9) / 7e9 < 0.01
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_cli_plans_from_a_lightning_cli_config(capsys, tmp_path):
    from lightning_smp.demo import TinyGPT

    config = REPO / "examples" / "configs" / "hybrid_cpu.yaml"
    out = _cli(capsys, "--config", str(config), "--memory_budget", "3MB", "--wrap", "[lightning_smp.demo.Block]",
               "--json", str(tmp_path / "p.json"))
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["world_size"] == 4 and data["optimizer"] == "adamw" and data["budget_bytes"] == 3_000_000
    with torch.device("meta"):
        expected = plan(TinyGPT(dim=64, layers=2), world_size=4, budget_bytes="3MB",
                        auto_wrap_policy={__import__("lightning_smp.demo", fromlist=["Block"]).Block})
    assert data["degree"] == expected.degree and "Degree plan: 4 rank(s)" in out
    assert [r["peak_bytes"] for r in data["rows"]] == [r.peak_bytes for r in expected.rows]


def test_cli_plans_replica_sync_from_the_config(capsys, tmp_path):
    """`lightning-smp plan --config examples/configs/replica_sync.yaml` plans with its smp section's replica_sync."""
    from lightning_smp.demo import Block, TinyGPT

    out = _cli(capsys, "--config", str(REPO / "examples" / "configs" / "replica_sync.yaml"), "--memory_budget", "50MB",
               "--json", str(tmp_path / "p.json"))
    data = json.loads((tmp_path / "p.json").read_text())
    with torch.device("meta"):
        expected = plan(TinyGPT(dim=64, layers=2), world_size=4, budget_bytes="50MB", fsdp_version=2,
                        auto_wrap_policy={Block}, replica_sync={"every": 4})
    assert [r["degree"] for r in data["rows"]] == [1, 2]  # both leave two groups or more
    assert [r["outer_bytes"] for r in data["rows"]] == [r.outer_bytes for r in expected.rows] and all(
        r["outer_bytes"] > 0 for r in data["rows"])
    assert " outer" in out


def test_cli_plans_with_the_smp_keys_of_its_command_line():
    """`lightning-smp plan` plans with what --smp.KEY gives (the keys it reads: memory_budget, fsdp_version, links,
    replica_sync), over the config file's section, and the flags of its own (--memory_budget) over both."""
    from lightning_smp.links import LINK_PRESETS
    from lightning_smp.planner.cli import plan_from_args

    shape = ["--params", "1B", "--layers", "8", "--hidden", "2048", "--heads", "16", "--devices", "4"]
    result, _ = plan_from_args([*shape, "--smp.memory_budget=1.2TB", "--smp.fsdp_version=2", "--smp.links=aws-p4d",
                                "--smp.replica_sync={every: 20}"])
    assert result.budget_bytes == 1_200_000_000_000 and result.fsdp_version == 2
    assert result.links == LINK_PRESETS["aws-p4d"] != LINK_PRESETS[DEFAULT_PRESET]
    assert [r.degree for r in result.rows] == [1, 2] and all(r.outer_bytes > 0 for r in result.rows)
    result, _ = plan_from_args([*shape, "--smp={memory_budget: 1.2TB}", "--memory_budget=2TB"])
    assert result.budget_bytes == 2_000_000_000_000 and [r.degree for r in result.rows] == [1, 2, 4]
    # the config's section, and one key of its replica_sync mapping from the command line
    config = REPO / "examples" / "configs" / "replica_sync.yaml"
    result, _ = plan_from_args(["--config", str(config), "--smp.replica_sync.backup=cpu", "--smp.memory_budget=1GB"])
    assert result.budget_bytes == 1_000_000_000 and [r.degree for r in result.rows] == [1, 2]
    assert all(r.outer_bytes == 0 for r in result.rows)  # backup="cpu": the copies live in host memory


def test_cli_says_when_nothing_fits():
    from lightning_smp.cli import main

    with pytest.raises(SystemExit, match=r"lightning-smp plan: error: no hybrid_shard_degree fits"):
        main(["plan", "--params", "70B", "--layers", "80", "--hidden", "8192", "--heads", "64", "--devices", "8",
              "--memory_budget", "40GB"])
    with pytest.raises(SystemExit, match=r"needs a model"):
        main(["plan", "--devices", "8", "--memory_budget", "40GB"])


def test_the_published_configurations_table_is_what_the_planner_says():
    """docs/planner.md: every command under the table gives the degree its row's "planner" column states."""
    import re
    import shlex

    from lightning_smp.planner.cli import plan_from_args

    page = (REPO / "docs" / "planner.md").read_text()
    section = page[page.index("## Published configurations"):]
    table = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| run")]
    stated = [int(re.match(r"\s*(\d+)", line.split("|")[4]).group(1)) for line in table]
    commands = [line for line in section.splitlines() if line.startswith("lightning-smp plan ")]
    assert len(commands) == len(stated) == 6
    for command, degree, row in zip(commands, stated, table):
        result, _ = plan_from_args(shlex.split(command)[2:])
        assert result.degree == degree, command
        peak = re.search(r"\(([\d.]+) GiB", row.split("|")[4])
        assert peak is None or f"{result.row(degree).peak_bytes / 2**30:.1f}" == peak.group(1), command


def test_activations_follow_checkpointing_and_take_a_meta_input_of_the_shape():
    """A meta tensor of the micro-batch's shape is as good as a real batch; checkpointing the blocks lowers the
    traced activations, and the peak with them."""
    from lightning_smp.demo import Block, TinyGPT

    with torch.device("meta"):
        model = TinyGPT()
    real = torch.randint(0, 64, (8, 32))
    shape_only = torch.empty(8, 32, dtype=torch.long, device="meta")
    kwargs = {"world_size": 4, "budget_bytes": "1GB", "auto_wrap_policy": {Block}}
    plain = plan(model, example_input=shape_only, **kwargs)
    assert plain.row(2).activation_bytes == plan(model, example_input=real, **kwargs).row(2).activation_bytes > 0
    checkpointed = plan(model, example_input=shape_only, checkpoint={Block}, **kwargs)
    assert checkpointed.row(2).activation_bytes < plain.row(2).activation_bytes
    assert plain.row(2).peak_bytes - checkpointed.row(2).peak_bytes == (
        plain.row(2).activation_bytes - checkpointed.row(2).activation_bytes)
    assert plain.activations == "measured on fake tensors"


def test_a_third_party_model_traces_with_keyword_inputs():
    """Hugging Face GPT-2 on the meta device, its micro-batch given as keyword inputs (as Lightning's
    ``example_input_array`` may be a dict): the trace runs its real attention and loss code on fake tensors."""
    from tests.fabric_loops import tiny_gpt2

    with torch.device("meta"):
        model = tiny_gpt2()
    ids = torch.empty(2, 16, dtype=torch.long, device="meta")
    result = plan(model, world_size=WORLD, budget_bytes="1GB", auto_wrap_policy=_gpt2_block(),
                  example_input={"input_ids": ids, "labels": ids})
    assert result.activations == "measured on fake tensors" and result.row(2).activation_bytes > 0
    assert result.optimizer == "adamw"  # a plain module: AdamW assumed


def test_offloaded_and_evaluation_state_and_groups_across_nodes():
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])
    kwargs = {"world_size": 12, "devices_per_node": 4, "auto_wrap_policy": {torch.nn.Linear}}
    full = plan(model, budget_bytes="1TB", **kwargs)
    evaluation = plan(model, budget_bytes="1TB", training=False, **kwargs)
    offloaded = plan(model, budget_bytes="1TB", cpu_offload=True, **kwargs)
    for degree in (1, 2, 3, 4, 6, 12):
        row, ev, off = full.row(degree), evaluation.row(degree), offloaded.row(degree)
        params = max(r.params_bytes for r in model_state(model, world_size=12, hybrid_shard_degree=degree,
                                                           auto_wrap_policy={torch.nn.Linear}))
        assert ev.model_state_bytes == params < row.model_state_bytes / 3.9  # no gradients, no AdamW moments
        assert off.peak_bytes == row.peak_bytes - row.model_state_bytes  # the state lives in CPU memory
    assert "offloaded to CPU memory" in offloaded.reason
    # a budget only 6 and 12 fit: 12 (all-gathers across nodes, no replicas) or 6 (groups straddling nodes, and an
    # all-reduce across them), whichever the step time says
    budget = math.ceil(full.row(6).peak_bytes * 1.1)
    assert full.row(4).peak_bytes * 1.1 > budget and full.row(12).peak_bytes < full.row(6).peak_bytes
    chosen = plan(model, budget_bytes=budget, **kwargs)
    assert chosen.degree == min((6, 12), key=lambda d: (chosen.row(d).step_seconds, d))
    assert {chosen.row(6).shard_link, chosen.row(12).shard_link} == {"inter-node"}


def test_cli_reads_registered_strategy_names_from_a_config(tmp_path):
    from lightning_smp.planner.cli import plan_from_args

    config = tmp_path / "fit.yaml"
    for name, version, strategy in (("smp_hybrid_fsdp2", 2, "HYBRID_SHARD"),
                                    ("smp_hybrid_zero2", 1, "_HYBRID_SHARD_ZERO2")):
        config.write_text(f"trainer:\n  devices: 4\n  strategy: {name}\nmodel:\n  class_path: lightning_smp.demo.TinyGPT\n")
        result, _ = plan_from_args(["--config", str(config), "--memory_budget", "1GB"])
        assert result.fsdp_version == version and result.row(2).sharding_strategy == strategy, name
    config.write_text("trainer:\n  devices: auto\nmodel:\n  class_path: lightning_smp.demo.TinyGPT\n")
    with pytest.raises(HybridShardConfigError, match=r"trainer.devices='auto' does not say .* Fix: pass --devices N"):
        plan_from_args(["--config", str(config), "--memory_budget", "1GB"])
    with pytest.raises(HybridShardConfigError, match="--activation_checkpointing true needs the modules"):
        plan_from_args(["--config", str(config), "--devices", "4", "--memory_budget", "1GB",
                        "--activation_checkpointing", "true"])


def test_replica_sync_counts_the_outer_copies_and_a_sync_amortised_over_its_window():
    """With ``replica_sync``: only degrees that leave two groups or more; each rank holds two more copies of its part
    of the parameters (the synced copy and the outer momentum; one without momentum); an inner step sends nothing
    across the groups, and a sync's all-reduce of the rank's part counts 1/H of its bytes and time per step."""
    from lightning_smp.engines.textbook import ring_bytes
    from lightning_smp.planner.links import axis_link, collective_seconds

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    common = dict(world_size=16, devices_per_node=8, budget_bytes="1TB", auto_wrap_policy={torch.nn.Linear},
                  links="aws-p4d", fsdp_version=2)
    synchronous = plan(model, **common)
    for every, momentum in ((20, 0.9), (5, 0.0)):
        semi = plan(model, **common, replica_sync={"every": every, "outer_momentum": momentum, "nesterov": False})
        assert [r.degree for r in semi.rows] == [1, 2, 4, 8]  # 16 would leave one group
        for row in semi.rows:
            sync_row = synchronous.row(row.degree)
            part, copies = max_params_bytes(model, row.degree), 2 if momentum else 1
            assert row.model_state_bytes == sync_row.model_state_bytes
            assert row.outer_bytes == copies * part and row.peak_bytes == sync_row.peak_bytes + row.outer_bytes
            assert row.shard_bytes == sync_row.shard_bytes and row.replicate_bytes == int(part / every)
            link = axis_link(semi.links, 16, row.shard, False, 8)[0]
            sync_seconds = collective_seconds(
                {"all_reduce": {"count": 1, "ring_bytes": ring_bytes("all_reduce", part, row.replicas)}},
                row.replicas, *link) / every
            assert row.replicate_seconds == pytest.approx(sync_seconds)
            assert row.step_seconds == pytest.approx(
                sync_row.step_seconds - sync_row.exposed_seconds + row.exposed_seconds)
            assert row.step_seconds <= sync_row.step_seconds
    # backup="cpu": the copies live in host memory, out of the device's peak; the crossing is the same
    host = plan(model, **common, replica_sync={"every": 20, "backup": "cpu"})
    device = plan(model, **common, replica_sync={"every": 20})
    for row, on_device in zip(host.rows, device.rows):
        assert row.outer_bytes == 0 < on_device.outer_bytes
        assert row.peak_bytes == on_device.peak_bytes - on_device.outer_bytes
        assert row.replicate_bytes == on_device.replicate_bytes


def max_params_bytes(model: torch.nn.Module, degree: int) -> int:
    from lightning_smp.planner.state import model_state

    return max(s.params_bytes for s in model_state(model, world_size=16, hybrid_shard_degree=degree, fsdp_version=2,
                                                     auto_wrap_policy={torch.nn.Linear}, optimizer="adamw"))


@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_the_planner_leaves_out_what_the_strategy_refuses_under_replica_sync(version):
    """Under ``replica_sync`` a degree is planned exactly when the Trainer's strategy takes it, on the same engine
    and world; every degree left out carries the strategy's own refusal, word for word (FSDP1's flat parameters,
    naming fsdp_version=2; one replica group). Degree 1 runs DDP's engine under either version."""
    from lightning_smp.config.replica_sync import one_group_refusal
    from lightning_smp.degree import resolve_layout

    sync = {"every": 4}
    with torch.device("meta"):
        result = plan(TinyModel(), world_size=WORLD, budget_bytes="1GB", fsdp_version=version, replica_sync=sync)
    planned, left_out = [r.degree for r in result.rows], dict(result.left_out)
    assert sorted([*planned, *left_out]) == [1, 2, 4]
    assert planned == ([1] if version == 1 else [1, 2])
    if version == 2:
        assert left_out[4] == one_group_refusal(resolve_layout(WORLD, 4))
    for degree in (1, 2, 4):
        strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=version, replica_sync=sync)
        if degree in planned:
            cpu_trainer(strategy, None, WORLD)
            continue
        with pytest.raises(HybridShardConfigError) as refused:
            cpu_trainer(strategy, None, WORLD)
        assert str(refused.value) == left_out[degree]
    if version == 1:  # (the engine's refusal first, as the strategy's)
        assert "fsdp1 engine" in left_out[2] == left_out[4] and left_out[2].endswith("Fix: pass fsdp_version=2.")
    # the reason is said under the table; nothing left to plan is an error naming each refusal
    assert f"degree 4 left out: {left_out[4]}" in result.text()
    with torch.device("meta"), pytest.raises(HybridShardConfigError, match=r"no hybrid_shard_degree of 4 runs"
                                                                           r" replica_sync on 4 rank\(s\): Degree 4:"):
        plan(TinyModel(), world_size=WORLD, budget_bytes="1GB", fsdp_version=version, replica_sync=sync, degrees=[4])


def test_the_no_fit_advice_names_replica_sync_s_host_backup_where_it_fits():
    """When the outer copies on the device are what does not fit, the advice names backup='cpu' with the degree and
    the peak the planner computes for it (planning with backup='cpu' then chooses that degree at that peak); when
    even that would not fit, it is not named."""
    from lightning_smp.accounting.render import fmt_bytes

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    kwargs = dict(world_size=8, fsdp_version=2, auto_wrap_policy={torch.nn.Linear})
    roomy = plan(model, budget_bytes="1TB", replica_sync={"every": 8}, **kwargs)
    on_host = plan(model, budget_bytes="1TB", replica_sync={"every": 8, "backup": "cpu"}, **kwargs)
    least_on_host = min(r.peak_bytes for r in on_host.rows)
    assert least_on_host < min(r.peak_bytes for r in roomy.rows)
    budget = math.ceil(least_on_host * 1.1)  # (10% headroom): only the host backup's least peak fits
    with pytest.raises(HybridShardConfigError, match="no hybrid_shard_degree fits") as refused:
        plan(model, budget_bytes=budget, replica_sync={"every": 8}, **kwargs)
    chosen = plan(model, budget_bytes=budget, replica_sync={"every": 8, "backup": "cpu"}, **kwargs)
    assert (f"replica_sync's backup='cpu' (the outer loop's copies in host memory: degree {chosen.degree} then needs"
            f" {fmt_bytes(chosen.row(chosen.degree).peak_bytes)} per rank, which fits)") in str(refused.value)
    with pytest.raises(HybridShardConfigError) as refused:
        plan(model, budget_bytes=budget - 2 * math.ceil(0.1 * least_on_host), replica_sync={"every": 8}, **kwargs)
    assert "backup" not in str(refused.value) and "CPU offload" in str(refused.value)


def test_the_table_says_replica_sync_is_on_and_what_its_replica_bytes_are():
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    kwargs = dict(world_size=WORLD, budget_bytes="1GB", fsdp_version=2, auto_wrap_policy={torch.nn.Linear})
    semi = plan(model, replica_sync={"every": 20, "fragments": 2}, **kwargs)
    title, (header, _) = semi.title(), semi.table_rows()
    assert title.endswith("replica_sync every 20 steps, 2 fragment(s), delay 0, compress none, outer copies on the"
                          " device")
    assert header[8] == "replica bytes / step (a sync's / every)"
    assert plan(model, replica_sync={"every": 20, "backup": "cpu"}, **kwargs).title().endswith(
        "replica_sync every 20 steps, 1 fragment(s), delay 0, compress none, outer copies in host memory")
    synchronous = plan(model, **kwargs)
    assert "replica_sync" not in synchronous.title() and synchronous.table_rows()[0][8] == "replica bytes"
    assert synchronous.left_out == () and "left out" not in synchronous.text()


def test_the_plan_chooses_every_auto_from_its_link_and_step_and_counts_compressed_bytes():
    from lightning_smp.planner import Links
    from lightning_smp.replica_sync.auto import choose_schedule

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    # two nodes of two ranks, a slow link across, a known device throughput: a step time to hide the sync under
    links = Links(intra_bandwidth=5e8, intra_latency=1e-5, inter_bandwidth=1.25e7, inter_latency=1e-3,
                  device_flops=1e9, overlap=False)
    kwargs = dict(world_size=WORLD, devices_per_node=2, budget_bytes="1GB", fsdp_version=2, degrees=[2],
                  auto_wrap_policy={torch.nn.Linear}, links=links, flops=(2e7, 4e7))
    fixed = plan(model, replica_sync={"every": 20}, **kwargs).row(2)
    auto = plan(model, replica_sync={"every": "auto", "delay": "auto"}, **kwargs)
    row = auto.row(2)
    # the crossing of the fixed plan's sync, its step without the sync's share: what "auto" chose from
    crossing = fixed.replicate_seconds * 20
    step = fixed.step_seconds - fixed.replicate_seconds
    want = choose_schedule(crossing, step, 1, "auto", "auto")
    assert (row.sync_every, row.sync_delay) == (want.every, want.delay) and row.sync_delay > 0
    assert f"replica_sync at degree 2: {want.why} (chosen for every/delay 'auto')" in auto.text()
    int8 = plan(model, replica_sync={"every": 20, "compress": "int8"}, **kwargs).row(2)
    assert int8.replicate_bytes == pytest.approx(fixed.replicate_bytes * (1 + 4 / 256) / 4, rel=1e-3)
    # without the device's throughput nothing is known to hide the crossing under: "auto" is left to the run
    unknown = plan(model, replica_sync={"every": "auto"}, **{**kwargs, "degrees": [1, 2], "flops": None,
                                                             "links": Links(**{**vars(links), "device_flops": 0.0})})
    assert all(row.sync_every == 0 for row in unknown.rows)
    assert "'auto' chooses at run time, from its own measurement" in unknown.text()
