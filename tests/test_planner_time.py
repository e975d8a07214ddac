"""The planner's step-time model and its choice: the fastest configuration that fits, by the model's own figures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lightning_smp.engines.textbook import FSDPUnitSpec, fsdp_step_textbook
from lightning_smp.names import FULL_SHARD, HYBRID_SHARD
from lightning_smp.planner import Links, plan
from lightning_smp.planner.choose import TIE
from lightning_smp.planner.links import collective_seconds
from lightning_smp.planner.timing import step_time, transformer_flops
from lightning_smp.testing import run_distributed

INTRA, INTER = (100e9, 5e-6), (1e9, 20e-6)
UNITS = [FSDPUnitSpec(1_000_000) for _ in range(3)] + [FSDPUnitSpec(1_000_000, is_root=True)]


def _figure(**kwargs):
    return fsdp_step_textbook(UNITS, HYBRID_SHARD, shard=4, replicate=2, **kwargs)


def _time(figure, flops: float, overlap: bool = True, k: int = 1, scattered: int = 1, synced: int = 1):
    return step_time(figure, sharding_strategy=HYBRID_SHARD, shard=4, replicas=2, shard_link=INTRA,
                     replicate_link=INTER, units=len(UNITS), micro_batches=k, reduce_scatter_passes=scattered,
                     synced_passes=synced, forward_flops=flops, backward_flops=2 * flops, device_flops=1e12,
                     overlap=overlap)


def test_without_overlap_every_collective_adds_to_the_compute():
    figure = _figure()
    comm = collective_seconds(figure["shard"], 4, *INTRA) + collective_seconds(figure["replicate"], 2, *INTER)
    timed = _time(figure, flops=3e9, overlap=False)
    assert timed.communication == pytest.approx(comm) and timed.exposed == pytest.approx(comm)
    assert timed.compute == pytest.approx(9e9 / 1e12) and timed.seconds == pytest.approx(timed.compute + comm)


def test_with_overlap_only_the_first_gather_and_the_last_reduction_show_behind_long_compute():
    figure = _figure()
    gathers = collective_seconds({"all_gather": figure["shard"]["all_gather"]}, 4, *INTRA)
    reduce = (collective_seconds({"reduce_scatter": figure["shard"]["reduce_scatter"]}, 4, *INTRA)
              + collective_seconds(figure["replicate"], 2, *INTER))
    long = _time(figure, flops=1e12)
    forward_gathers = gathers * 4 / 7  # the root gathers once, the 3 others twice: 4 of 7 in forward
    assert long.exposed == pytest.approx(forward_gathers / 4 + reduce / 4)
    # with no compute to hide behind, everything shows
    none = _time(figure, flops=0.0)
    assert none.exposed == pytest.approx(none.communication) and none.compute == 0


def test_accumulation_reduces_in_the_passes_its_mode_says():
    k = 4
    # FSDP1 no_sync: one reduce-scatter and one all-reduce, in the last micro-batch; all four gather
    figure = _figure(backward_passes=k, synced_passes=1, reduce_scatter_passes=1)
    timed = _time(figure, flops=1e12, k=k, scattered=1, synced=1)
    gathers = collective_seconds({"all_gather": figure["shard"]["all_gather"]}, 4, *INTRA)
    reduce = (collective_seconds({"reduce_scatter": figure["shard"]["reduce_scatter"]}, 4, *INTRA)
              + collective_seconds(figure["replicate"], 2, *INTER))
    assert timed.exposed == pytest.approx(gathers * 4 / 7 / 4 + reduce / 4)  # k first gathers of 1/k each
    assert timed.compute == pytest.approx(k * 3e12 / 1e12)


def test_transformer_flops_are_six_per_parameter_and_token_plus_attention():
    forward, backward = transformer_flops(7_000_000_000, 4096, 32, 4096, 4096)
    assert forward == 4096 * (2 * 7e9 + 4 * 32 * 4096 * 4096) and backward == 2 * forward
    _, recomputed = transformer_flops(7_000_000_000, 4096, 32, 4096, 4096, checkpointing=True)
    assert recomputed == 3 * forward


def _model() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])


def _plan(links: Links, **kwargs):
    return plan(_model(), world_size=16, devices_per_node=8, budget_bytes="1TB", fsdp_version=2,
                auto_wrap_policy={torch.nn.Linear}, links=links, **kwargs)


def test_the_choice_follows_the_link_rates():
    """A slow link across nodes: the node-sized group, whose all-gathers stay inside the node and whose replicas
    all-reduce only 1/8 of the gradient across; a fast one: a smaller group (less traffic in all)."""
    slow = _plan(Links(*INTRA, 0.1e9, 20e-6))
    fast = _plan(Links(*INTRA, *INTRA))
    assert slow.degree == 8 and fast.degree < slow.degree
    for result in (slow, fast):
        fastest = min(r.step_seconds for r in result.rows)
        assert result.row(result.degree).step_seconds <= fastest * (1 + TIE)
        smaller = [r for r in result.rows if r.degree < result.degree]
        assert all(r.step_seconds > fastest * (1 + TIE) for r in smaller)
    # across nodes, per node: degree 1's one ring sends 2 x 15/16 of the gradient; degree 8's eight replica rings
    # (one per rank of the node, sharing the node's network) 8 x (2 x 1/2 x 1/8) = 1 gradient: 1.875 x less by the
    # bytes; degree 1's 30-step rings add latency on top. Degree 8's step also exposes its intra-node traffic.
    one, eight = slow.row(1), slow.row(8)
    assert 1.875 < one.replicate_seconds / eight.replicate_seconds < 2.0
    assert eight.step_seconds == pytest.approx(eight.replicate_seconds + eight.shard_seconds)


def test_the_reason_names_the_choice_its_step_time_and_the_runner_up():
    result = _plan(Links(*INTRA, 0.1e9, 20e-6))
    chosen = result.row(result.degree)
    match = re.match(r"degree 8 has the least predicted step time of the degrees that fit: ([\d.]+) ms \(compute"
                     r" [\d.]+ ms, communication not hidden [\d.]+ ms\); runner-up degree (\d+): ([\d.]+) ms",
                     result.reason)
    assert match, result.reason
    assert float(match.group(1)) == pytest.approx(chosen.step_seconds * 1e3, abs=0.05)
    runner_up = result.row(int(match.group(2)))
    assert float(match.group(3)) == pytest.approx(runner_up.step_seconds * 1e3, abs=0.05)
    assert runner_up.step_seconds == min(r.step_seconds for r in result.rows if r.degree != 8)
    assert "compute not counted" in result.reason  # no FLOPs and no throughput given


def test_near_ties_go_to_the_smaller_degree():
    """Compute long enough to hide nearly every collective: the degrees tie, and the smallest that fits is chosen."""
    result = _plan(Links(*INTRA, *INTER, device_flops=1e9), flops=(1e12, 2e12))
    assert result.degree == 1 and "within 5%: the smaller degree is chosen" in result.reason
    # a budget that only degrees from 4 up fit: 4
    budget = int(result.row(4).peak_bytes * 1.1) + 1
    assert result.row(2).peak_bytes * 1.1 > budget
    limited = plan(_model(), world_size=16, devices_per_node=8, budget_bytes=budget, fsdp_version=2,
                   auto_wrap_policy={torch.nn.Linear}, links=Links(*INTRA, *INTER, device_flops=1e9),
                   flops=(1e12, 2e12))
    assert limited.degree == 4


def test_flops_are_counted_in_the_trace_of_the_example_input():
    result = plan(_model(), world_size=8, budget_bytes="1TB", auto_wrap_policy={torch.nn.Linear},
                  example_input=torch.zeros(4, 1024), links=Links(*INTRA, *INTER, device_flops=1e12))
    forward = 2 * 4 * 1024 * 1024 * 8
    backward = 2 * forward - 2 * 4 * 1024 * 1024  # the first layer's input needs no gradient
    assert result.row(1).compute_seconds == pytest.approx((forward + backward) / 1e12)


def test_a_degree_equal_to_the_world_has_no_replica_traffic_in_its_time():
    result = _plan(Links(*INTRA, *INTER))
    row = result.row(16)
    assert row.replicate_seconds == 0 and row.step_seconds == pytest.approx(row.exposed_seconds)
    assert FULL_SHARD == row.sharding_strategy


def test_the_engines_own_work_adds_to_each_micro_batch_per_unit_and_per_byte():
    """``Links.engine_costs`` (calibrated on CPU): every micro-batch pays, for each unit of the engine that runs the
    degree, its fixed cost and its cost per byte of the unit; degree 1 runs DDP's engine, and another engine's
    figures cost this one nothing."""
    fixed, per_byte, k, flops = 2e-3, 3e-9, 4, (1e9, 2e9)
    unit = 1024 * 1024 * 4 + 1024 * 4  # each of the 8 Linear units: fp32 weight and bias
    base = _plan(Links(*INTRA, *INTER, device_flops=1e12), micro_batches=k, flops=flops)
    costed = _plan(Links(*INTRA, *INTER, device_flops=1e12, engine_costs={"fsdp2": (fixed, per_byte)}),
                   micro_batches=k, flops=flops)
    other = _plan(Links(*INTRA, *INTER, device_flops=1e12, engine_costs={"fsdp1": (fixed, per_byte)}),
                  micro_batches=k, flops=flops)
    for degree in (2, 8, 16):
        row = costed.row(degree)
        assert row.engine_seconds == pytest.approx(k * 8 * (fixed + per_byte * unit))
        assert row.step_seconds == pytest.approx(base.row(degree).step_seconds + row.engine_seconds)
        assert other.row(degree).step_seconds == base.row(degree).step_seconds
    assert costed.row(1).engine_seconds == 0 and costed.row(1).step_seconds == base.row(1).step_seconds
    eight = _plan(Links(*INTRA, *INTER, device_flops=1e12, engine_costs={"fsdp2": (fixed, per_byte)}),
                  micro_batches=k, flops=flops, degrees=[8])
    assert f"the engine's own work {costed.row(8).engine_seconds * 1e3:.1f} ms" in eight.reason


# ---------------------------------------------------------------------------------------------- calibration


def test_an_engines_cost_per_unit_is_the_line_through_its_two_probe_sizes():
    from lightning_smp.planner.engine_costs import PROBE_WIDTHS, fit_unit_cost

    sizes = [w * w * 4 + w * 4 for w in PROBE_WIDTHS]
    assert fit_unit_cost(sizes, [1e-3 + 2e-9 * size for size in sizes]) == pytest.approx((1e-3, 2e-9), rel=1e-9)
    assert fit_unit_cost(sizes, [2e-3, 1e-3]) == (2e-3, 0.0)  # noise: no part below zero
    assert fit_unit_cost(sizes, [0.0, 1e-3])[0] == 0.0


def _difference_of_two_sleeps(rank: int, world_size: int) -> tuple[dict[str, int], float]:
    import time

    from lightning_smp.planner.engine_costs import _timed_difference

    calls = {"base": 0, "other": 0}

    def base() -> None:
        calls["base"] += 1
        time.sleep(0.02)

    def other() -> None:
        calls["other"] += 1
        time.sleep(0.12)

    return calls, _timed_difference(base, other, torch.device("cpu"), seconds=0.2)


@pytest.mark.timeout(60)
def test_the_engines_probe_times_the_difference_in_interleaved_rounds():
    """Each round runs the plain pass and then the wrapped one on every rank; the median difference is kept: the
    wrapped pass's time less the plain one's, not its own."""
    from lightning_smp.planner.engine_costs import PROBE_ROUNDS

    for calls, difference in run_distributed(_difference_of_two_sleeps, 2):
        assert calls == {"base": 1 + PROBE_ROUNDS, "other": 2 + PROBE_ROUNDS}  # warm-ups, one to size the rounds
        assert 0.09 <= difference < 0.12


def test_the_alpha_beta_fit_recovers_a_link():
    from lightning_smp.planner.calibrate import fit_alpha_beta

    bandwidth, latency, ranks = 2e9, 30e-6, 4
    sizes = [1 << 12, 1 << 20, 1 << 22]
    seconds = [2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * s / bandwidth for s in sizes]
    fitted = fit_alpha_beta(sizes, seconds, ranks)
    assert fitted == pytest.approx((bandwidth, latency), rel=1e-9)


def test_links_round_trip_through_json_and_the_cli_reads_them(tmp_path, capsys):
    from lightning_smp.cli import main
    from lightning_smp.errors import HybridShardConfigError
    from lightning_smp.links import links_for
    from lightning_smp.planner import load_links, save_links

    links = Links(*INTRA, 0.1e9, 20e-6, description="measured", device_flops=3e12, overlap=False,
                  engine_costs={"fsdp1": (1e-3, 1e-9), "fsdp2": (2e-3, 3e-9)})
    path = save_links(links, tmp_path / "links.json")
    assert load_links(path) == links == links_for(str(path))
    main(["plan", "--params", "1B", "--layers", "16", "--hidden", "2048", "--heads", "16", "--nodes", "2",
          "--devices", "8", "--memory_budget", "80GB", "--preset", str(path), "--json", str(tmp_path / "plan.json")])
    import json

    assert json.loads((tmp_path / "plan.json").read_text())["links"] == json.loads(path.read_text())
    (tmp_path / "bad.json").write_text('{"intra_bandwidth": 1}')
    with pytest.raises(HybridShardConfigError, match=r"links file .*bad.json.* cannot be read as Links"):
        links_for(str(tmp_path / "bad.json"))
    with pytest.raises(HybridShardConfigError, match="not a link preset or a JSON file"):
        links_for("h200-nvlink")
    (tmp_path / "costs.json").write_text(json.dumps({**json.loads(path.read_text()), "engine_costs": {"fsdp2": 1}}))
    with pytest.raises(HybridShardConfigError, match=r"engine_costs=\{'fsdp2': 1\}\) is not a map of engine name"):
        links_for(str(tmp_path / "costs.json"))


def _runs_of_a_slow_compute(rank: int, world_size: int) -> tuple[int, float]:
    import time

    from lightning_smp.planner.calibrate import _timed_run

    calls = []

    def run() -> None:  # 50 ms, longer than the whole timing asked for
        calls.append(time.perf_counter())
        time.sleep(0.05)

    seconds = _timed_run(run, torch.device("cpu"), seconds=0.01)
    return len(calls), seconds


@pytest.mark.timeout(60)
def test_a_compute_longer_than_the_timing_is_timed_in_rounds():
    """A run longer than ``compute_seconds`` is still timed ROUNDS times, every rank alike, and the median kept (it
    had been timed once)."""
    from lightning_smp.planner.calibrate import ROUNDS

    for calls, seconds in run_distributed(_runs_of_a_slow_compute, 2):
        assert calls == 2 + ROUNDS  # a warm-up, one to size the rounds, then one per round
        assert 0.05 <= seconds < 0.5


def test_calibrate_outside_a_job_says_how_to_run_it(monkeypatch):
    from lightning_smp.cli import main
    from lightning_smp.errors import HybridShardConfigError
    from lightning_smp.planner import calibrate

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match=r"--calibrate true \(or links: calibrate\) measures the links of a running"
                                         r" job: run every rank"):
        main(["plan", "--params", "1B", "--layers", "16", "--hidden", "2048", "--devices", "4", "--calibrate", "true",
              "--memory_budget", "8GB"])
    with pytest.raises(HybridShardConfigError, match="no process group exists"):
        calibrate()
    with pytest.raises(SystemExit, match=r"--calibrate_model true times the model, and there is none"):
        main(["plan", "--params", "1B", "--layers", "16", "--hidden", "2048", "--devices", "4", "--calibrate", "true",
              "--calibrate_model", "true", "--memory_budget", "8GB"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_cli_calibrates_on_every_rank_of_a_torchrun_job(tmp_path):
    """2 ranks on this machine's loopback (one node): measured links and compute (the model's own passes), saved,
    and planned with."""
    import json
    import subprocess
    import sys

    links_file, plan_file = tmp_path / "links.json", tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          "29531", "-m", "lightning_smp", "plan", "--calibrate", "true", "--calibrate_model", "true",
                          "--devices", "2", "--model.class_path", "benchmarks.cluster_run.Stack",
                          "--model.init_args.dim", "256", "--model.init_args.layers", "2", "--model.init_args.batch", "64",
                          "--wrap",
                          "[benchmarks.cluster_run.Block]", "--memory_budget", "4GB", "--save_links", str(links_file),
                          "--json", str(plan_file)],
                         capture_output=True, text=True, timeout=170, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    links = json.loads(links_file.read_text())
    assert links["description"].startswith("calibrated: 1 node(s) x 2 rank(s), cpu (gloo), compute of Stack")
    assert links["intra_bandwidth"] == links["inter_bandwidth"] > 1e6 and links["device_flops"] > 1e8
    assert links["overlap"] is False  # gloo on CPU: collectives and compute share the cores
    # and there each FSDP engine's own work adds to the step: measured for every engine fsdp_version selects
    from lightning_smp.engines import FSDP_ENGINES

    assert set(links["engine_costs"]) == {engine.name for engine in FSDP_ENGINES}
    assert all(fixed >= 0 and per_byte >= 0 and fixed + per_byte * 4_198_400 > 0
               for fixed, per_byte in links["engine_costs"].values())
    result = json.loads(plan_file.read_text())
    assert result["links"] == links and result["rows"][0]["compute_seconds"] > 0
    assert run.stdout.count("least predicted step time") == 1  # rank 0 alone prints


# ---------------------------------------------------------------------------------------------- the checkpointing lever


def test_the_cli_turns_checkpointing_on_only_when_nothing_fits_without_it(capsys):
    from lightning_smp.cli import main

    shape = ["--params", "6.74B", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq_len", "4096",
             "--micro_batch", "4", "--nodes", "1", "--devices", "8", "--preset", "aws-p4d", "--precision", "bf16-mixed"]
    main(["plan", *shape, "--memory_budget", "40GB"])
    out = capsys.readouterr().out
    assert "nothing fits without activation checkpointing: turned on for every layer; degree 4" in " ".join(out.split())
    with pytest.raises(SystemExit, match="no hybrid_shard_degree fits"):
        main(["plan", *shape, "--memory_budget", "40GB", "--activation_checkpointing", "false"])
    main(["plan", *shape, "--memory_budget", "400GB"])  # fits without: left off
    assert "activation checkpointing" not in capsys.readouterr().out


def test_checkpointing_the_units_is_the_planner_lever_for_a_traced_model():
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    with torch.device("meta"):
        model = torch.nn.Sequential(*[Block() for _ in range(4)])
    kwargs = {"world_size": 4, "auto_wrap_policy": {Block}, "example_input": torch.zeros(1024, 256)}
    plain = plan(model, budget_bytes="1TB", **kwargs)
    budget = int(min(r.peak_bytes for r in plain.rows) * 1.05)  # nothing fits with 10% headroom
    with pytest.raises(Exception, match="no hybrid_shard_degree fits"):
        plan(model, budget_bytes=budget, may_checkpoint=False, **kwargs)
    lever = plan(model, budget_bytes=budget, **kwargs)
    assert lever.activation_checkpointing == (f"{Block.__module__}.{Block.__qualname__}",)
    assert lever.row(lever.degree).activation_bytes < plain.row(lever.degree).activation_bytes
    # the recomputation is in the step time: the forward runs twice
    assert lever.row(1).compute_seconds > plain.row(1).compute_seconds
    # a budget too small even checkpointed: the same error
    with pytest.raises(Exception, match="no hybrid_shard_degree fits"):
        plan(model, budget_bytes=int(budget * 0.3), **kwargs)


def test_groups_leaving_a_node_share_its_network_and_gloo_reduce_scatters_by_all_reduce():
    from lightning_smp.planner.links import as_run, crossing_groups, inter_node_bandwidth

    # 2 nodes x 2 ranks: degree 2's replica groups {0, 2} and {1, 3} both leave each node; degree 4's one group
    assert crossing_groups(4, 2, False, 2) == 2 and crossing_groups(4, 4, True, 2) == 1
    assert crossing_groups(4, 2, True, 2) == 0 and crossing_groups(16, 8, False, 8) == 8
    links = Links(*INTRA, 1e9, 20e-6, reduce_scatter_as_all_reduce=True)
    assert inter_node_bandwidth(links, 1, 8) == 8e9 and inter_node_bandwidth(links, 8, 8) == 1e9
    axis = {"all_gather": {"count": 2, "bytes": 8, "ring_bytes": 6.0},
            "reduce_scatter": {"count": 1, "bytes": 4, "ring_bytes": 3.0}}
    assert as_run(axis, links.reduce_scatter_as_all_reduce) == {
        "all_gather": axis["all_gather"], "all_reduce": {"count": 1, "bytes": 4, "ring_bytes": 6.0}}
    assert as_run(axis, Links(*INTRA, *INTER).reduce_scatter_as_all_reduce) is axis  # NCCL reduce-scatters as such
