"""One "node" of the two-node test: launched twice by torchrun (--nnodes 2 --nproc_per_node 2) on loopback."""

import argparse
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_smp import HybridShardFSDPStrategy  # noqa: E402
from tests.helpers import RankRecorder, TinyModel, make_loader  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--degree", type=int, required=True)
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()

torch.manual_seed(0)
model = TinyModel()
trainer = L.Trainer(
    strategy=HybridShardFSDPStrategy(hybrid_shard_degree=args.degree), accelerator="cpu", devices=2, num_nodes=2,
    max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    callbacks=[RankRecorder(args.out / "records")], default_root_dir=args.out,
)
trainer.fit(model, make_loader())
weights = trainer.strategy.full_state_dict()
if trainer.is_global_zero:
    torch.save(weights, args.out / "weights.pt")
torch.save({"node_rank": trainer.node_rank, "global_rank": trainer.global_rank}, args.out / f"node{trainer.global_rank}.pt")
