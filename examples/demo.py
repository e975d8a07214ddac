"""Train a small GPT-style model with hybrid sharding: the job `make demo` runs.

Launch commands (the same script everywhere; Lightning starts one process per device):

    python examples/demo.py                                   # 4 CPU ranks (gloo), degree 2, or every GPU (NCCL)
    python examples/demo.py --devices 8 --degree 4            # 2 replicas x 4 shards
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \
        examples/demo.py --devices 8 --num-nodes 2 --degree 16   # shard groups spanning two nodes
"""

from __future__ import annotations

import argparse
import math
import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from lightning_smp import HybridShardFSDPStrategy, MemorySavingsCallback  # noqa: E402
from lightning_smp.demo import Block, MarkovDataModule, TinyGPT, describe_size  # noqa: E402


class ShowMesh(Callback):
    """Prints, on rank 0, which ranks shard the model together and which hold replicas."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        layout = strategy.layout
        mesh = strategy.device_mesh.mesh.tolist()
        if trainer.is_global_zero:
            shard_groups = "  ".join(str(row) for row in mesh)
            replica_groups = "  ".join(str(list(col)) for col in zip(*mesh))
            print(f"\n{layout.describe()}")
            print(f"  shard groups (all-gather / reduce-scatter inside): {shard_groups}")
            print(f"  replicate groups (1/{layout.shard} gradient all-reduce across): {replica_groups}\n")


def main() -> None:
    gpus = torch.cuda.device_count()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=gpus or 4, help="ranks per node (default: all GPUs, else 4 CPU ranks)")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--degree", type=int, default=None, help="hybrid_shard_degree (default: 2 when it divides the world size, else 1)")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    world = args.devices * args.num_nodes
    degree = args.degree if args.degree is not None else (2 if world % 2 == 0 else 1)
    # Lightning's own deprecation notices (one per rank) would bury the tables
    warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec.*")
    L.seed_everything(0, verbose=False)
    model = TinyGPT(vocab_size=64, dim=args.dim, layers=args.layers, heads=4, block_size=32)
    batch_size = 8
    # one epoch of exactly max_steps batches per rank: the progress bar then counts steps ("Epoch 0/0 ... 60/60")
    samples = max(2048, math.ceil(args.max_steps * batch_size * world / 1024) * 1024)
    data = MarkovDataModule(vocab_size=64, block_size=32, samples=samples, batch_size=batch_size)
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, auto_wrap_policy={Block})
    trainer = L.Trainer(
        accelerator="gpu" if gpus else "cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision="bf16-mixed" if gpus else "32-true",
        max_epochs=1,
        limit_train_batches=args.max_steps,
        max_steps=args.max_steps,
        limit_val_batches=4,
        val_check_interval=args.max_steps // 2,
        log_every_n_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,  # it would count the local shards, not the model
        # one memory table (held, unsharded, floor per rank) and one table of the collectives of step 2 (step 1
        # follows the sanity check), both at the end of fit
        callbacks=[ShowMesh(), MemorySavingsCallback(comm_step=2, print_stages=("fit_end",))],
        default_root_dir="lightning_logs/demo",  # the memory report's JSON goes there
    )
    if trainer.is_global_zero:
        print(f"TinyGPT with {describe_size(model)} on {world} rank(s), hybrid_shard_degree={degree}")
    trainer.fit(model, data)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"done: {metrics}")


if __name__ == "__main__":
    main()
