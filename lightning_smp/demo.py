"""A small GPT-style model and synthetic token data, shared by ``make demo``, the CLI examples, the notebook and
the benchmarks. Nothing is downloaded: the tokens come from a fixed random Markov chain, so the loss falls."""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP. The unit FSDP wraps."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        length = x.shape[1]
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(L.LightningModule):
    """A decoder-only language model; ``dim=64, layers=2`` has about 0.1 M parameters.

    Args:
        vocab_size: number of tokens.
        dim: embedding width (divisible by ``heads``).
        layers: number of transformer blocks.
        heads: attention heads.
        block_size: longest sequence.
        lr: AdamW learning rate.
    """

    def __init__(self, vocab_size: int = 64, dim: int = 64, layers: int = 2, heads: int = 4, block_size: int = 32,
                 lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(1, block_size, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def _loss(self, batch: Tensor) -> Tensor:
        logits = self(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        # (each rank's own: a training metric with sync_dist=True costs an all-reduce every step, and under
        # replica_sync crosses the link between groups that train apart; docs/replica-sync.md)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.0)


class MarkovTokens(Dataset):
    """``samples`` sequences of ``length`` tokens drawn from a fixed random Markov chain (seeded, reproducible).

    ``seed`` fixes the chain, ``split`` the sequences drawn from it (0 for training, 1 for validation).
    """

    def __init__(self, vocab_size: int = 64, length: int = 33, samples: int = 512, seed: int = 0,
                 split: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        # a peaked transition matrix: each token has a few likely successors, so there is something to learn
        logits = torch.randn(vocab_size, vocab_size, generator=g) * 3.0
        probs = torch.softmax(logits, dim=-1)
        # the same chain for every split; different sequences per split
        g.manual_seed(seed * 1009 + split + 1)
        tokens = torch.empty(samples, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab_size, (samples,), generator=g)
        for t in range(1, length):
            tokens[:, t] = torch.multinomial(probs[tokens[:, t - 1]], 1, generator=g).squeeze(1)
        self.tokens = tokens
        self.entropy_floor = float(-(probs * probs.log()).sum(-1).mean())

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> Tensor:
        return self.tokens[index]


class MarkovDataModule(L.LightningDataModule):
    """Train/validation loaders over :class:`MarkovTokens`; ``batch_size`` is per rank."""

    def __init__(self, vocab_size: int = 64, block_size: int = 32, samples: int = 512, batch_size: int = 8,
                 seed: int = 0) -> None:
        super().__init__()
        self.vocab_size, self.block_size, self.samples = vocab_size, block_size, samples
        self.batch_size, self.seed = batch_size, seed

    def setup(self, stage: str) -> None:
        self.train_set = MarkovTokens(self.vocab_size, self.block_size + 1, self.samples, self.seed)
        self.val_set = MarkovTokens(self.vocab_size, self.block_size + 1, max(self.samples // 8, 8), self.seed, split=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def describe_size(model: nn.Module) -> str:
    n = parameter_count(model)
    return f"{n / 1e6:.2f} M parameters" if n >= 1e5 else f"{n} parameters"


__all__ = ["Block", "MarkovDataModule", "MarkovTokens", "TinyGPT", "describe_size", "parameter_count"]
