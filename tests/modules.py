"""LightningModules, wrap policies and data that several test modules train."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import TinyModel

#: micro-batches per optimizer step of the accumulating modules
K = 2


class GAN(L.LightningModule):
    """A generator and a discriminator, each with its own optimizer, stepped in turn with ``toggle_optimizer``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 16))
        self.discriminator = torch.nn.Sequential(torch.nn.Linear(16, 17), torch.nn.Tanh(), torch.nn.Linear(17, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        real, _ = batch
        noise = real[:, :8].flip(0)  # from the batch: no random numbers that could differ between strategies
        opt_g, opt_d = self.optimizers()
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        bce = torch.nn.functional.binary_cross_entropy_with_logits

        self.toggle_optimizer(opt_g)
        fake = self.generator(noise)
        self.manual_backward(bce(self.discriminator(fake), ones))
        self.clip_gradients(opt_g, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        for half in (slice(0, 1), slice(1, 2)):  # two forward/backward passes before the step: they accumulate
            loss = bce(self.discriminator(real[half]), ones[half]) + bce(self.discriminator(fake[half].detach()),
                                                                         zeros[half])
            self.manual_backward(loss / 2)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        return loss.detach()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.AdamW(self.generator.parameters(), lr=0.05),
                torch.optim.AdamW(self.discriminator.parameters(), lr=0.05)]


class AuxiliaryHeads(TinyModel):
    """TinyModel and two heads of one shape: ``aux_even`` takes part in even batches only, ``aux_odd`` in odd ones.
    With ``run_both``, both heads run in every batch and only the loss leaves one out (its hook never fires)."""

    def __init__(self, run_both: bool = False) -> None:
        super().__init__(lr=0.05)
        self.aux_even = torch.nn.Linear(16, 4)
        self.aux_odd = torch.nn.Linear(16, 4)
        self.run_both = run_both

    def forward(self, x: torch.Tensor, head: int | None = None) -> Any:
        """The body's output; with ``head`` (a micro-batch index), also that of the head it picks (Fabric's loops)."""
        if head is None:
            return self.net(x)
        return self.net(x), (self.aux_even if head % 2 == 0 else self.aux_odd)(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.run_both:
            even, odd = self.aux_even(x), self.aux_odd(x)
            head = even if batch_idx % 2 == 0 else odd
        else:
            head = (self.aux_even if batch_idx % 2 == 0 else self.aux_odd)(x)
        return torch.nn.functional.mse_loss(self(x), y) + torch.nn.functional.mse_loss(head, y)


class DataDependentBranch(TinyModel):
    """An auxiliary loss only where this rank's batch meets a condition: some ranks use ``aux``, others do not.
    ``net`` is the body, ``head`` and ``aux`` sit beside it."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh())
        self.head = torch.nn.Linear(33, 4)
        self.aux = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if y[:, 0].mean() > 0:  # true on 1 to 3 of the 4 ranks in each step of this data
            loss = loss + torch.nn.functional.mse_loss(self.aux(x), y)
        return loss


BODY_ONLY = ModuleWrapPolicy({torch.nn.Sequential})


class ZeroGradAfterTheFirstMicroBatch(TinyModel):
    """In the second optimizer step, ``zero_grad`` right after the first micro-batch's backward (a hook of the user's)
    drops that micro-batch: under DDP the step then applies the second micro-batch's gradient alone. (Every
    parameter takes part in every micro-batch: DDP's reducer refuses a window in which a parameter it saw used has
    lost its gradient.) FSDP2's deferred all-reduce keeps the window's sum outside ``.grad``: the Trainer's
    ``zero_grad`` left it there once, and the step applied the dropped micro-batch anyway (``tests/test_scenarios.py``)."""

    def on_after_backward(self) -> None:
        if self.trainer.global_step == 1 and self.trainer.fit_loop.epoch_loop.batch_idx % K == 0:
            self.optimizers().zero_grad()


class LoRABlock(torch.nn.Module):
    """A frozen base projection with a trainable low-rank update (most weights ``requires_grad=False``)."""

    def __init__(self, width: int, rank: int = 2) -> None:
        super().__init__()
        self.base = torch.nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = torch.nn.Linear(width, rank, bias=False)
        self.up = torch.nn.Linear(rank, width, bias=False)
        torch.nn.init.normal_(self.up.weight, std=0.1)  # LoRA starts B at zero; nonzero so both factors train

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.up(self.down(x))) + x


class FeatureModel(L.LightningModule):
    """Tied input/output embeddings, frozen LoRA bases, blocks for wrapping and activation checkpointing."""

    VOCAB, WIDTH = 11, 12

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(self.VOCAB, self.WIDTH)
        self.blocks = torch.nn.Sequential(LoRABlock(self.WIDTH), LoRABlock(self.WIDTH))
        self.head = torch.nn.Linear(self.WIDTH, self.VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return torch.nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


def token_loader(samples: int = 64, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, FeatureModel.VOCAB, (samples, 6), generator=g)
    return DataLoader(TensorDataset(tokens, tokens.roll(1, dims=1)), batch_size=batch_size)
