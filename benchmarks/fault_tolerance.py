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
- **a node that vanishes inside the crossing**: ``--trials`` times each, node 1 dies the moment the all-reduce
  across groups is in flight, found by reading its link's byte counter (a wider model, ``--crossing_width``, so that
  the crossing lasts): ``vanish``, the link set down and then every process of node 1 killed (no FIN or RST reaches
  the survivor; the link comes back after ``--mend_after`` seconds), and ``kill``, every process killed with the link
  up (the connections close). Measured: every time from the death to the survivor's next committed step
  (``recovery_in_crossing_s``, each listed; target: the heartbeat timeout + 5 s, against the collective timeout
  it took before); node 1 is started again after each and heals;
- **overhead**: the step time with no failure, fault tolerance against the same configuration without it, runs
  interleaved over ``--rounds`` rounds (target: <= 1.05), and what the start costs (the first step's time from the
  loop's start, fault tolerance's less the plain run's: the step-0 quorum before the first forward and the groups'
  comparison);
- **no failure against DDP**: the groups (forked on this machine, 2 x 2 ranks) against Lightning's DDP on 4 ranks,
  the same loop, seed and data: the largest difference of any weight after ``--parity_steps`` steps, and the parity
  bound of the synchronous tests.

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
    firsts: dict[str, list[float]] = {"ft": [], "plain": []}
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
            firsts[kind].append(records[0]["time"] - records[0]["loop_start"])
        ratios.append(medians["ft"] / medians["plain"])
        print(f"round {round_}: step {medians['ft'] * 1e3:.1f} ms with fault tolerance, {medians['plain'] * 1e3:.1f}"
              f" ms without: {ratios[-1]:.3f}", flush=True)
    return {"overhead_ratio": statistics.median(ratios), "overhead_ratios": ratios, "steps_per_round": args.steps,
            "pooled_ratio": statistics.median(ft_steps) / statistics.median(plain_steps),
            "step_s_ft": statistics.median(ft_steps), "step_s_plain": statistics.median(plain_steps),
            "first_step_s_ft": statistics.median(firsts["ft"]), "first_step_s_plain": statistics.median(firsts["plain"]),
            "start_cost_s": statistics.median(firsts["ft"]) - statistics.median(firsts["plain"])}


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


def _crossing_started(cluster: Any, node: int, threshold: int, timeout: float) -> float:
    """Poll node ``node``'s link counter until it sends ``threshold`` bytes or more between two reads (a crossing: the
    rest of a step sends heartbeats and quorum calls, a few hundred bytes); returns when."""
    deadline = time.monotonic() + timeout
    last = cluster.link_bytes()[node]
    while time.monotonic() < deadline:
        now = cluster.link_bytes()[node]
        if now - last >= threshold:
            return time.time()
        last = now
    raise TimeoutError(f"no crossing seen on node {node}'s link within {timeout} s")


def _crossing_ended(cluster: Any, node: int, timeout: float, quiet: float = 0.05, below: int = 16 * 1024) -> float:
    """After a crossing started: poll node ``node``'s link counter until it sends less than ``below`` bytes in
    ``quiet`` seconds (the crossing's last bytes left: the group votes, its rank 0 reads the lighthouse, the next
    quorum comes; heartbeats and quorum calls are a few hundred bytes); returns when."""
    deadline = time.monotonic() + timeout
    marks = [(time.monotonic(), cluster.link_bytes()[node])]
    while time.monotonic() < deadline:
        time.sleep(0.01)
        marks.append((time.monotonic(), cluster.link_bytes()[node]))
        old = [m for m in marks if m[0] <= marks[-1][0] - quiet]
        if old and marks[-1][1] - old[-1][1] < below:
            return time.time()
    raise TimeoutError(f"node {node}'s crossing did not end within {timeout} s")


