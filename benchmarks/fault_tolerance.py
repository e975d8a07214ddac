"""``make bench-fault``: a node dies mid-run, with fault-tolerant replica groups and without.

On the cluster harness (2 nodes x 2 ranks, a real link throttled to ``--rate``, FSDP2 at degree 2), the Fabric loop of
``benchmarks/fault_run.py``:

- **fault tolerance** (``fault_tolerance=``): each node is one replica group (its own ``torchrun`` job), the lighthouse
  runs on node 0. Node 1 is killed (SIGKILL, every process) mid-run and started again ``--restart_after`` seconds
  later. Measured: the time from the kill to the survivor's next committed step (``recovery_s``; target: the
  heartbeat timeout + 5 s), from the restart to the healed group's first committed step (``heal_s``), the committed
  steps lost (target 0), and whether the healed group is bit-equal to the survivor at every step from then on;
- **today's behaviour**: the same loop as one world over both nodes (hybrid sharding, 2 replicas), a checkpoint
  every ``--checkpoint_every`` steps. Killing node 1 ends the job (node 0's ranks fail at their next collective,
  after the strategy's ``timeout``); it is then started again from its last checkpoint. Measured alike: the time
  until a step is committed again, and the steps lost (done since the last checkpoint);
- **overhead**: the step time with no failure, fault tolerance against the same configuration without it, runs
  interleaved over ``--rounds`` rounds (target: <= 1.05).

Writes ``benchmarks/results/fault_tolerance.{md,json,png}``: the step timeline of every group (a plot: step against
wall time) and the figures above side by side.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = [str(ROOT / "benchmarks" / "fault_run.py")]
DEGREE = 2


def _step_times(records: list[dict[str, Any]], warmup: int) -> list[float]:
    """Seconds between consecutive committed steps, after ``warmup`` steps."""
    times = [r["time"] for r in records[warmup:]]
    return [b - a for a, b in zip(times, times[1:])]


def _ft_run(cluster: Any, out: Path, args: argparse.Namespace, min_groups: int = 1) -> Any:
    """Fault-tolerant replica groups, one per node, the lighthouse on node 0; a step commits with ``min_groups``
    groups or more."""
    from lightning_smp.testing.replica_groups import on_cluster

    return on_cluster(cluster, SCRIPT, out, degree=DEGREE, heartbeat_timeout=args.heartbeat_timeout,
                      min_groups=min_groups)


def _plain_job(cluster: Any, out: Path, args: argparse.Namespace, steps: int, *extra: str) -> list[Any]:
    """Today's behaviour: the same loop as one world over both nodes (degree 2: a replica per node), one torchrun
    agent per node; logs in ``out``."""
    from lightning_smp.testing import free_port

    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for node in cluster.nodes:
        log = (out / f"plain_log{node.index}.txt").open("a")
        procs.append(cluster.popen(node.index, [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node.index),
            "--nproc-per-node", str(DEGREE), "--master-addr", cluster.nodes[0].address, "--master-port", str(port),
            *SCRIPT, "--lighthouse", "-", "--group", "0", "--out", str(out), "--no_ft", "--nodes", "2", "--degree",
            str(DEGREE), "--steps", str(steps), "--width", str(args.width), *extra], {"PYTHONPATH": str(ROOT)},
            stdout=log, stderr=log))
    return procs


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def overhead(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Interleaved rounds, each a fault-tolerant run and a plain one (every other round in the other order)."""
    from lightning_smp.testing.cluster import Cluster, LinkShape

    ratios, ft_steps, plain_steps = [], [], []
    for round_ in range(args.rounds):
        order = ["ft", "plain"] if round_ % 2 == 0 else ["plain", "ft"]
        medians: dict[str, float] = {}
        for kind in order:
            out = work / f"overhead{round_}_{kind}"
            with Cluster(2, LinkShape(rate=args.rate)) as cluster:
                if kind == "ft":
                    # (both groups in every step: a step one group takes alone sends nothing across)
                    with _ft_run(cluster, out, args, min_groups=2) as jobs:
                        for group in (0, 1):
                            jobs.start(group, "--steps", str(args.steps), "--width", str(args.width),
                                       "--min_groups", "2")
                        codes = jobs.wait(args.timeout)
                        if codes != {0: 0, 1: 0}:
                            raise RuntimeError(f"fault-tolerant run failed: {codes}\n{jobs.logs()}")
                        records = jobs.records(0)
                    alone = [r["step"] for r in records if r["groups"] != 2]
                    if alone:
                        raise RuntimeError(f"steps {alone} were committed without both groups")
                else:
                    procs = _plain_job(cluster, out, args, args.steps)
                    results = cluster.wait(procs, args.timeout)
                    if any(code != 0 for code, _ in results):
                        raise RuntimeError(f"plain run failed: {[c for c, _ in results]}")
                    records = _records(out / "group0_rank0.jsonl")
            times = _step_times(records, args.warmup)
            medians[kind] = statistics.median(times)
            (ft_steps if kind == "ft" else plain_steps).extend(times)
        ratios.append(medians["ft"] / medians["plain"])
        print(f"round {round_}: step {medians['ft'] * 1e3:.1f} ms with fault tolerance, {medians['plain'] * 1e3:.1f}"
              f" ms without: {ratios[-1]:.3f}", flush=True)
    return {"overhead_ratio": statistics.median(ratios), "overhead_ratios": ratios,
            "step_s_ft": statistics.median(ft_steps), "step_s_plain": statistics.median(plain_steps)}


