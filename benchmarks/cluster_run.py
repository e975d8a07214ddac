"""One node's ranks of a cluster run (``torchrun`` inside a node namespace of :mod:`lightning_smp.testing.cluster`).

Fits each configuration in turn in the same processes, with the Trainer: a stack of ``Block`` layers (each one FSDP
unit), AdamW, random data in whole micro-batches. At every optimizer-step boundary all ranks meet in a barrier, then
each records the time and its node's link counter (bytes this node has sent to the other so far). One warm-up step
is counted with a :class:`~lightning_smp.accounting.CommCounter`, which gives the collectives one rank issues per
optimizer step and so the bytes that must cross between nodes as gloo runs them
(:func:`~lightning_smp.testing.crossing.cross_node_bytes`).
Global rank 0 writes ``<out>/<config>.json``.

With ``--calibrate``, each configuration's job first calibrates the cluster as ``hybrid_shard_degree="auto"`` with
``links="calibrate"`` does at a job's start (:func:`lightning_smp.planner.calibrate`: the links, and the forward and
backward passes of the job's model and micro-batch on every rank at once), and the record holds the ``links``.

A configuration is ``kind[:degree[:fsdp_version[:k[:accumulation]]]]``: ``ddp``, ``fsdp`` (Lightning's
``FSDPStrategy``, FULL_SHARD over every rank), ``smp`` (:class:`~lightning_smp.HybridShardFSDPStrategy`); ``k``
micro-batches per optimizer step.
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
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_smp.accounting import CommCounter  # noqa: E402
from lightning_smp.engines.textbook import ring_bytes  # noqa: E402
from lightning_smp.names import MESH_AXES, OTHER_AXIS  # noqa: E402
from lightning_smp.testing.crossing import cross_node_bytes, crossing_edges, link_tx_bytes  # noqa: E402


class Block(torch.nn.Module):
    """One FSDP unit: a square layer and its activation."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(x))


class Stack(L.LightningModule):
    """``layers`` blocks; ``example_input_array`` is one rank's micro-batch of ``batch`` samples (for the planner)."""

    def __init__(self, dim: int, layers: int, batch: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block(dim) for _ in range(layers)])
        self.example_input_array = torch.zeros(batch, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.blocks(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class LinkProbe(L.Callback):
    """Time and link bytes at every optimizer-step boundary; the collectives of one warm-up step counted."""

    def __init__(self, k: int, count_step: int) -> None:
        self.k, self.count_step = k, count_step
        self.marks: list[tuple[float, int]] = []
        self.counter: CommCounter | None = None
        self.counts: dict[str, Any] | None = None
        self.groups: dict[str, list[list[int]]] = {}

    def _mark(self) -> None:
        dist.barrier()
        self.marks.append((time.perf_counter(), link_tx_bytes()))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx % self.k:
            return
        if self.counter is not None:  # the counted step is over
            self.counter.__exit__(None, None, None)
            self.counts, self.counter = self.counter.counts(), None
        self._mark()
        if batch_idx // self.k == self.count_step:
            mesh = getattr(trainer.strategy, "core", None) and trainer.strategy.core.device_mesh
            self.groups = axis_groups(mesh)
            self.counter = CommCounter(mesh).__enter__()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark()


def axis_groups(mesh: Any) -> dict[str, list[list[int]]]:
    """Every group of each mesh axis (the world for collectives on no axis)."""
    world = list(range(dist.get_world_size()))
    groups: dict[str, list[list[int]]] = {OTHER_AXIS: [world]}
    if mesh is not None:
        table = mesh.mesh.tolist()
        groups[MESH_AXES[0]] = [list(col) for col in zip(*table)]  # replicate: a column of (replicate, shard)
        groups[MESH_AXES[1]] = [list(row) for row in table]
    return groups


def strategy_for(kind: str, degree: int | None, version: int, accumulation: str | None) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    from benchmarks.workloads import _cpu_fsdp_strategy_class
    from lightning_smp import HybridShardFSDPStrategy

    if kind == "ddp":
        return DDPStrategy()
    if kind == "fsdp":
        return _cpu_fsdp_strategy_class()(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})
    return HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=version, auto_wrap_policy={Block},
                                   gradient_accumulation=accumulation)


