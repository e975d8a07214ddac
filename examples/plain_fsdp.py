"""A plain PyTorch FSDP script made hybrid-sharded by one call, as with SMP's ``torch.sagemaker.init()``.

The FSDP call below is the unchanged FULL_SHARD call of a plain script; ``lightning_smp.init(...)`` before it
turns it into shard groups of ``--degree`` ranks (SMP overrides FULL_SHARD with HYBRID_SHARD for a degree >= 2).

    torchrun --nproc_per_node 4 examples/plain_fsdp.py --degree 2             # 4 CPU ranks (gloo): 2 x 2
    torchrun --nproc_per_node 8 examples/plain_fsdp.py --degree 4             # 8 GPUs (NCCL): 2 replicas x 4
    LIGHTNING_SMP_CONFIG='{"hybrid_shard_degree": 2}' torchrun --nproc_per_node 4 examples/plain_fsdp.py
    torchrun --nproc_per_node 4 examples/plain_fsdp.py --degree 2 --check-ddp # also train DDP, compare weights

``--facts DIR`` writes what each rank holds (``rank<k>.json``: shard group, strategy, shard size, losses,
and with ``--check-ddp`` the largest difference from DDP's weights).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel as DDP

import lightning_smp
from lightning_smp.demo import Block, MarkovTokens


class TinyLM(nn.Module):
    """Embedding, transformer blocks (one FSDP unit each) and a head."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, block: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, block, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, 4) for _ in range(layers)))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens) + self.pos[:, : tokens.shape[1]]))


def train(model: nn.Module, tokens: torch.Tensor, steps: int, batch: int) -> list[float]:
    """SGD on this rank's slice of each global batch; returns this rank's losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        start = (step * world + rank) * batch
        x = tokens[start: start + batch]
        logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--degree", type=int, default=None, help="hybrid_shard_degree (default: from the environment)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--check-ddp", action="store_true", help="also train DDP and compare the final weights")
    parser.add_argument("--facts", type=Path, default=None, help="folder for per-rank facts (rank<k>.json)")
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)

    # SMP: torch.sagemaker.init(config). With no --degree, LIGHTNING_SMP_CONFIG / SM_HP_MP_PARAMETERS decide.
    lightning_smp.init({"hybrid_shard_degree": args.degree} if args.degree is not None else None)

    tokens = MarkovTokens(vocab_size=64, length=17, samples=args.steps * world * args.batch).tokens.to(device)
    # every rank initialises differently on purpose: replicas must still start (and stay) equal
    torch.manual_seed(100 + rank)
    model = TinyLM().to(device)
    # the unchanged plain-FSDP call (device_id is needed on CPU only because FSDP refuses CPU otherwise)
    model = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=ModuleWrapPolicy({Block}),
                 device_id=device)
    losses = train(model, tokens, args.steps, args.batch)

    shard_group = dist.get_process_group_ranks(model.process_group)
    facts = {
        "rank": rank,
        "world_size": world,
        "sharding_strategy": model.sharding_strategy.name,
        "shard_group": shard_group,
        "replicate_group": dist.get_process_group_ranks(model._inter_node_pg)
        if getattr(model, "_inter_node_pg", None) is not None else None,
        "local_flat_numel": sum(u._handle.flat_param.numel() for u in FSDP.fsdp_modules(model) if u._handle),
        "losses": losses,
    }
    # offload_to_cpu on a CPU device would alias storage FSDP frees afterwards
    config = FullStateDictConfig(offload_to_cpu=gpu, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        hybrid_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    facts["weights_hash"] = float(sum(v.double().sum() for v in hybrid_weights.values()))

    if args.check_ddp:
        lightning_smp.shutdown()  # the DDP reference must not go through the patch
        torch.manual_seed(100 + rank)
        reference = DDP(TinyLM().to(device), device_ids=[device.index] if gpu else None)
        facts["ddp_losses"] = train(reference, tokens, args.steps, args.batch)
        reference_weights = reference.module.state_dict()
        facts["parameters"] = sum(v.numel() for v in reference_weights.values())
        facts["max_abs_diff_vs_ddp"] = max(
            (hybrid_weights[k] - reference_weights[k]).abs().max().item() for k in reference_weights
        )

    if args.facts is not None:
        args.facts.mkdir(parents=True, exist_ok=True)
        (args.facts / f"rank{rank}.json").write_text(json.dumps(facts))
    if rank == 0:
        print(f"shard group of rank 0: {shard_group}, FSDP ran {facts['sharding_strategy']},"
              f" loss {losses[0]:.3f} -> {losses[-1]:.3f}"
              + (f", max |w - w_ddp| = {facts['max_abs_diff_vs_ddp']:.2e}" if args.check_ddp else ""))
    lightning_smp.shutdown()
    dist.barrier()  # no rank tears down its groups while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