def fault_tolerant_failure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from lightning_smp.testing.cluster import Cluster, LinkShape

    out = work / "ft_failure"
    with Cluster(2, LinkShape(rate=args.rate)) as cluster, _ft_run(cluster, out, args) as jobs:
        t0 = time.time()
        for group in (0, 1):
            jobs.start(group, "--steps", str(args.failure_steps), "--pause", str(args.pause), "--width",
                       str(args.width))
        jobs.wait_for(lambda: len(jobs.records(1)) >= args.kill_at and len(jobs.records(0)) >= args.kill_at,
                      args.timeout, "the steps before the kill")
        cluster.kill_node(1)
        killed = time.time()
        jobs.kill(1)  # (nothing of it is left; marks it killed on purpose)
        time.sleep(args.restart_after)
        restarted = time.time()
        jobs.start(1, "--steps", str(args.failure_steps), "--pause", str(args.pause), "--width", str(args.width))
        codes = jobs.wait(args.timeout)
        if codes != {0: 0, 1: 0}:
            raise RuntimeError(f"fault-tolerant failure run: {codes}\n{jobs.logs()}")
        survivor = jobs.records(0)
        healed = [r for r in jobs.records(1) if r["time"] > restarted]
        recovery = min(r["time"] for r in survivor if r["time"] > killed) - killed
        heal = min(r["time"] for r in healed) - restarted
        # committed steps lost: the job's last committed step before the kill, less the step it went on from
        before = max(r["step"] for g in (0, 1) for r in jobs.records(g) if r["time"] <= killed)
        lost = before - (min(r["step"] for r in survivor if r["time"] > killed) - 1)
        first = min(r["step"] for r in healed)
        bit_equal = all(
            {r["step"]: (r["model"], r["optimizer"]) for r in jobs.records(0, rank)}[s]
            == {r["step"]: (r["model"], r["optimizer"]) for r in jobs.records(1, rank)}[s]
            for rank in range(DEGREE) for s in range(first, args.failure_steps + 1))
        timeline = {f"group {g}": [(r["time"] - t0, r["step"]) for r in jobs.records(g)] for g in (0, 1)}
    return {"recovery_s": recovery, "heal_s": heal, "steps_lost": lost, "bit_equal": bit_equal,
            "healed_at_step": first, "kill_s": killed - t0, "restart_s": restarted - t0, "timeline": timeline}


