"""One node's ranks of a ``make bench-semi-sync`` row (``torchrun`` inside a node namespace of
:mod:`lightning_smp.testing.cluster`; also alone on one node, for the compute bound).

Fits the project's small GPT (:class:`lightning_smp.demo.TinyGPT`, bytes as tokens) on a character corpus prepared
by :mod:`benchmarks.semi_sync` (the Python standard library's own ``.py`` sources): every row reads the same
training windows in the same order (one ``DistributedSampler`` part per rank) and validates on the same held-out
windows. Per optimizer step each rank records the time and its node's link counter (bytes this node sent so far);
each validation run records the step, the training time so far (validation excluded) and the validation loss
(``sync_dist``: the mean over every rank's part of the held-out windows). Global rank 0 writes ``--out``.

``--every 0`` is synchronous hybrid sharding; ``--every H`` adds ``replica_sync={"every": H, "fragments": F, **outer}``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_smp.demo import Block, TinyGPT  # noqa: E402
from lightning_smp.testing.crossing import link_tx_bytes  # noqa: E402


class Windows(Dataset):
    """``count`` windows of ``length`` bytes of ``corpus``, at offsets drawn once with ``seed``."""

    def __init__(self, corpus: torch.Tensor, length: int, count: int, seed: int) -> None:
        self.corpus, self.length = corpus, length
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(corpus) - length, (count,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = int(self.starts[index])
        return self.corpus[start:start + self.length].long()


class CharGPT(TinyGPT):
    """TinyGPT over bytes; the training loss is logged on each rank alone (``sync_dist`` would cross the groups every
    step: a collective over the world)."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss


class Timeline(L.Callback):
    """Per optimizer step: the time and this node's link counter; validation runs timed apart, with their loss."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, int]] = []
        self.validations: list[dict[str, Any]] = []
        self.validating = 0.0
        self.validation_bytes = 0
        #: the seconds the syncs held this rank's training (each sync's report: its start, and what was left to
        #: wait when it landed), and how many
        self.sync_held = 0.0
        self.syncs = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dist.barrier()  # (every rank starts the clock together; nothing else crosses the groups until the end)
        self.marks.append((time.perf_counter(), link_tx_bytes()))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.marks.append((time.perf_counter(), link_tx_bytes()))
        outer = trainer.strategy.outer_sync
        report = outer.report if outer is not None else None
        if report is not None and report.syncs > self.syncs:
            self.syncs, self.sync_held = report.syncs, self.sync_held + report.seconds

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = (time.perf_counter(), link_tx_bytes())

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        started, sent = self._started
        self.validating += time.perf_counter() - started
        self.validation_bytes += link_tx_bytes() - sent
        loss = float(trainer.callback_metrics["val_loss"])
        train_time = time.perf_counter() - self.marks[0][0] - self.validating
        self.validations.append({"step": trainer.global_step, "train_s": train_time, "val_loss": loss})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, required=True, help="a uint8 tensor file (torch.save)")
    parser.add_argument("--split", type=int, required=True, help="bytes of the corpus before the held-out part")
    parser.add_argument("--every", default="0", help="replica_sync's every (0: synchronous; 'auto')")
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--outer", default="{}",
                        help="replica_sync's other keys (outer optimizer, delay, compress), as JSON (default: none)")
    parser.add_argument("--seed", type=int, default=0, help="the model's initialisation and the windows' draw")
    parser.add_argument("--mix", type=float, default=None,
                        help="an overlapped crossing lands as Streaming DiLoCo's mix with this alpha (OuterSync.mix)")
    parser.add_argument("--degree", type=int, default=2)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--data-steps", type=int, default=None,
                        help="steps' worth of training windows (the longest row's: every row reads the same)")
    parser.add_argument("--val-every", type=int, default=100)
    parser.add_argument("--val-windows", type=int, default=256)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="windows per rank and step")
    parser.add_argument("--samples-world", type=int, default=4,
                        help="the ranks whose samples a step of the full job reads (every row reads the same)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    from lightning_smp import HybridShardFSDPStrategy
    from lightning_smp.replica_sync import OuterSync

    OuterSync.mix = args.mix  # (the rule measured against; None: the library's)

    corpus = torch.load(args.corpus, weights_only=True)
    world = int(os.environ["WORLD_SIZE"])
    nodes = world // int(os.environ["LOCAL_WORLD_SIZE"])
    # the same windows in the same order for every row: the full job's ranks each read their part of them
    train = Windows(corpus[:args.split], args.block + 1,
                    (args.data_steps or args.steps) * args.batch * args.samples_world, seed=1 + 1000 * args.seed)
    val = Windows(corpus[args.split:], args.block + 1, args.val_windows, seed=2)
    every = args.every if args.every == "auto" else int(args.every)
    sync = ({"replica_sync": {"every": every, "fragments": args.fragments, **json.loads(args.outer)}}
            if every else {})
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=args.degree, fsdp_version=2, auto_wrap_policy={Block},
                                       **sync)
    torch.manual_seed(args.seed)
    model = CharGPT(vocab_size=256, dim=args.dim, layers=args.layers, heads=4, block_size=args.block, lr=args.lr)
    timeline = Timeline()
    trainer = L.Trainer(accelerator="cpu", devices=world // nodes, num_nodes=nodes, strategy=strategy,
                        max_steps=args.steps, val_check_interval=args.val_every, check_val_every_n_epoch=None,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timeline])
    trainer.fit(model, DataLoader(train, batch_size=args.batch), DataLoader(val, batch_size=args.batch))
    params = sum(p.numel() for p in model.parameters())
    outer = strategy.outer_sync
    record = {"marks": timeline.marks, "validations": timeline.validations, "validating_s": timeline.validating,
              "validation_bytes": timeline.validation_bytes, "node": int(os.environ["GROUP_RANK"]),
              "sync_held_s": timeline.sync_held, "syncs": timeline.syncs,
              # (what "auto" chose, and why)
              "schedule": outer.schedule() if outer is not None else None,
              "chosen": outer.chosen.why if outer is not None and outer.chosen is not None else None}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if dist.get_rank() == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "world": world,
                                        "nodes": nodes, "ranks": gathered, "local_params": params}))


if __name__ == "__main__":
    main()