def in_crossing(args: argparse.Namespace, work: Path, how: str) -> list[dict[str, Any]]:
    """``args.trials`` deaths of node 1 inside the crossing (``how``: ``vanish`` or ``kill``), each followed by a
    restart and a heal; every recovery time."""
    from lightning_smp.testing.cluster import Cluster, LinkShape

    trials = []
    width = ["--width", str(args.crossing_width), "--pause", str(args.pause)]
    # (the gradients' bytes one rank of node 1 sends in a crossing: half of them, 2 groups)
    threshold = 64 * 1024
    with Cluster(2, LinkShape(rate=args.rate)) as cluster, _ft_run(cluster, work / f"crossing_{how}", args) as jobs:
        for group in (0, 1):
            jobs.start(group, "--steps", "100000", *width)
        seen = 0
        for trial in range(args.trials):
            jobs.wait_for(lambda seen=seen: len(jobs.records(1)) >= seen + 3, args.timeout, "node 1 committing steps")
            begun = _crossing_started(cluster, 1, threshold, args.timeout)
            if how == "vanish":
                cluster.cut("down")  # (both ends: whatever node 1 sends from now on never arrives)
            cluster.kill_node(1)
            died = time.time()
            jobs.kill(1)
            jobs.wait_for(lambda died=died: any(r["time"] > died for r in jobs.records(0)), args.timeout,
                          "the survivor's next committed step")
            recovery = min(r["time"] for r in jobs.records(0) if r["time"] > died) - died
            seen = len(jobs.records(1))
            trials.append({"recovery_s": recovery, "in_crossing_for_s": died - begun,
                           "after_step": jobs.records(1)[-1]["step"]})
            print(f"{how} inside the crossing, trial {trial}: next committed step after {recovery:.2f} s", flush=True)
            if how == "vanish":
                time.sleep(args.mend_after)
                cluster.mend()
            jobs.start(1, "--steps", "100000", *width)
    return trials


#: the partition sweep's cuts, as multiples of the heartbeat timeout: from just under it to well over it
CUT_FACTORS = (0.9, 1.1, 1.3, 1.5, 2.5)
#: where a cut lands, and the cut lengths swept there: as a crossing starts (every factor); as it ends (the vote,
#: the commit fence, the next quorum); as the cut group heals, after a first cut that lasted until the survivor went
#: on alone (the quorum that takes the cut group back formed, its transfer from the survivor begun)
LANDINGS = {"crossing": CUT_FACTORS, "after_crossing": (0.9, 1.5, 2.5), "heal": (1.1, 2.5)}


def _heal_marks(out: Path) -> list[dict[str, Any]]:
    """The heals node 1's group has begun (its rank 0's lines in ``heals1.jsonl``, written by the script)."""
    path = out / "heals1.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _heals(out: Path) -> int:
    return len(_heal_marks(out))


def _survivor_waits(times: list[float], cut: float, mended: float, healed: float | None) -> tuple[float, float]:
    """The survivor's longest wait between two recorded steps (``times``) around a cut from ``cut`` to ``mended``,
    and, apart from it, what its step in which the cut group's heal began after the link came back (``healed``, its
    last heal: the one that brought it back) waited from that moment on, 0 if none. From then on the step waits for
    the heal's transfer (torchft's live recovery, as after any restart: the state's size over the link), not for the
    partition; until then, what it waited counts as the partition's. Set apart only where the survivor recorded a
    step between the cut and that heal (the partition's own wait is another gap)."""
    gaps = list(zip(times, times[1:]))
    if healed is None or healed < mended or not any(cut < t < healed for t in times):
        return max(b - a for a, b in gaps), 0.0
    waits = [healed - a if a <= healed < b else b - a for a, b in gaps]
    return max(waits), max((b - healed for a, b in gaps if a <= healed < b), default=0.0)


def _together(jobs: Any, since: float, key: str) -> bool:
    """Both groups committed a step after ``since`` with both groups in it (``steps``), or both recorded a step after it
    holding the same outer state at the same iteration (``syncs``)."""
    if key == "model":
        return all(any(r["time"] > since and r["groups"] == 2 for r in jobs.records(g)) for g in (0, 1))
    late = [{r["iteration"]: r["outer"] for r in jobs.records(g) if r["time"] > since} for g in (0, 1)]
    return any(late[0][i] == late[1][i] for i in set(late[0]) & set(late[1]))


def _splits(jobs: Any, key: str, by: tuple[str, ...], since: float) -> list[int]:
    """The steps (the first of ``by``, the fields that identify one) that both groups recorded after ``since`` (once
    they had first met: with ``min_groups=1`` a group that starts first trains alone, and the other joins it) with
    different ``key`` digests, on any rank: one step, two states. A group's records of a step it recorded twice (after
    a heal took it back) count with the last."""
    split: set[int] = set()
    for rank in range(DEGREE):
        ours, theirs = ({tuple(r[f] for f in by): r[key] for r in jobs.records(g, rank) if r["time"] > since}
                        for g in (0, 1))
        split |= {step[0] for step in set(ours) & set(theirs) if ours[step] != theirs[step]}
    return sorted(split)