def baseline_failure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Today's behaviour: the job ends with the node, and starts again from its last checkpoint."""
    from lightning_smp.testing.cluster import Cluster, LinkShape

    out = work / "baseline"
    checkpoints = work / "baseline_checkpoints"
    record = out / "group0_rank0.jsonl"
    with Cluster(2, LinkShape(rate=args.rate)) as cluster:
        t0 = time.time()
        extra = ["--pause", str(args.pause), "--collective_timeout", str(args.collective_timeout), "--checkpoint",
                 str(checkpoints), "--checkpoint_every", str(args.checkpoint_every)]
        procs = _plain_job(cluster, out, args, args.failure_steps, *extra)
        deadline = time.time() + args.timeout
        while len(_records(record)) < args.kill_at:
            if time.time() > deadline:
                raise TimeoutError("the baseline did not reach the kill")
            time.sleep(0.1)
        at_kill = _records(record)[-1]["step"]
        cluster.kill_node(1)
        killed = time.time()
        cluster.wait([procs[0]], args.collective_timeout + 60)  # node 0's ranks fail at their next collective
        ended = time.time()
        saved = sorted(int(p.name[4:]) for p in checkpoints.iterdir() if p.name.startswith("step"))
        resume = saved[-1] if saved else 0
        time.sleep(args.restart_after)
        restarted = time.time()
        resume_args = ["--resume", str(checkpoints / f"step{resume}")] if resume else []
        procs = _plain_job(cluster, out, args, args.failure_steps, *extra, *resume_args)
        results = cluster.wait(procs, args.timeout)
        if any(code != 0 for code, _ in results):
            raise RuntimeError(f"baseline restart failed: {[c for c, _ in results]}")
        after = [r for r in _records(record) if r["time"] > restarted]
        timeline = {"one job": [(r["time"] - t0, r["step"]) for r in _records(record)]}
    return {"recovery_s": min(r["time"] for r in after) - killed, "job_ended_s": ended - killed,
            "steps_lost": at_kill - resume, "resumed_from_step": resume, "kill_s": killed - t0,
            "restart_s": restarted - t0, "timeline": timeline}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (title, part) in zip(axes, (("fault_tolerance=", result["fault_tolerance"]),
                                        ("today: the job ends, restarts from its checkpoint", result["baseline"]))):
        for name, points in part["timeline"].items():
            ax.plot([t for t, _ in points], [s for _, s in points], ".", markersize=3, label=name)
        for key, style in (("kill_s", "r--"), ("restart_s", "g--")):
            ax.axvline(part[key], color=style[0], linestyle="--", linewidth=1,
                       label="node 1 killed" if key == "kill_s" else "node 1 started again")
        ax.set_title(title)
        ax.set_xlabel("wall time (s)")
        ax.legend(loc="lower right")
    axes[0].set_ylabel("committed step")
    fig.suptitle(f"A node dies: 2 nodes x {DEGREE} ranks, FSDP2 degree 2, {result['settings']['rate']} link")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict[str, Any]) -> str:
    ft, base, over, settings = result["fault_tolerance"], result["baseline"], result["overhead"], result["settings"]
    hb = settings["heartbeat_timeout"]
    rows = [
        ("time from the kill to the next committed step", f"{ft['recovery_s']:.2f} s (target <= {hb + 5:g} s)",
         f"{base['recovery_s']:.2f} s"),
        ("time from the restart to the node's first committed step", f"{ft['heal_s']:.2f} s (healed at step"
         f" {ft['healed_at_step']})", "(the whole job restarted)"),
        ("committed steps lost", f"{ft['steps_lost']} (target 0)",
         f"{base['steps_lost']} (resumed from step {base['resumed_from_step']})"),
        ("healed group bit-equal to the survivor", str(ft["bit_equal"]), "-"),
        ("step time with no failure", f"{over['step_s_ft'] * 1e3:.1f} ms", f"{over['step_s_plain'] * 1e3:.1f} ms"),
    ]
    lines = ["# A node dies: fault-tolerant replica groups against today's behaviour", "",
             f"`make bench-fault`: 2 nodes x {DEGREE} ranks on the cluster harness, link {settings['rate']}, FSDP2 at"
             f" degree 2, a model of width {settings['width']}; heartbeat timeout {hb:g} s, node 1 started again"
             f" {settings['restart_after']:g} s after its kill; today's job checkpoints every"
             f" {settings['checkpoint_every']} steps and its collectives time out after"
             f" {settings['collective_timeout']:g} s.", "",
             "| | fault_tolerance= | today |", "|---|---|---|",
             *(f"| {a} | {b} | {c} |" for a, b, c in rows), "",
             f"Overhead with no failure (median of per-round ratios, {settings['rounds']} interleaved rounds):"
             f" **{over['overhead_ratio']:.3f}** (target <= 1.05); rounds: "
             + ", ".join(f"{r:.3f}" for r in over["overhead_ratios"]) + ".", "",
             "![step timeline](fault_tolerance.png)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=60, help="steps of each overhead run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--failure_steps", type=int, default=120)
    parser.add_argument("--kill_at", type=int, default=25)
    parser.add_argument("--pause", type=float, default=0.2)
    parser.add_argument("--restart_after", type=float, default=10.0)
    parser.add_argument("--heartbeat_timeout", type=float, default=2.0)
    parser.add_argument("--checkpoint_every", type=int, default=10)
    parser.add_argument("--collective_timeout", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from lightning_smp.testing.cluster import netadmin_problem

    problem = netadmin_problem()
    if problem:
        print(f"bench-fault needs the cluster harness: {problem}")
        return 1
    work = Path(tempfile.mkdtemp(prefix="bench-fault-"))
    try:
        result: dict[str, Any] = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
        result["fault_tolerance"] = fault_tolerant_failure(args, work)
        print(f"fault tolerance: recovery {result['fault_tolerance']['recovery_s']:.2f} s, heal"
              f" {result['fault_tolerance']['heal_s']:.2f} s", flush=True)
        result["baseline"] = baseline_failure(args, work)
        print(f"today: recovery {result['baseline']['recovery_s']:.2f} s, {result['baseline']['steps_lost']} steps"
              " lost", flush=True)
        result["overhead"] = overhead(args, work)
    except BaseException:
        print(f"bench-fault failed; its logs are kept in {work}")
        raise
    shutil.rmtree(work, ignore_errors=True)
    for key in ("recovery_s", "heal_s", "steps_lost", "bit_equal"):
        result[key] = result["fault_tolerance"][key]
    result["overhead_ratio"] = result["overhead"]["overhead_ratio"]
    args.out.mkdir(parents=True, exist_ok=True)
    plot(result, args.out / "fault_tolerance.png")
    (args.out / "fault_tolerance.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "fault_tolerance.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
