"""Models, data and Fabric loops that several test modules run (launched in every rank: module-level functions,
picklable by reference)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lightning_smp.fabric import HybridShardFSDPStrategy
from tests.helpers import TinyModel, make_loader
from tests.modules import K  # micro-batches per optimizer step of the accumulating loops


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyModel().net  # 16 -> 33 -> 4, odd sizes that FSDP must pad


def full_weights(fabric: L.Fabric, model: Any) -> dict[str, list]:
    """The full weights on rank 0 (as lists: a launched function's result is pickled out of the ranks)."""
    strategy = fabric.strategy
    if isinstance(strategy, HybridShardFSDPStrategy):
        state = strategy.full_state_dict(model)
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return {k: v.tolist() for k, v in state.items()}


def rank_batches(fabric: L.Fabric) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = make_loader().dataset.tensors
    # what a DistributedSampler gives this rank (with fault_tolerance: its part of every group's ranks)
    split = getattr(fabric.strategy, "distributed_sampler_kwargs", None) or {}
    mine = slice(split.get("rank", fabric.global_rank), None, split.get("num_replicas", fabric.world_size))
    xs, ys = x[mine], y[mine]
    return [(xs[i:i + 2], ys[i:i + 2]) for i in range(0, len(xs), 2)]


def fabric_state(fabric: L.Fabric, model: Any, optimizer: Any) -> dict[str, Any]:
    strategy = fabric.strategy
    optim = strategy.full_optimizer_state(model, optimizer)
    return {"weights": full_weights(fabric, model),
            "optimizer": {i: {k: v.tolist() for k, v in s.items()} for i, s in optim.get("state", {}).items()}}


def load_fabric_state(fabric: L.Fabric, path: str) -> dict[str, Any]:
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(path, state, strict=False)
    out = fabric_state(fabric, model, optimizer)
    out["step"], out["remainder"] = state["step"], sorted(remainder)
    return out


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # built from a config: nothing is downloaded
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def window_dropped(fabric: L.Fabric) -> dict[str, list]:
    """Accumulation of K micro-batches under no_backward_sync; in the second step, optimizer.zero_grad() right after
    the first micro-batch drops it (a loop discarding part of a window, e.g. after a loss spike)."""
    model = fabric.setup_module(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    batches = iter(rank_batches(fabric))
    for step in range(3):
        for micro in range(K):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < K - 1):
                fabric.backward(torch.nn.functional.mse_loss(model(x), y) / K)
            if step == 1 and micro == 0:
                optimizer.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    return full_weights(fabric, model)


def clipped_by_optimizer(fabric: L.Fabric, two: bool) -> dict[str, list]:
    """Norm clipping per optimizer: the head's optimizer alone while the body still requires grad (``two=False``), or
    one optimizer for the body and one for the head, each clipped on its own (``two=True``)."""
    model = fabric.setup_module(make_net())
    head = list(model.module[2].parameters())
    body = [p for p in model.module.parameters() if all(p is not h for h in head)]
    groups = [body, head] if two else [head]
    optimizers = [fabric.setup_optimizers(torch.optim.AdamW(params, lr=0.05)) for params in groups]
    for x, y in rank_batches(fabric)[:3]:
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        for optimizer in optimizers:
            fabric.clip_gradients(model, optimizer, max_norm=0.05)  # below every norm here: always clips
            optimizer.step()
            optimizer.zero_grad()
    return full_weights(fabric, model)
