"""One replica group of a fault-tolerant Trainer run (``fault_tolerance``), started by ``torchrun`` with
``hybrid_shard_degree`` ranks: every committed optimizer step writes one line per rank to ``--out`` (torchft's step,
``global_step``, the wall time, digests of this rank's shards and optimizer state, the learning rate, the epoch, the
batch's index in it and the index of its first sample, in a shuffled order), so that a test compares groups step by
step. With ``--every H`` the groups sync every H steps (``replica_sync``) and every step is recorded, with a digest of
the outer loop's state (its synced copies and outer momentum)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.fault_run import digest, group_arguments, optimizer_tensors, vanish_inside_the_crossing
from lightning_smp import HybridShardFSDPStrategy
from lightning_smp.replicas import local_part

BATCH = 8


class Model(L.LightningModule):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        # (norm: BatchNorm's running statistics, buffers that the groups' syncs carry)
        middle = [torch.nn.BatchNorm1d(32)] if norm else []
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), *middle, torch.nn.Linear(32, 4))

    fail_at: int | None = None

    def training_step(self, batch, batch_idx):
        index, x = batch
        self.first_sample = int(index[0])
        return self.net(x).square().mean()

    def on_after_backward(self) -> None:
        replicas = self.trainer.strategy.replica_groups
        if self.fail_at is not None and replicas.step == self.fail_at - 1:
            self.fail_at = None  # once, after the step's quorum was asked for: as a collective that failed
            replicas.manager.report_error(RuntimeError("injected by the test"))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Record(L.Callback):
    def __init__(self, out: Path, group: int, pause: float, vanish: tuple | None = None) -> None:
        self.out, self.group, self.pause, self.vanish = out, group, pause, vanish

    def on_train_start(self, trainer, module):
        if self.vanish is not None:  # (--vanish_at: this group vanishes inside a crossing, as fault_run.py's)
            at, how, thaw_after = self.vanish
            marker = self.out / f"vanished{self.group}" if trainer.global_rank == 0 else None
            vanish_inside_the_crossing(trainer.strategy.replica_groups, at, how, marker, thaw_after)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        if not strategy.step_committed and not trainer.fit_loop._should_accumulate():
            # a step the groups did not commit: global_step stays
            with (self.out / f"group{self.group}_rank{trainer.global_rank}_uncommitted.jsonl").open("a") as f:
                f.write(json.dumps({"global_step": trainer.global_step, "step": strategy.replica_groups.step}) + "\n")
        if strategy.step_committed and not trainer.fit_loop._should_accumulate():
            optimizer = trainer.optimizers[0]
            line = {"step": strategy.replica_groups.step, "global_step": trainer.global_step, "time": time.time(),
                    "model": digest([local_part(p) for p in module.parameters()]),
                    "optimizer": digest(optimizer_tensors(optimizer)), "lr": optimizer.param_groups[0]["lr"],
                    "sample": module.first_sample, "batch_idx": trainer.fit_loop.epoch_loop.batch_idx,
                    "epoch": trainer.current_epoch,
                    "healed_at": strategy.replica_groups.healed_at}
            outer = strategy.outer_sync
            if outer is not None:
                line["outer"] = digest([t for f in outer.fragments for t in (*f.synced, *f.momentum())])
                line["buffers"] = digest(list(module.buffers()))
                line["tracked"] = sum(int(b) for n, b in module.named_buffers() if n.endswith("num_batches_tracked"))
            with (self.out / f"group{self.group}_rank{trainer.global_rank}.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
        time.sleep(self.pause)


def main() -> None:
    parser = group_arguments()
    parser.add_argument("--fsdp_version", type=int, default=2)
    parser.add_argument("--fail_at", type=int, default=None, help="report an error to torchft in this step")
    parser.add_argument("--samples", type=int, default=4096, help="the dataset's size (all groups together)")
    parser.add_argument("--every", type=int, default=None, help="replica_sync: sync the groups every this many steps")
    parser.add_argument("--norm", action="store_true", help="a BatchNorm in the model (buffers)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(1234)
    samples = args.samples
    data = TensorDataset(torch.arange(samples), torch.randn(samples, 16, generator=torch.Generator().manual_seed(0)))
    strategy = HybridShardFSDPStrategy(
        hybrid_shard_degree=args.degree, fsdp_version=args.fsdp_version,
        fault_tolerance={"lighthouse": args.lighthouse, "group": args.group, "groups": args.groups, "timeout": 10.0,
                         "quorum_timeout": 30.0},
        replica_sync={"every": args.every} if args.every else None)
    # (the strategy logs each step's groups, commit and heal to every logger: fault_tolerance/...)
    logger = CSVLogger(out / "metrics", name=f"group{args.group}")
    trainer = L.Trainer(accelerator="cpu", devices=args.degree, strategy=strategy, max_steps=args.steps,
                        accumulate_grad_batches=args.accumulate, enable_checkpointing=False, logger=logger,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Record(out, args.group, args.pause, None if args.vanish_at is None
                                          else (args.vanish_at, args.vanish, args.thaw_after))])
    model = Model(norm=args.norm)
    model.fail_at = args.fail_at
    # shuffled: each epoch its own order (DistributedSampler's seed 0 plus the epoch), each group its own part of it
    trainer.fit(model, DataLoader(data, batch_size=BATCH, shuffle=True))


if __name__ == "__main__":
    main()
