"""Semi-synchronous replica groups (DiLoCo, ``replica_sync``) in a hand-written Fabric loop.

Each replica group (``--degree`` ranks, FSDP2 inside it) trains on its own data with its own AdamW; every
``--every`` optimizer steps the groups sync inside ``optimizer.step()`` (the outer Nesterov SGD steps the model as
last synced with the groups' averaged pseudo-gradient), and nothing crosses the groups in between. The loop is the
plain Fabric loop; what ``replica_sync`` adds is three calls: ``fabric.strategy.synced_weights()`` to evaluate the
model as last synced without a sync, ``fabric.save`` (a sync point; the checkpoint holds the outer loop too) and
``fabric.strategy.sync_replicas()`` at the end, so that every group returns the same model. Each evaluation runs
the same held-out batch on every rank and prints the spread of the ranks' losses: 0 when every group holds the same
weights. See docs/replica-sync.md.

    python examples/fabric_replica_sync.py                  # 4 CPU ranks (gloo): 2 groups of 2, or every GPU
    python examples/fabric_replica_sync.py --resume         # continue from out/fabric_replica_sync/last
    python examples/fabric_replica_sync.py --every 8 --fragments 2 --backup cpu
    torchrun --nnodes 2 --nproc_per_node 8 examples/fabric_replica_sync.py --devices 8 --num-nodes 2 --degree 8
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_smp.demo import Block, MarkovTokens, TinyGPT  # noqa: E402
from lightning_smp.fabric import HybridShardFSDPStrategy  # noqa: E402
from lightning_smp.names import BACKUP_DEVICE, REPLICA_SYNC_BACKUPS  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=None, help="ranks per node (default: 4 CPU ranks, or every GPU)")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--degree", type=int, default=2, help="hybrid_shard_degree: the ranks of one replica group")
    parser.add_argument("--every", type=int, default=4, help="optimizer steps between two syncs (DiLoCo's H)")
    parser.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo: fragments syncing in turn")
    parser.add_argument("--backup", choices=REPLICA_SYNC_BACKUPS, default=BACKUP_DEVICE,
                        help="where the outer loop keeps its copies of the model as last synced")
    parser.add_argument("--max-steps", type=int, default=12, help="optimizer steps to reach (resuming counts too)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--eval-every", type=int, default=4, help="optimizer steps between evaluations")
    parser.add_argument("--save-every", type=int, default=6, help="optimizer steps between sharded checkpoints")
    parser.add_argument("--out", type=Path, default=Path("out/fabric_replica_sync"))
    parser.add_argument("--resume", action="store_true", help="continue from <out>/last")
    parser.add_argument("--start-method", choices=("popen", "fork", "spawn"), default=None,
                        help="how the ranks start (default: Fabric's script launcher, fork in a notebook)")
    return parser.parse_args(argv)


def evaluate(fabric: L.Fabric, model: Any, batch: torch.Tensor) -> tuple[float, float]:
    """The loss of ``batch`` (the same on every rank) and the spread of the ranks' losses (0: every group holds
    the same weights)."""
    with torch.no_grad():
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
    # (an evaluation: crossing the groups here is fine)
    spread = fabric.all_reduce(loss.clone(), reduce_op="max") - fabric.all_reduce(loss.clone(), reduce_op="min")
    return fabric.all_reduce(loss, reduce_op="mean").item(), spread.item()


def train(fabric: L.Fabric, args: argparse.Namespace) -> dict[str, Any]:
    """The loop, on every rank; returns rank 0's record of it (its losses, the syncs, the evaluations)."""
    fabric.seed_everything(0)
    with fabric.init_module():
        model = TinyGPT(vocab_size=64, dim=64, layers=2, heads=4, block_size=32)
    model = fabric.setup_module(model)  # sharded inside each group; every group starts from rank 0's weights
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    last = args.out / "last"
    if args.resume:
        fabric.load(last, state)  # the weights, the inner optimizer, and the outer loop: where in its window it is
        fabric.print(f"resumed from {last} at step {state['step']}")

    held_out = MarkovTokens(vocab_size=64, length=33, samples=32, split=1).tokens.to(fabric.device)
    loader = fabric.setup_dataloaders(DataLoader(MarkovTokens(vocab_size=64, length=33, samples=4096),
                                                 batch_size=args.micro_batch, shuffle=True))
    batches = iter(loader)  # (each rank its own batches: each group trains on its own data)
    for _ in range(state["step"]):  # skip what the resumed run already trained on
        next(batches)
    outer = fabric.strategy.outer_sync
    record: dict[str, Any] = {"losses": {}, "synced": {}, "evaluations": {}}
    while state["step"] < args.max_steps:
        batch = next(batches)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        fabric.backward(loss)
        optimizer.step()  # every `every`-th step (each fragment's turn) also syncs the groups
        optimizer.zero_grad()
        state["step"] += 1
        step = state["step"]
        synced = [index for index, fragment in enumerate(outer.fragments) if fragment.synced_at == outer.steps]
        # (rank 0's own loss: a mean over every rank would cross the groups every step)
        record["losses"][step] = loss.item()
        fabric.print(f"step {step}: loss {loss.item():.4f}" + (f", synced fragments {synced}" if synced else ""))
        if synced:
            record["synced"][step] = synced
        if step % args.eval_every == 0:
            with fabric.strategy.synced_weights():  # the weights as last synced, the same in every group
                record["evaluations"][step] = evaluate(fabric, model, held_out)
            fabric.print(f"step {step}: held-out loss {record['evaluations'][step][0]:.4f} on the synced weights,"
                         f" spread over the ranks {record['evaluations'][step][1]:.1e}")
        if step % args.save_every == 0 or step == args.max_steps:
            fabric.save(args.out / f"step-{step:06d}", state)  # a sync point: every fragment that trained syncs
            fabric.save(last, state)
    fabric.strategy.sync_replicas()  # (nothing is sent when the last save synced already)
    record["final"] = evaluate(fabric, model, held_out)
    fabric.print(f"end: held-out loss {record['final'][0]:.4f}, spread over the ranks {record['final'][1]:.1e}")
    if not all(math.isfinite(value) for value in record["losses"].values()):
        raise RuntimeError("the loss is not finite")
    return record


def main(args: argparse.Namespace) -> dict[str, Any]:
    gpu = torch.cuda.is_available()
    strategy = HybridShardFSDPStrategy(
        hybrid_shard_degree=args.degree, fsdp_version=2, auto_wrap_policy={Block}, start_method=args.start_method,
        replica_sync={"every": args.every, "fragments": args.fragments, "backup": args.backup})
    fabric = L.Fabric(strategy=strategy, accelerator="gpu" if gpu else "cpu", devices=args.devices or (
        torch.cuda.device_count() if gpu else 4), num_nodes=args.num_nodes, precision="bf16-mixed" if gpu else "32-true")
    return fabric.launch(train, args)


if __name__ == "__main__":
    main(parse_args())