def partitions(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Link cuts of :data:`CUT_FACTORS` times the heartbeat timeout, each timed to land inside a crossing (found by
    node 1's link counter: a step's gradients, or a sync's pseudo-gradients under ``replica_sync``), ``args.
    partition_rounds`` rounds; the link comes back after each, and the groups meet again. Per cut: how far into the
    crossing it landed, the survivor's longest wait between two recorded steps around it, and the cut group's heals;
    per mode, the steps both groups recorded with different states (split steps: plain fault tolerance's model
    digests, or ``replica_sync``'s outer state at an iteration: a divergent sync)."""
    from lightning_smp.testing.cluster import Cluster, LinkShape

    hb = args.heartbeat_timeout
    rows: list[dict[str, Any]] = []
    totals: dict[str, Any] = {}
    for mode in ("steps", "syncs"):
        every = args.partition_every if mode == "syncs" else 1
        # (a step: torchft's committed steps; a sync: the inner iteration and the syncs committed, at which two groups
        # must hold the same outer state. Not the iteration alone: a group whose sync was refused while the survivor
        # committed it alone trains its next window from the last synced state, one sync behind, until it heals)
        key, by = ("model", ("step",)) if mode == "steps" else ("outer", ("iteration", "syncs"))
        extra = ["--width", str(args.crossing_width), "--pause", str(args.pause),
                 *(["--every", str(every)] if mode == "syncs" else [])]
        out = work / f"partition_{mode}"
        with Cluster(2, LinkShape(rate=args.rate)) as cluster, _ft_run(cluster, out, args) as jobs:
            for group in (0, 1):
                jobs.start(group, "--steps", "100000", *extra)
            since = 0.0
            jobs.wait_for(lambda key=key: _together(jobs, 0.0, key), args.timeout, "the groups meeting")
            met = time.time()
            for round_, landing, factor in ((r, landing, f) for r in range(args.partition_rounds)
                                            for landing, factors in LANDINGS.items() for f in factors
                                            if landing in args.landings):
                settled = 3 * every + 2  # (steps recorded since: the step time, and the groups apart no more)
                jobs.wait_for(lambda since=since, key=key, settled=settled: _together(jobs, since, key) and sum(
                    r["time"] > since for r in jobs.records(0)) >= settled, args.timeout, "both groups together")
                times = [r["time"] for r in jobs.records(0) if r["time"] > since][-settled:]
                step_s = statistics.median(b - a for a, b in zip(times, times[1:]))
                # (one sync: a whole window, its inner steps and the sync's own crossing, as the survivor took it)
                window_s = statistics.median(b - a for a, b in zip(times, times[every:]))
                first = None
                if landing == "heal":
                    # (a first cut in a crossing that lasts until the survivor has gone on alone, so that the cut
                    # group is behind when it returns; then the second as it begins to heal from the survivor)
                    healed = _heals(out)
                    _crossing_started(cluster, 1, 64 * 1024, args.timeout)
                    first = time.time()
                    cluster.cut("down")
                    time.sleep(1.1 * hb)
                    jobs.wait_for(lambda first=first: any(r["time"] > first and r["groups"] == 1
                                                          for r in jobs.records(0)), args.timeout,
                                  "the survivor going on alone")
                    cluster.mend()
                    jobs.wait_for(lambda healed=healed, out=out: _heals(out) > healed, args.timeout,
                                  "node 1's group healing")
                    begun = time.time()
                else:
                    begun = _crossing_started(cluster, 1, 64 * 1024, args.timeout)
                if landing == "after_crossing":
                    begun = _crossing_ended(cluster, 1, args.timeout)
                cluster.cut("down")
                cut = time.time()
                time.sleep(factor * hb)
                cluster.mend()
                mended = time.time()
                jobs.wait_for(lambda mended=mended, key=key: _together(jobs, mended, key), args.timeout,
                              "the groups meeting again after the cut")
                together = time.time()
                # (from a window before the cut, or before the first cut of two)
                start = (first if first is not None else cut) - 2 * window_s
                survivor = [r["time"] for r in jobs.records(0) if start <= r["time"] <= together]
                begun_heals = [h["time"] for h in _heal_marks(out) if cut <= h["time"] <= together]
                gap, heal_gap = _survivor_waits(survivor, cut, mended, begun_heals[-1] if begun_heals else None)
                # (the heals after the cut: a group's records keep the step of its last heal, an earlier one too)
                earlier = {r["healed_at"] for r in jobs.records(1) if r["time"] <= (first or cut)}
                heals = {r["healed_at"] for r in jobs.records(1)
                         if r["time"] > cut and r["healed_at"] is not None} - earlier
                # (the transfer of the heal that brought node 1's group back, as its rank 0 measured it)
                heal_s = max((r["heal_s"] for r in jobs.records(1) if r["time"] > cut and r.get("heal_s")), default=0.0)
                # (the wait a cut may cost the survivor: the heartbeat, and the step, or the window with the sync,
                # it lands in)
                bound = hb + window_s
                row = {"mode": mode, "landing": landing, "round": round_, "factor": factor, "cut_s": mended - cut,
                       "landed_s": cut - begun, "survivor_gap_s": gap, "bound_s": bound, "within": gap <= bound,
                       "step_s": step_s, "window_s": window_s, "heals": len(heals), "heal_s": heal_s,
                       "heal_gap_s": heal_gap,
                       "rejoined_s": together - mended}
                rows.append(row)
                print(f"partition {mode} {landing} x{factor} (cut {row['cut_s']:.2f} s, {row['landed_s']:.2f} s"
                      f" after the mark): survivor's longest gap {gap:.2f} s (bound {bound:.2f}), {len(heals)} heal(s),"
                      f" together again {row['rejoined_s']:.2f} s after the link came back", flush=True)
                since = together
            split = _splits(jobs, key, by, met)
            totals[mode] = {"split": split, "cuts": sum(r["mode"] == mode for r in rows)}
            print(f"partition {mode}: {len(split)} split step(s) {split}", flush=True)
    return {"rows": rows, "totals": totals, "every": args.partition_every, "factors": list(CUT_FACTORS),
            "landings": {landing: list(factors) for landing, factors in LANDINGS.items() if landing in args.landings}}


def parity(args: argparse.Namespace) -> dict[str, Any]:
    """The groups against DDP with no failure, forked on this machine (2 groups x 2 ranks; DDP on 4)."""
    from lightning_smp.testing import run_distributed
    from lightning_smp.testing.replica_groups import run_replica_groups

    groups = run_replica_groups(_parity_group, 2, DEGREE, args.parity_steps)
    ddp = run_distributed(_parity_ddp, 2 * DEGREE, args.parity_steps)[0]
    ours = groups[0][0]
    difference = max(abs(a - b) for key in ddp for a, b in zip(ours[key], ddp[key]))
    # the synchronous tests' bound (tests/helpers.parity_bound): steps x lr x (world - 1) x u x elements
    elements = sum(len(values) for values in ddp.values())
    bound = args.parity_steps * 1e-2 * (2 * DEGREE - 1) * 2.0 ** -24 * elements
    return {"max_abs_difference": difference, "parity_bound": bound, "steps": args.parity_steps,
            "groups_bit_equal": groups[0][0] == groups[1][0]}


def _parity_loop(fabric: Any, steps: int) -> dict[str, list[float]]:
    import torch

    torch.manual_seed(1234)
    model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    part = fabric.strategy.distributed_sampler_kwargs  # (each rank its part: the groups' as DDP's)
    for step in range(steps):
        batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + part["rank"]))
        fabric.backward(model(batch).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    strategy = fabric.strategy
    state = strategy.full_state_dict(model) if hasattr(strategy, "full_state_dict") else model.state_dict()
    return {key: value.reshape(-1).tolist() for key, value in state.items()}


def _parity_group(group: int, rank: int, degree: int, lighthouse: str, steps: int) -> dict[str, list[float]]:
    import lightning as L

    from lightning_smp.fabric import HybridShardFSDPStrategy

    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=2, fault_tolerance={
        "lighthouse": lighthouse, "group": group, "groups": 2, "min_groups": 2})
    fabric = L.Fabric(accelerator="cpu", devices=degree, strategy=strategy)
    fabric.launch()
    return _parity_loop(fabric, steps)


def _parity_ddp(rank: int, world_size: int, steps: int) -> dict[str, list[float]]:
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy

    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=DDPStrategy())
    fabric.launch()
    return _parity_loop(fabric, steps)


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
    par = result["parity"]
    crossing = result.get("crossing_settings") or {"width": settings["crossing_width"], "trials": settings["trials"]}
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
        ("a node that vanishes inside the crossing (link down, then killed): to the next committed step",
         ", ".join(f"{t['recovery_s']:.2f}" for t in result["in_crossing"]["vanish"]) + f" s (target <= {hb + 5:g} s)",
         "(the job ends)"),
        ("a node killed inside the crossing: to the next committed step",
         ", ".join(f"{t['recovery_s']:.2f}" for t in result["in_crossing"]["kill"]) + f" s (target <= {hb + 5:g} s)",
         "(the job ends)"),
        ("the start: the first step, from the loop's start", f"{over['first_step_s_ft']:.2f} s",
         f"{over['first_step_s_plain']:.2f} s"),
        ("no failure against DDP: max abs difference", f"{par['max_abs_difference']:.1e} after {par['steps']} steps"
         f" (parity bound {par['parity_bound']:.1e}); groups bit-equal: {par['groups_bit_equal']}", "-"),
    ]
    lines = ["# A node dies: fault-tolerant replica groups against today's behaviour", "",
             f"`make bench-fault`: 2 nodes x {DEGREE} ranks on the cluster harness, link {settings['rate']}, FSDP2 at"
             f" degree 2, a model of width {settings['width']}; heartbeat timeout {hb:g} s, node 1 started again"
             f" {settings['restart_after']:g} s after its kill; today's job checkpoints every"
             f" {settings['checkpoint_every']} steps and its collectives time out after"
             f" {settings['collective_timeout']:g} s. Inside the crossing: a model of width"
             f" {crossing['width']}, {crossing['trials']} trials each; every recovery is listed.", "",
             "| | fault_tolerance= | today |", "|---|---|---|",
             *(f"| {a} | {b} | {c} |" for a, b, c in rows), "",
             f"Overhead with no failure (median of per-round ratios, {len(over['overhead_ratios'])} interleaved"
             f" rounds of {over.get('steps_per_round', settings.get('steps'))} steps):"
             f" **{over['overhead_ratio']:.3f}** (target <= 1.05); rounds: "
             + ", ".join(f"{r:.3f}" for r in over["overhead_ratios"])
             + f"; the medians of all their steps: {over['step_s_ft'] * 1e3:.1f} ms against"
             f" {over['step_s_plain'] * 1e3:.1f} ms, {over['step_s_ft'] / over['step_s_plain']:.3f}.", "",
             "![step timeline](fault_tolerance.png)", ""]
    part = result.get("partitions")
    if part:
        lines += ["## Partitions: the link cut inside a crossing, as it ends, and as the cut group heals", "",
                  "The link between the nodes goes down for a multiple of the heartbeat timeout"
                  f" ({hb:g} s), then comes back; {max(r['round'] for r in part['rows']) + 1} rounds. Where it lands"
                  " (node 1's link counter): `crossing`, as node 1's side of a crossing gets under way; `after_crossing`,"
                  " as its last bytes have left (the vote, the commit fence, the next quorum); `heal`, a second cut"
                  " as the cut group begins to heal from the survivor, after a first cut that lasted until the survivor"
                  " went on alone (the quorum that takes it back formed; found by the group's own mark of a heal). The"
                  " multiples: "
                  + "; ".join(f"{landing} {', '.join(f'{f:g}' for f in factors)}" for landing, factors in
                              (part.get("landings") or {"crossing": part["factors"]}).items()) + ". `steps`: plain fault"
                  f" tolerance; `syncs`: `replica_sync` every {part['every']} steps, the crossings a sync's. The"
                  " survivor's longest wait between two recorded steps (from a window before the first cut to the"
                  " groups meeting again), against the heartbeat plus the step, or the whole window with its sync,"
                  " as the survivor took them just before; set apart, what the survivor's step waited from the moment"
                  " the returning group began the heal that brought it back, after the link came back: that heal's"
                  " transfer (torchft's live recovery, as after any restart: the state's size over the link), shown"
                  " with the transfer as the group's rank 0 measured it.", "",
                  "| mode | landing | cut (x heartbeat) | cut | after the mark | survivor's longest gap (bound) |"
                  " its wait from the heal on (transfer) | heals | together again after |",
                  "|---|---|---|---|---|---|---|---|---|",
                  *(f"| {r['mode']} | {r.get('landing', 'crossing')} | {r['factor']:g} | {r['cut_s']:.2f} s |"
                    f" {r['landed_s']:.2f} s |"
                    f" {r['survivor_gap_s']:.2f} s ({r['bound_s']:.2f}){'' if r['within'] else ' **over**'} |"
                    f" {r.get('heal_gap_s', 0.0):.2f} s ({r.get('heal_s', 0.0):.2f} s) | {r['heals']} |"
                    f" {r['rejoined_s']:.2f} s |" for r in part["rows"]), "",
                  f"Split steps (both groups recorded a step with different states, any rank): "
                  f"**{len(part['totals']['steps']['split'])}** over {part['totals']['steps']['cuts']} cuts"
                  f" (target 0); divergent syncs: **{len(part['totals']['syncs']['split'])}** over"
                  f" {part['totals']['syncs']['cuts']} cuts (target 0).", ""]
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
    parser.add_argument("--trials", type=int, default=3, help="deaths inside the crossing, of each kind")
    parser.add_argument("--crossing_width", type=int, default=65536, help="the model's width for those")
    parser.add_argument("--mend_after", type=float, default=5.0, help="seconds the link stays down after a vanish")
    parser.add_argument("--parity_steps", type=int, default=30)
    parser.add_argument("--partition_rounds", type=int, default=2, help="rounds of the partition sweep")
    parser.add_argument("--partition_every", type=int, default=5, help="replica_sync's every in the partition sweep")
    parser.add_argument("--landings", nargs="+", choices=list(LANDINGS), default=list(LANDINGS),
                        help="where the partition sweep's cuts land (default: everywhere)")
    parser.add_argument("--keep_logs", action="store_true", help="keep every group's logs (printed where)")
    parser.add_argument("--only", choices=["failure", "crossing", "overhead", "parity", "partitions"], default=None,
                        help="one part (the others are kept from the last results)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from lightning_smp.testing.cluster import netadmin_problem

    problem = netadmin_problem()
    if problem:
        print(f"bench-fault needs the cluster harness: {problem}")
        return 1
    work = Path(tempfile.mkdtemp(prefix="bench-fault-"))
    previous = args.out / "fault_tolerance.json"
    result: dict[str, Any] = json.loads(previous.read_text()) if args.only and previous.exists() else {}
    result["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "only"}
    try:
        if args.only in (None, "failure"):
            result["fault_tolerance"] = fault_tolerant_failure(args, work)
            print(f"fault tolerance: recovery {result['fault_tolerance']['recovery_s']:.2f} s, heal"
                  f" {result['fault_tolerance']['heal_s']:.2f} s", flush=True)
            result["baseline"] = baseline_failure(args, work)
            print(f"today: recovery {result['baseline']['recovery_s']:.2f} s, {result['baseline']['steps_lost']}"
                  " steps lost", flush=True)
        if args.only in (None, "crossing"):
            result["in_crossing"] = {how: in_crossing(args, work, how) for how in ("vanish", "kill")}
            result["crossing_settings"] = {"width": args.crossing_width, "trials": args.trials}
        if args.only in (None, "overhead"):
            result["overhead"] = overhead(args, work)
        if args.only in (None, "parity"):
            result["parity"] = parity(args)
        if args.only in (None, "partitions"):
            result["partitions"] = partitions(args, work)
    except BaseException:
        print(f"bench-fault failed; its logs are kept in {work}")
        raise
    if args.keep_logs:
        print(f"bench-fault: its logs are kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    for key in ("recovery_s", "heal_s", "steps_lost", "bit_equal"):
        result[key] = result["fault_tolerance"][key]
    result["overhead_ratio"] = result["overhead"]["overhead_ratio"]
    result["recovery_in_crossing_s"] = {how: [t["recovery_s"] for t in trials]
                                        for how, trials in result["in_crossing"].items()}
    result["start_cost_s"] = result["overhead"]["start_cost_s"]
    result["no_failure_vs_ddp_max_abs_difference"] = result["parity"]["max_abs_difference"]
    part = result["partitions"]
    result["partition_rows"] = part["rows"]
    result["split_steps"] = len(part["totals"]["steps"]["split"])
    result["divergent_syncs"] = len(part["totals"]["syncs"]["split"])
    args.out.mkdir(parents=True, exist_ok=True)
    plot(result, args.out / "fault_tolerance.png")
    (args.out / "fault_tolerance.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "fault_tolerance.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
