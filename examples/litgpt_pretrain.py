"""litgpt with hybrid sharding: litgpt's own pretraining loop (``litgpt.pretrain.main``) on lightning_smp's Fabric
strategy, with a tiny GPT, synthetic tokens and nothing downloaded.

litgpt's ``main`` builds the model under ``fabric.init_module(empty_init=True)``, trains with
``fabric.no_backward_sync`` over micro-batches, clips, and checkpoints through ``fabric.save`` with its state
``{"model", "optimizer", "train_dataloader", "iter_num", "step_count"}``; it resumes with ``fabric.load``. Nothing in
that loop is changed here: this script only builds the Fabric (litgpt's ``setup`` hard-codes Lightning's
``FSDPStrategy``) and a data module whose loader remembers its position, as litdata's ``StreamingDataLoader`` does::

    pip install --no-deps litgpt==0.5.13                        # what `make install-litgpt` runs
    python examples/litgpt_pretrain.py --out out/litgpt        # 4 CPU ranks (gloo), degree 2, FSDP1, full checkpoints
    python examples/litgpt_pretrain.py --out out/litgpt --resume              # from the latest step-* checkpoint
    python examples/litgpt_pretrain.py --fsdp-version 2 --state-dict-type sharded --out out/litgpt2
    python examples/litgpt_pretrain.py --convert out/litgpt/final out/litgpt/converted   # one process, no ranks

``--convert`` runs litgpt's ``convert_pretrained_checkpoint`` (a sharded checkpoint is consolidated first, into the
layout Fabric's full checkpoints have), so that the result loads into ``litgpt.GPT`` for inference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from litgpt.args import EvalArgs, TrainArgs  # noqa: E402
from litgpt.config import Config  # noqa: E402
from litgpt.data import DataModule  # noqa: E402
from litgpt.model import Block  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from lightning_smp.fabric import HybridShardFSDPStrategy  # noqa: E402

#: the model: 2 blocks of litgpt's GPT, 32 tokens of context over a vocabulary of 64
CONFIG = dict(name="tiny-gpt", block_size=32, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=4, n_embd=32,
              rotary_percentage=0.25, parallel_residual=True, bias=True)
MICRO_BATCH, ACCUMULATE, SAVE_EVERY, STEPS = 2, 2, 2, 4


class ResumableLoader(DataLoader):
    """A ``DataLoader`` that knows where it is (epoch, batches served in it) through ``state_dict()`` and continues
    from there after ``load_state_dict()``: what litdata's ``StreamingDataLoader`` gives litgpt. Its constructor is
    ``DataLoader``'s own, so that Fabric can rebuild it with a distributed sampler."""

    _epoch = 0
    _served = 0
    _skip = 0

    def __iter__(self) -> Any:
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(self._epoch)  # the epoch restored, not Fabric's count of __iter__ calls
        skip, self._skip, self._served = self._skip, 0, 0
        for index, batch in enumerate(super().__iter__()):
            if index < skip:
                continue
            self._served = index + 1
            yield batch
        self._epoch, self._served = self._epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "batches": self._served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._epoch, self._skip = state["epoch"], state["batches"]


class SyntheticTokens(DataModule):
    """Seeded random token sequences, the same on every rank (Fabric's sampler gives each rank its part)."""

    def __init__(self, sequences: int = 256, seed: int = 42) -> None:
        super().__init__()
        self.sequences, self.seed = sequences, seed
        self.batch_size, self.max_seq_length = 1, 32

    def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int | None = None,
                **kwargs: Any) -> None:
        self.batch_size = batch_size
        self.max_seq_length = max_seq_length or self.max_seq_length

    def _tokens(self, count: int, offset: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + offset)
        return torch.randint(0, CONFIG["vocab_size"], (count, self.max_seq_length + 1), generator=g)

    def train_dataloader(self) -> DataLoader:
        return ResumableLoader(self._tokens(self.sequences, 0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._tokens(16, 1), batch_size=self.batch_size)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/litgpt"))
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--degree", type=int, default=2, help="hybrid_shard_degree: ranks that shard one copy")
    parser.add_argument("--fsdp-version", type=int, default=1, choices=(1, 2))
    parser.add_argument("--state-dict-type", default="full", choices=("full", "sharded"))
    parser.add_argument("--resume", action="store_true", help="continue from the latest <out>/step-*/lit_model.pth")
    parser.add_argument("--compile", action="store_true",
                        help="keep litgpt's torch.compile (on CPU, compiling takes longer than this whole run)")
    parser.add_argument("--convert", nargs=2, type=Path, metavar=("CHECKPOINT_DIR", "OUTPUT_DIR"),
                        help="convert a checkpoint for inference with litgpt's convert_pretrained_checkpoint")
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> None:
    from litgpt import pretrain

    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=args.degree, fsdp_version=args.fsdp_version,
                                       auto_wrap_policy={Block}, state_dict_type=args.state_dict_type)
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy, precision="32-true")
    fabric.launch()
    # litgpt's save_checkpoint records its own CLI's arguments by parsing sys.argv as `litgpt pretrain` would; this
    # script's flags are not litgpt's, so litgpt is shown the litgpt arguments that describe this run (the model's
    # full config goes to model_config.yaml next to each checkpoint)
    sys.argv = [sys.argv[0], CONFIG["name"], "--out_dir", str(args.out), "--devices", str(args.devices)]
    if not args.compile:
        torch.compile = lambda model, *a, **k: model  # type: ignore[assignment]  # litgpt's main compiles the model
    world = args.devices
    pretrain.main(
        fabric=fabric, devices=args.devices, seed=1337, initial_checkpoint_dir=None,
        resume="auto" if args.resume else False, config=Config(**CONFIG), data=SyntheticTokens(), out_dir=args.out,
        tokenizer_dir=None, tokenizer=None,
        train=TrainArgs(save_interval=SAVE_EVERY, log_interval=1, global_batch_size=MICRO_BATCH * ACCUMULATE * world,
                        micro_batch_size=MICRO_BATCH, max_tokens=STEPS * ACCUMULATE * MICRO_BATCH * CONFIG["block_size"]
                        * world, lr_warmup_steps=1, max_norm=1.0, min_lr=1e-4),
        eval=EvalArgs(interval=1000, max_iters=1, initial_validation=False, final_validation=False),
        optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3, "weight_decay": 0.02}},
    )


def convert(checkpoint_dir: Path, output_dir: Path) -> None:
    from litgpt.scripts.convert_pretrained_checkpoint import convert_pretrained_checkpoint

    from lightning_smp.checkpoint import SHARDED, checkpoint_kind, consolidate

    if checkpoint_kind(checkpoint_dir / "lit_model.pth") == SHARDED:
        # one file in Fabric's full layout ({"model": ...}), next to litgpt's config files, for litgpt to convert
        full_dir = output_dir.with_name(output_dir.name + "-consolidated")
        full_dir.mkdir(parents=True)
        consolidate(checkpoint_dir / "lit_model.pth", full_dir / "lit_model.pth")
        for config_file in checkpoint_dir.glob("*.yaml"):
            shutil.copy(config_file, full_dir)
        checkpoint_dir = full_dir
    convert_pretrained_checkpoint(checkpoint_dir, output_dir)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.convert:
        convert(*arguments.convert)
    else:
        train(arguments)
