"""``python -m benchmarks.planner_time``: the planner's predicted step times against measured ones, on two nodes.

For each inter-node rate (100 Mbit/s and 1 Gbit/s by default, and the unthrottled loopback), a two-node cluster
(:mod:`lightning_smp.testing.cluster`, 2 nodes x 2 ranks, gloo) fits every configuration in turn
(:mod:`benchmarks.cluster_run`: degrees 1, 2 and 4, both engines, k = 1 and 4 micro-batches) in interleaved
rounds, each fit after calibrating the cluster in the same job (:func:`lightning_smp.planner.calibrate`: the links
and each rank's compute of the model's own passes, measured, as ``hybrid_shard_degree="auto"`` with
``links="calibrate"`` does at a job's start). The machine's speed drifts over minutes (a virtual machine's cores), so
the rounds interleave the configurations and the planner predicts every one from one description of the cluster,
the median of the rate's calibrations; the table puts the prediction next to the measured median. Targets (issue
21): per rate, the predicted ranking of the configurations equals the measured one, and every prediction is within
25% of the measurement; a miss is reported, never hidden. Writes ``benchmarks/results/planner_time.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: degree:fsdp_version:k of benchmarks.cluster_run's smp configurations
CONFIGS = [f"smp:{d}:{v}:{k}" for k in (1, 4) for v in (1, 2) for d in (1, 2, 4)]
TOLERANCE = 0.25


def measure(rate: str | None, args: argparse.Namespace, out: Path) -> dict[str, dict[str, Any]]:
    """Fit every configuration on a cluster at ``rate``, in ``args.rounds`` interleaved rounds (one launch each, every
    configuration's job calibrating the cluster right before it fits): each configuration's measured steps of every
    round, and every calibration."""
    from lightning_smp.testing.cluster import Cluster, LinkShape

    runs: dict[str, dict[str, Any]] = {c: {"step_times": [], "calibrations": []} for c in CONFIGS}
    with Cluster(2, LinkShape(rate=rate)) as cluster:
        for index in range(args.rounds):
            folder = out / f"round{index}"
            folder.mkdir(parents=True, exist_ok=True)
            procs = cluster.torchrun([str(ROOT / "benchmarks" / "cluster_run.py"), "--configs", ",".join(CONFIGS),
                                      "--dim", str(args.dim), "--layers", str(args.layers), "--batch", str(args.batch),
                                      "--warmup", "1", "--steps", str(args.steps), "--calibrate", "--out",
                                      str(folder)], nproc_per_node=2, env={"PYTHONPATH": str(ROOT)})
            for node, (rc, output) in enumerate(cluster.wait(procs, args.timeout)):
                if rc != 0:
                    raise RuntimeError(f"node {node} failed:\n{output[-4000:]}")
            for config in CONFIGS:
                record = json.loads((folder / f"{config.replace(':', '_')}.json").read_text())
                runs[config]["step_times"] += record["step_times"]
                runs[config]["calibrations"].append(record["links"])
    return runs


def predict(config: str, links: dict[str, Any], args: argparse.Namespace) -> float:
    """The planner's step time of ``config`` (``smp:degree:version:k``) on ``links``, for cluster_run's model."""
    from benchmarks.cluster_run import Block, Stack, step
    from lightning_smp.planner import Links, plan

    _, degree, version, k = config.split(":")
    with torch.device("meta"):
        model = Stack(args.dim, args.layers)
    result = plan(model, world_size=4, devices_per_node=2, budget_bytes="1TB", fsdp_version=int(version),
                  auto_wrap_policy={Block}, optimizer="adamw", micro_batches=int(k),
                  example_input=torch.zeros(args.batch, args.dim), step=step, links=Links(**links),
                  degrees=[int(degree)])
    return result.row(int(degree)).step_seconds


def median_links(calibrations: list[dict[str, Any]]) -> dict[str, Any]:
    """One description from several calibrations of a cluster: the median of each measured figure."""
    merged = dict(calibrations[0])
    for key, value in merged.items():
        if isinstance(value, float):
            merged[key] = statistics.median(c[key] for c in calibrations)
    # each engine's (seconds, seconds per byte) per unit: the median of each part
    merged["engine_costs"] = {name: [statistics.median(c["engine_costs"][name][part] for c in calibrations)
                                     for part in range(2)] for name in merged.get("engine_costs", {})}
    merged["description"] = f"median of {len(calibrations)} calibrations"
    return merged


def summarize(measured: dict[str, dict[str, dict]], args: argparse.Namespace) -> dict[str, Any]:
    rows, checks, links_of_rate = [], [], {}
    for rate, runs in measured.items():
        # one description of the cluster per rate, as a planner choosing among the configurations uses one: the
        # median of the calibrations taken through the rate's rounds (the machine's speed drifts over minutes)
        calibrations = [links for c in CONFIGS for links in runs[c]["calibrations"]]
        links_of_rate[rate] = median_links(calibrations)
        predicted = {c: predict(c, links_of_rate[rate], args) for c in CONFIGS}
        actual = {c: statistics.median(runs[c]["step_times"]) for c in CONFIGS}
        for config in CONFIGS:
            ratio = predicted[config] / actual[config]
            rows.append({"rate": rate, "config": config, "predicted_s": predicted[config], "measured_s": actual[config],
                         "ratio": ratio, "within": abs(ratio - 1) <= TOLERANCE})
        # the ranking: every pair of configurations the measurement orders (each measured step of one faster than
        # each of the other's: the runs' own spread decides, no fixed threshold) is ordered alike by the prediction
        # (a pair the prediction calls equal counts as wrong). Degree 1 runs the same program under both
        # fsdp_version settings: its two rows stay unordered unless the machine's noise orders them.
        steps = {c: runs[c]["step_times"] for c in CONFIGS}
        pairs = [(a, b) for i, a in enumerate(CONFIGS) for b in CONFIGS[i + 1:]
                 if max(steps[a]) < min(steps[b]) or max(steps[b]) < min(steps[a])]
        wrong = [(a, b) for a, b in pairs if (predicted[a] - predicted[b]) * (actual[a] - actual[b]) <= 0]
        checks.append({"name": f"{rate}: predicted ranking equals the measured one (pairs every measured step orders)",
                       "ok": not wrong, "value": f"({len(pairs) - len(wrong)} of {len(pairs)} pairs ordered alike)",
                       "wrong": wrong})
        inside = sum(row["within"] for row in rows if row["rate"] == rate)
        checks.append({"name": f"{rate}: predictions within {TOLERANCE:.0%} of the measured median",
                       "ok": inside == len(CONFIGS), "value": f"({inside} of {len(CONFIGS)} within)"})
        flops = [links["device_flops"] for links in calibrations]
        links_of_rate[rate]["device_flops_range"] = [min(flops), max(flops)]
    return {"rows": rows, "checks": checks, "links": links_of_rate,
            "settings": {"dim": args.dim, "layers": args.layers, "batch": args.batch, "steps": args.steps,
                         "rounds": args.rounds}}


def markdown(summary: dict[str, Any]) -> str:
    lines = ["# Planner: predicted against measured step times (2 nodes x 2 ranks, gloo)", "",
             "| link | configuration (degree:fsdp_version:k) | predicted | measured | predicted / measured |",
             "|---|---|---|---|---|"]
    for row in summary["rows"]:
        lines.append(f"| {row['rate']} | {row['config'][4:]} | {row['predicted_s'] * 1e3:.0f} ms |"
                     f" {row['measured_s'] * 1e3:.0f} ms | {row['ratio']:.2f}{'' if row['within'] else ' (outside)'} |")
    lines += ["", "| check | result |", "|---|---|"]
    for check in summary["checks"]:
        lines.append(f"| {check['name']} | {'met' if check['ok'] else 'missed'} {check.get('value', '')} |")
    lines += ["", "Calibrated links, the median of each rate's calibrations (bytes/s per rank, seconds per ring step,"
              " FLOP/s per rank; the compute's range over the calibrations, one before each configuration's fit):", ""]
    for rate, links in summary["links"].items():
        flops = links["device_flops_range"]
        lines.append(f"- {rate}: inside a node {links['intra_bandwidth']:.3g} B/s, {links['intra_latency']:.2g} s;"
                     f" across {links['inter_bandwidth']:.3g} B/s, {links['inter_latency']:.2g} s;"
                     f" compute {links['device_flops']:.3g} FLOP/s ({min(flops):.3g} to {max(flops):.3g});"
                     f" overlap {links['overlap']}; the engines' own work per unit and micro-batch "
                     + ", ".join(f"{name} {fixed * 1e3:.2f} ms + {per_byte * 1e9:.2f} ns/byte"
                                 for name, (fixed, per_byte) in links.get("engine_costs", {}).items()))
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 5))
    for rate in dict.fromkeys(r["rate"] for r in summary["rows"]):
        rows = [r for r in summary["rows"] if r["rate"] == rate]
        axis.scatter([r["measured_s"] for r in rows], [r["predicted_s"] for r in rows], label=rate)
    top = max(max(r["measured_s"], r["predicted_s"]) for r in summary["rows"]) * 1.1
    axis.plot([0, top], [0, top], "k--", linewidth=0.8)
    axis.set_xlabel("measured step (s)")
    axis.set_ylabel("predicted step (s)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100mbit,1gbit,none", help="inter-node rates; none: unthrottled")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every configuration")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from lightning_smp.testing.cluster import netadmin_problem

    problem = netadmin_problem()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="planner_time_"))  # each run's raw records
    measured = {}
    for rate in args.rates.split(","):
        label = "loopback" if rate == "none" else rate
        measured[label] = measure(None if rate == "none" else rate, args, work / label)
    summary = summarize(measured, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planner_time.json").write_text(json.dumps(summary, indent=1))
    (args.out / "planner_time.md").write_text(markdown(summary))
    plot(summary, args.out / "planner_time.png")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