def parse_config(text: str) -> dict[str, Any]:
    parts = text.split(":")
    return {"name": text, "kind": parts[0], "degree": int(parts[1]) if len(parts) > 1 else None,
            "version": int(parts[2]) if len(parts) > 2 else 1, "k": int(parts[3]) if len(parts) > 3 else 1,
            "accumulation": parts[4] if len(parts) > 4 else None}


def step(module: Stack, batch: torch.Tensor) -> torch.Tensor:
    """One micro-batch's loss as ``Stack.training_step`` computes it (the planner's and the calibration's step)."""
    return torch.nn.functional.mse_loss(module.blocks(batch), batch)


def calibrated_links(args: argparse.Namespace, nodes: int) -> dict[str, Any]:
    """The cluster calibrated now, in this job, with its model and one rank's micro-batch (the planner's ``Links``)."""
    from dataclasses import asdict

    from lightning_smp.planner import calibrate

    torch.manual_seed(0)
    links = calibrate(int(os.environ["WORLD_SIZE"]) // nodes, model=Stack(args.dim, args.layers),
                      example_input=torch.zeros(args.batch, args.dim), step=step)
    return asdict(links)


def run(config: dict[str, Any], args: argparse.Namespace, nodes: int) -> dict[str, Any] | None:
    k = config["k"]
    links = calibrated_links(args, nodes) if args.calibrate else None
    torch.manual_seed(0)
    model = Stack(args.dim, args.layers)
    steps = args.warmup + args.steps
    g = torch.Generator().manual_seed(1)
    world = int(os.environ["WORLD_SIZE"])
    # whole micro-batches, handed out as they are (``batch_size=None``): a job's loader prefetches its batches in
    # workers, and collating thousands of single samples per step in the training process would be timed as the step
    micro_batches = k * steps * world
    shape = (micro_batches, args.batch, args.dim)
    data = TensorDataset(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    probe = LinkProbe(k, count_step=args.warmup - 1)
    trainer = L.Trainer(accelerator="cpu", devices=world // nodes, num_nodes=nodes,
                        strategy=strategy_for(config["kind"], config["degree"], config["version"],
                                              config["accumulation"]),
                        max_steps=steps, accumulate_grad_batches=k, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe])
    trainer.fit(model, DataLoader(data, batch_size=None))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    record = {"marks": probe.marks, "counts": probe.counts, "groups": probe.groups, "links": links,
              "node": int(os.environ["GROUP_RANK"]), "grad_bytes": grad_bytes}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if dist.get_rank() != 0:
        return None
    return summarize(config, args, gathered)


def summarize(config: dict[str, Any], args: argparse.Namespace, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    node_of = [r["node"] for r in ranks]
    first_of_node = {n: node_of.index(n) for n in sorted(set(node_of))}
    marks = [r["marks"] for r in ranks]
    steps = range(args.warmup, args.warmup + args.steps)  # the measured optimizer steps (after the warm-up)
    # a step's time: from the boundary before it to the one after it, on the rank that got there last
    step_times = [max(m[s + 1][0] - m[s][0] for m in marks) for s in steps]
    per_node = [[marks[r][s + 1][1] - marks[r][s][1] for r in first_of_node.values()] for s in steps]
    sent = [sum(nodes) for nodes in per_node]
    if config["kind"] == "ddp":  # DDP's reducer calls gloo from C++, out of the counter's sight: its textbook
        world = list(range(len(ranks)))
        textbook = ring_bytes("all_reduce", ranks[0]["grad_bytes"], len(world)) * crossing_edges(world, node_of)
    else:
        textbook = cross_node_bytes(ranks[0]["counts"], ranks[0]["groups"], node_of)
    return {**config, "step_times": step_times, "link_bytes": sent, "link_bytes_per_node": per_node,
            "textbook_bytes": textbook,
            "counts": ranks[0]["counts"], "grad_bytes": ranks[0]["grad_bytes"], "node_of": node_of,
            "links": ranks[0]["links"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", required=True, help="comma-separated configurations (see the module docstring)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="samples per rank and micro-batch")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps before the measured ones")
    parser.add_argument("--steps", type=int, default=2, help="measured optimizer steps")
    parser.add_argument("--calibrate", action="store_true", help="calibrate the cluster before each configuration")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    if args.calibrate and not dist.is_initialized():  # the calibration needs the job's process group before the
        dist.init_process_group("gloo")             # first fit; Lightning's strategies take an existing one as it is
    nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    for text in args.configs.split(","):
        result = run(parse_config(text), args, nodes)
        if result is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{text.replace(':', '_')}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
