"""Pretrain a small GPT-style model with a hand-written Fabric loop, litgpt-style, on hybrid sharding.

The loop: AdamW, gradient accumulation (`fabric.no_backward_sync` on every micro-batch but the last), norm
clipping, a sharded checkpoint every `--save-every` optimizer steps, resuming from the latest one with `--resume`,
and the memory and communication report after the first optimizer step.

    python examples/fabric_train.py                          # 4 CPU ranks (gloo), degree 2, FSDP2, or every GPU
    python examples/fabric_train.py --resume                 # continue from out/fabric/last
    python examples/fabric_train.py --fsdp-version 1 --degree 4
    torchrun --nproc_per_node 8 examples/fabric_train.py --devices 8 --degree 4
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_smp  # noqa: E402
from lightning_smp.demo import Block, MarkovTokens, TinyGPT  # noqa: E402
from lightning_smp.fabric import HybridShardFSDPStrategy  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=None, help="ranks per node (default: 4 CPU ranks, or every GPU)")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--degree", type=int, default=2, help="hybrid_shard_degree: ranks that shard one copy")
    parser.add_argument("--fsdp-version", type=int, default=2, choices=(1, 2))
    parser.add_argument("--max-steps", type=int, default=8, help="optimizer steps to reach (resuming counts too)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank and micro-batch")
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping by the global 2-norm")
    parser.add_argument("--save-every", type=int, default=4, help="optimizer steps between sharded checkpoints")
    parser.add_argument("--out", type=Path, default=Path("out/fabric"))
    parser.add_argument("--resume", action="store_true", help="continue from <out>/last")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> dict:
    gpu = torch.cuda.is_available()
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=args.degree, fsdp_version=args.fsdp_version,
                                       auto_wrap_policy={Block}, state_dict_type="sharded")
    fabric = L.Fabric(strategy=strategy, accelerator="gpu" if gpu else "cpu", devices=args.devices or (
        torch.cuda.device_count() if gpu else 4), num_nodes=args.num_nodes, precision="bf16-mixed" if gpu else "32-true")
    fabric.launch()
    fabric.seed_everything(0)  # the same data order everywhere; the weights come from rank 0 anyway

    with fabric.init_module():  # for a model too large for one device: fabric.init_module(empty_init=True)
        model = TinyGPT(vocab_size=64, dim=64, layers=2, heads=4, block_size=32)
    model = fabric.setup_module(model)  # sharded; every replica starts from rank 0's weights
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    last = args.out / "last"
    if args.resume:
        fabric.load(last, state)
        fabric.print(f"resumed from {last} at step {state['step']}")

    data = MarkovTokens(vocab_size=64, length=33, samples=4096)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.micro_batch, shuffle=True))
    batches = iter(loader)
    for _ in range(state["step"] * args.accumulate):  # skip what the resumed run already trained on
        next(batches)

    losses: list[float] = []
    while state["step"] < args.max_steps:
        counter = lightning_smp.count_communication(model) if state["step"] == 0 else None
        if counter is not None:
            counter.__enter__()
        for micro in range(args.accumulate):
            batch = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                logits = model(batch[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                         batch[:, 1:].reshape(-1))
                fabric.backward(loss / args.accumulate)
        if counter is not None:
            counter.__exit__(None, None, None)
        fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        fabric.print(f"step {state['step']}: loss {losses[-1]:.4f}")
        if counter is not None:
            lightning_smp.memory_report(model, [optimizer], comm=counter.counts(), backward_passes=args.accumulate,
                                        accumulation=strategy.gradient_accumulation, step=state["step"])
        if state["step"] % args.save_every == 0 or state["step"] == args.max_steps:
            fabric.save(args.out / f"step-{state['step']:06d}", state)
            fabric.save(last, state)  # the latest checkpoint, replaced atomically (the same run)
    if not math.isfinite(losses[-1] if losses else 0.0):
        raise RuntimeError("the loss is not finite")
    return {"step": state["step"], "losses": losses}


if __name__ == "__main__":
    main(parse_args())
