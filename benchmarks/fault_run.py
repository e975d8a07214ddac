"""One replica group of a fault-tolerant Fabric run (``fault_tolerance``), started by ``torchrun`` with
``hybrid_shard_degree`` ranks: every committed step writes one line per rank to ``--out`` (torchft's step, the wall
time, a digest of this rank's shards and optimizer state, the loop's own counter, what the node sent on its link), so
that ``make bench-fault`` and the tests compare groups step by step; the strategy's ``replica_metrics`` go to a CSV
logger (``--out``/metrics/group<g>). ``--steps``: committed steps to reach; ``--pause``: seconds per step (a slow step,
for kills); ``--vanish_at``: this group vanishes inside the crossing after that committed step (``--vanish stop``: its
processes freeze, as a node that lost power, no connection closed; ``kill``: they die, the connections close), having
written the time to ``--out``/vanished<g>; every heal a group begins goes to ``--out``/heals<g>.jsonl, and
``--freeze_in_heal``, ``--fail_heal_rank`` and ``--slow_serving`` force the races of a heal; ``--no_ft``: the same loop without fault tolerance, one world of ``--nodes``
nodes (the comparison: today's behaviour)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.loggers import CSVLogger

from lightning_smp.fabric import HybridShardFSDPStrategy
from lightning_smp.fault_tolerance.state import optimizer_local_state
from lightning_smp.replicas import local_part
from lightning_smp.testing.crossing import link_tx_bytes


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = optimizer_local_state(optimizer)["state"]
    return [value for _, entry in sorted(state.items()) for _, value in sorted(entry.items())
            if isinstance(value, torch.Tensor)]


class Heads(torch.nn.Module):
    """(``--unused``) the model, with two more heads: one only group 0's rank 0 uses, one that no rank uses (DDP's rule:
    the first gets the average of its gradient everywhere, the second keeps ``.grad`` ``None`` and never moves)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
        self.only_first = torch.nn.Linear(16, 4)
        self.never = torch.nn.Linear(16, 4)

    def forward(self, batch: torch.Tensor, first: bool) -> torch.Tensor:
        out = self.trunk(batch)
        return out + self.only_first(batch) if first else out


