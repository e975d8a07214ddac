"""One node's ranks of the cluster failure tests (torchrun inside a node namespace of the cluster harness).

Trains ``smp_hybrid`` at degree 2 with a short collective ``timeout``, saves a sharded checkpoint after step
``--save-at`` (rank 0 also writes the full weights it holds then, and a ``saved`` marker), then keeps training, one
slow step at a time, until the test cuts the link or kills a node.
"""

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_smp import HybridShardFSDPStrategy  # noqa: E402
from tests.helpers import TinyModel, make_loader  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--save-at", type=int, default=2)
parser.add_argument("--timeout", type=float, default=10.0)
args = parser.parse_args()


class SaveThenWait(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step == args.save_at:
            trainer.save_checkpoint(args.out / "ckpt")
            weights = trainer.strategy.full_state_dict()
            if trainer.is_global_zero:
                torch.save(weights, args.out / "weights_at_save.pt")
                (args.out / "saved").write_text(str(trainer.global_step))
        if trainer.global_step > args.save_at:
            time.sleep(0.5)  # the link is cut (or a node killed) while these steps run


torch.manual_seed(0)
strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, timeout=timedelta(seconds=args.timeout))
trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=10_000, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[SaveThenWait()])
trainer.fit(TinyModel(), make_loader(samples=4096))
