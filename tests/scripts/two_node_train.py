"""One "node" of the two-node test: launched twice by torchrun (--nnodes 2 --nproc_per_node 2) on loopback. Fits
once per degree of ``--degrees``, in the same processes, into ``<out>/degree<d>``."""

import argparse
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from lightning_smp import HybridShardFSDPStrategy  # noqa: E402
from tests.helpers import RankRecorder, TinyModel, cpu_trainer, make_loader  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--degrees", required=True, help="comma-separated hybrid_shard_degree values")
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()

for degree in map(int, args.degrees.split(",")):
    out = args.out / f"degree{degree}"
    torch.manual_seed(0)
    model = TinyModel()
    trainer = cpu_trainer(HybridShardFSDPStrategy(hybrid_shard_degree=degree), out, 2, num_nodes=2, max_steps=6,
                          callbacks=[RankRecorder(out / "records")])
    trainer.fit(model, make_loader())
    weights = trainer.strategy.full_state_dict()
    if trainer.is_global_zero:
        torch.save(weights, out / "weights.pt")
    torch.save({"node_rank": trainer.node_rank, "global_rank": trainer.global_rank}, out / f"node{trainer.global_rank}.pt")