def vanish_inside_the_crossing(replicas: Any, after: int, how: str, marker: Path | None,
                               thaw_after: float | None = None) -> None:
    """Make this rank vanish at the first crossing (an all-reduce across groups of floating-point values: gradients,
    or a sync's) after committed step ``after``, while the other groups wait inside it: SIGSTOP (``how="stop"``: every
    thread frozen, the manager server's heartbeats too, no connection closed; with ``thaw_after``, a process that this
    rank started first sends SIGCONT that many seconds later, once, and the rank goes on into the crossing its peers
    may have left: a partition that ends) or SIGKILL itself. Writes the time to ``marker`` first, whole (the group's
    rank 0 alone; the others pass ``None``)."""
    process_group = replicas.process_group
    issue = process_group.allreduce
    done = []

    def allreduce(tensors: list[torch.Tensor], options: Any) -> Any:
        # (floating point: the gradients' or a sync's, not the start's or a meeting's comparison)
        if replicas.step >= after and tensors[0].is_floating_point() and not done:
            done.append(True)
            if marker is not None and not marker.exists():
                written = marker.with_suffix(".writing")
                written.write_text(json.dumps({"time": time.time(), "step": replicas.step, "thaw_after": thaw_after}))
                written.replace(marker)  # (the reader never sees half of it)
            if how == "stop" and thaw_after is not None:
                subprocess.Popen(["sh", "-c", f"sleep {thaw_after}; kill -CONT {os.getpid()}"], start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        return issue(tensors, options)

    process_group.allreduce = allreduce


def watch_heals(replicas: Any, out: Path, group: int, rank: int, *, freeze: float | None = None,
                fail: bool = False, slow_serving: float | None = None) -> None:
    """Each heal this rank begins is written to ``out``/heals<group>.jsonl (its time; the group's rank 0 alone), and
    forced races: ``freeze``, this rank freezes (SIGSTOP, heartbeats too, no connection closed) as its first heal
    begins, for that many seconds (a partition as a group heals); ``fail``, this rank's first heal fails (its transfer
    raises, the group's other ranks receive theirs); ``slow_serving``, this rank's healing server answers its first
    request that many seconds late (a transfer that a partition stalled: TCP's retransmission backoff)."""
    transport = replicas._transport
    receive, begun = transport.recv_checkpoint, []

    def recv_checkpoint(*args: Any, **kwargs: Any) -> Any:
        begun.append(time.time())
        if rank == 0:
            with (out / f"heals{group}.jsonl").open("a") as f:
                f.write(json.dumps({"time": begun[-1], "step": replicas.step}) + "\n")
        if len(begun) == 1 and fail:
            raise RuntimeError("injected: this rank's heal failed")
        if len(begun) == 1 and freeze is not None:
            subprocess.Popen(["sh", "-c", f"sleep {freeze}; kill -CONT {os.getpid()}"], start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return receive(*args, **kwargs)

    transport.recv_checkpoint = recv_checkpoint
    if slow_serving is not None:
        handler, served = transport._server.RequestHandlerClass, []

        class Slow(handler):
            def do_GET(self) -> None:  # noqa: N802  (the base class's name)
                if not served:
                    served.append(True)
                    time.sleep(slow_serving)
                super().do_GET()

        transport._server.RequestHandlerClass = Slow


def refuse_once(replicas: Any, at: int) -> None:
    """Report an error to torchft in committed step ``at``'s vote (after its crossing completed), once: the step is
    refused, as a failed fence would refuse it."""
    commit, done = replicas.commit, []

    def refused() -> bool:
        if replicas.step == at - 1 and not done:
            done.append(True)
            replicas.manager.report_error(RuntimeError("injected: refused after the crossing"))
        return commit()

    replicas.commit = refused


def group_arguments() -> argparse.ArgumentParser:
    """What every replica group's script takes (``lightning_smp.testing.replica_groups`` passes the first four)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--degree", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10, help="committed steps to reach")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--vanish_at", type=int, default=None, help="vanish inside the crossing after this step")
    parser.add_argument("--vanish", choices=["stop", "kill"], default="stop")
    parser.add_argument("--thaw_after", type=float, default=None,
                        help="(--vanish stop) go on this many seconds later: a partition that ends")
    return parser


def main() -> None:
    parser = group_arguments()
    parser.add_argument("--checkpoint", default=None, help="a folder to save to every 3 committed steps")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
    parser.add_argument("--no_ft", action="store_true", help="the same run without fault_tolerance")
    parser.add_argument("--width", type=int, default=32, help="the hidden layer's width")
    parser.add_argument("--quorum_timeout", type=float, default=30.0)
    parser.add_argument("--min_groups", type=int, default=1, help="the fewest groups that may commit a step")
    parser.add_argument("--nodes", type=int, default=1, help="(--no_ft) nodes of the one world")
    parser.add_argument("--collective_timeout", type=float, default=1800.0, help="seconds (the strategy's timeout)")
    parser.add_argument("--checkpoint_every", type=int, default=3)
    parser.add_argument("--async_save", action="store_true", help="checkpoints written in the background")
    parser.add_argument("--unused", action="store_true", help="heads some or all ranks do not use (Heads)")
    parser.add_argument("--every", type=int, default=None,
                        help="replica_sync: the groups sync every this many steps (--steps counts inner steps then)")
    parser.add_argument("--perturb_at", type=int, default=None,
                        help="after this committed step, this group's weights move (its state differs from its peers')")
    parser.add_argument("--refuse_at", type=int, default=None, help="this committed step is refused after its crossing")
    parser.add_argument("--freeze_in_heal", type=float, default=None,
                        help="this group freezes as its first heal begins, for this many seconds")
    parser.add_argument("--fail_heal_rank", type=int, default=None, help="this rank's first heal fails")
    parser.add_argument("--slow_serving", type=float, default=None,
                        help="this group's healing server answers its first request this many seconds late")
    args = parser.parse_args()

    fault_tolerance = None if args.no_ft else {"lighthouse": args.lighthouse, "group": args.group,
                                                "groups": args.groups, "timeout": 10.0,
                                                "quorum_timeout": args.quorum_timeout, "min_groups": args.min_groups}
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=args.degree, fsdp_version=2,
                                       fault_tolerance=fault_tolerance, async_save=args.async_save or None,
                                       replica_sync={"every": args.every} if args.every else None,
                                       timeout=timedelta(seconds=args.collective_timeout))
    fabric = L.Fabric(accelerator="cpu", devices=args.degree, num_nodes=args.nodes, strategy=strategy,
                      loggers=CSVLogger(Path(args.out) / "metrics", name=f"group{args.group}"))
    fabric.launch()
    torch.manual_seed(1234)  # (every group starts alike; replicas start from rank 0's weights anyway)
    module = Heads(args.width) if args.unused else torch.nn.Sequential(
        torch.nn.Linear(16, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 4))
    model = fabric.setup_module(module)
    never = digest([local_part(p) for p in module.never.parameters()]) if args.unused else None
    first = args.group == 0 and fabric.global_rank == 0
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iteration": 0}
    strategy.fault_tolerant_state(state)
    if args.resume:
        fabric.load(args.resume, state)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = out / f"group{args.group}_rank{fabric.global_rank}.jsonl"
    replicas = strategy.replica_groups

    def step() -> int:  # torchft's committed steps (without fault_tolerance or with replica_sync: the loop's own)
        return replicas.step if replicas is not None and not args.every else state["iteration"]

    if args.vanish_at is not None and replicas is not None:
        vanish_inside_the_crossing(replicas, args.vanish_at, args.vanish,
                                   out / f"vanished{args.group}" if fabric.global_rank == 0 else None, args.thaw_after)
    if args.refuse_at is not None and replicas is not None:
        refuse_once(replicas, args.refuse_at)
    if replicas is not None:
        watch_heals(replicas, out, args.group, fabric.global_rank, freeze=args.freeze_in_heal,
                    fail=args.fail_heal_rank == fabric.global_rank, slow_serving=args.slow_serving)
    loop_start = time.time()  # (the first step's time after it: what the start costs)

    while step() < args.steps:
        for micro in range(args.accumulate):
            # this group's data for this step: the same wherever and whenever the step runs
            generator = torch.Generator().manual_seed(10_000 * step() + 100 * args.group
                                                      + 10 * fabric.global_rank + micro)
            batch = torch.randn(8, 16, generator=generator)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                fabric.backward((model(batch, first) if args.unused else model(batch)).square().mean())
        optimizer.step()
        fabric.log_dict(strategy.replica_metrics, step=step())
        committed = strategy.step_committed
        if committed:
            scheduler.step()
            state["iteration"] += 1
        optimizer.zero_grad()
        if committed:
            tensors = [local_part(p) for p in model.parameters()]
            line = {"step": step(), "time": time.time(), "loop_start": loop_start, "model": digest(tensors),
                    "optimizer": digest(optimizer_tensors(optimizer)), "iteration": state["iteration"],
                    "lr": scheduler.get_last_lr()[0], "healed_at": replicas.healed_at if replicas else None,
                    # (the last heal's transfer into this rank, as the last vote reported it)
                    "heal_s": replicas.report.heal_seconds if replicas and replicas.report else None,
                    "groups": replicas.manager.num_participants() if replicas else args.nodes,
                    # (--every) the outer loop's state (its synced copies and momentum) and the syncs committed
                    "outer": digest([t for f in strategy.outer_sync.fragments for t in (*f.synced, *f.momentum())])
                    if strategy.outer_sync is not None else None,
                    "syncs": replicas.step if replicas is not None and args.every else None,
                    "pid": os.getpid(),
                    # on a cluster node: what the node has sent on its link so far (everything that crossed)
                    "tx": link_tx_bytes() if "GLOO_SOCKET_IFNAME" in os.environ else None,
                    "grad_bytes": sum(local_part(p).numel() * 4 for p in model.parameters()),
                    # (--unused) the heads: the one no rank uses now and before the first step, the one rank 0 of
                    # group 0 uses
                    "never": digest([local_part(p) for p in module.never.parameters()]) if args.unused else None,
                    "never_before": never,
                    "only_first": digest([local_part(p) for p in module.only_first.parameters()]) if args.unused else None}
            with record.open("a") as f:
                f.write(json.dumps(line) + "\n")
            if args.checkpoint and step() % args.checkpoint_every == 0:
                fabric.save(Path(args.checkpoint) / f"step{step()}", state)
            if step() == args.perturb_at:
                with torch.no_grad():  # (a state no peer holds, at the same step: what a split step leaves)
                    for parameter in model.parameters():
                        local_part(parameter).add_(1e-3)
        time.sleep(args.pause)
    if args.every:
        strategy.sync_replicas()  # (replica_sync: the groups end on the same weights)
    fabric.logger.finalize("success")  # (the CSV logger writes what it holds)
    strategy.wait_for_checkpoint()  # (a background save's outcome, before the end)
    if replicas is not None:
        replicas.shutdown()


if __name__ == "__main__":
    main()
