"""What one rank runs for one configuration (a timed run, or a gradient-accumulation run).

Every configuration trains the same :class:`~lightning_smp.demo.TinyGPT` (FSDP units: one per
:class:`~lightning_smp.demo.Block`, plus the root) on the same :class:`~lightning_smp.demo.MarkovTokens` with
AdamW, from the same seed. A run is ``warmup`` steps, then ``steps`` timed steps, then one more step whose start
closes the last timed step.

What each run measures, and where, is :mod:`benchmarks.probe`.
"""

from __future__ import annotations

import gc
import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import Module
from torch.utils.data import DataLoader, Dataset

from benchmarks.probe import StepProbe, current_rss, lightning_probe_callback, reset_peak_rss
from benchmarks.settings import ConfigSpec, Settings
from lightning_smp.accounting.memory import peak_memory
from lightning_smp.demo import Block, MarkovTokens, TinyGPT
from lightning_smp.names import (
    FULL_SHARD,
    HYBRID_SHARD,
    HYBRID_SHARD_ZERO2,
    HYBRID_STRATEGIES,
    MESH_AXES,
    NO_SHARD,
    REPLICATE_AXIS,
    SHARD_AXIS,
)


class BenchGPT(TinyGPT):
    """``TinyGPT`` without per-step logging: a ``sync_dist`` log is one extra all-reduce that the plain loop would
    not make, and this benchmark compares the training step itself."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)


def lm_loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """The loss ``TinyGPT`` trains with (next-token cross-entropy), for the plain loop."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def make_dataset(settings: Settings) -> MarkovTokens:
    """The token data every configuration reads (each rank reads its own slice, as a DistributedSampler gives)."""
    m = settings.model
    return MarkovTokens(m.vocab_size, m.block_size + 1, settings.samples, seed=settings.seed)


def make_model(settings: Settings) -> BenchGPT:
    torch.manual_seed(settings.seed)
    m = settings.model
    return BenchGPT(m.vocab_size, m.dim, m.layers, m.heads, m.block_size, lr=settings.lr)


def make_optimizer(params: Any, settings: Settings) -> torch.optim.Optimizer:
    """The optimizer of :meth:`TinyGPT.configure_optimizers`, for the plain loop."""
    return torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)


def quiet() -> None:
    """Keep the ranks' output to errors: Lightning's banners and warnings repeat once per run and rank."""
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_smp"):
        logging.getLogger(name).setLevel(logging.ERROR)


# ---------------------------------------------------------------------------------------------- Lightning runs


def _cpu_fsdp_strategy_class() -> type:
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning's ``FSDPStrategy`` with the one change CPU needs: FSDP1 gets ``device_id`` as a device.

        Lightning passes ``root_device.index``, which is ``None`` on CPU, and FSDP1 then refuses to run
        ("FSDP needs a non-CPU accelerator device"); on GPUs the unchanged ``FSDPStrategy`` is used.
        """

        def _setup_model(self, model: Module) -> Module:
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel(
                module=model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy, device_id=self.root_device, **self.kwargs,
            )

    return CPUFSDPStrategy


def lightning_strategy(spec: ConfigSpec, device: torch.device) -> Any:
    """The Lightning strategy object of a configuration (not ``torch_hsdp``)."""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from lightning_smp import HybridShardFSDPStrategy

    unused = {} if spec.find_unused_parameters is None else {"find_unused_parameters": spec.find_unused_parameters}
    if spec.kind == "ddp":
        return DDPStrategy(**unused)
    if spec.kind == "lightning_fsdp":
        cls = _cpu_fsdp_strategy_class() if device.type == "cpu" else FSDPStrategy
        return cls(sharding_strategy=FULL_SHARD, auto_wrap_policy={Block})
    if spec.kind in ("smp_hybrid", "smp_hybrid_zero2", "smp_hybrid_fsdp2"):
        flavour = HYBRID_SHARD_ZERO2 if spec.kind == "smp_hybrid_zero2" else HYBRID_SHARD
        return HybridShardFSDPStrategy(hybrid_shard_degree=spec.degree, sharding_strategy=flavour,
                                       auto_wrap_policy={Block}, fsdp_version=spec.fsdp_version,
                                       gradient_accumulation=spec.accumulation, **unused)
    raise ValueError(f"{spec.kind!r} is not a Lightning configuration")


def run_lightning(spec: ConfigSpec, settings: Settings, dataset: Dataset, device: torch.device) -> StepProbe:
    """Fit the model once with a Lightning strategy in this (already distributed) process; return the probe."""
    import lightning as L
    from lightning.pytorch.accelerators import CPUAccelerator

    from lightning_smp.callbacks import MemorySavingsCallback

    probe = StepProbe(settings)
    callbacks: list[Any] = [lightning_probe_callback(probe)]
    if spec.memory_callback:
        # the user's default, minus printing and the JSON file (output, not overhead of training)
        callbacks.append(MemorySavingsCallback(print_table=False, filename=None))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", settings.world_size))
    # Lightning refuses the string "cpu" for FSDPStrategy; an accelerator instance is accepted.
    accelerator = CPUAccelerator() if device.type == "cpu" else settings.accelerator
    trainer = L.Trainer(
        strategy=lightning_strategy(spec, device), accelerator=accelerator, devices=local_world,
        num_nodes=settings.world_size // local_world, precision=settings.precision, max_steps=settings.steps_per_run,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks, deterministic=False,
    )
    loader = DataLoader(dataset, batch_size=settings.batch_size, shuffle=False)
    try:
        trainer.fit(make_model(settings), loader)
    finally:
        probe.close()
    del trainer
    return probe


# ---------------------------------------------------------------------------------------------- plain PyTorch


def plain_mixed_precision(settings: Settings) -> Any:
    """The FSDP ``MixedPrecision`` Lightning uses for ``settings.precision`` (``None`` for fp32), for the plain loop."""
    from torch.distributed.fsdp import MixedPrecision

    if settings.precision in ("32-true", "32"):
        return None
    if settings.precision in ("bf16-mixed", "bf16-true"):
        return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    raise ValueError(f"precision={settings.precision!r} is not supported by the plain loop")


def run_torch_hsdp(spec: ConfigSpec, settings: Settings, dataset: Dataset, device: torch.device) -> StepProbe:
    """The floor: FSDP1 on a hand-built ``(replicate, shard)`` mesh and a hand-written loop, no Lightning.

    The sharding strategy follows the same SMP rule as ``smp_hybrid`` (HYBRID_SHARD for a degree strictly between
    1 and the world size, FULL_SHARD on the whole world for degree = world, NO_SHARD over all ranks for degree 1),
    so each degree compares like with like.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    world, degree = settings.world_size, spec.degree
    assert degree is not None
    strategy = spec.sharding_strategy(world)
    mesh = init_device_mesh(device.type, (world // degree, degree), mesh_dim_names=MESH_AXES)
    if strategy in HYBRID_STRATEGIES:
        fsdp_mesh = mesh
    else:  # a 1-D mesh: FULL_SHARD over the shard axis, NO_SHARD over the replicate axis
        fsdp_mesh = mesh[REPLICATE_AXIS if strategy == NO_SHARD else SHARD_AXIS]
    model = make_model(settings).to(device)  # same seed on every rank: replicas start equal without a broadcast
    fsdp = FSDP(
        model, device_mesh=fsdp_mesh, sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device, use_orig_params=True,
        mixed_precision=plain_mixed_precision(settings),
    )
    return plain_loop(fsdp, mesh, settings, dataset, device)


def plain_loop(model: Module, mesh: Any, settings: Settings, dataset: Dataset, device: torch.device) -> StepProbe:
    """The hand-written loop of the plain-PyTorch floors (FSDP1 and FSDP2 alike), measured by the same probe as the
    Lightning runs: AdamW, a DistributedSampler's slice of the data, autocast for ``bf16-mixed``."""
    from torch.utils.data.distributed import DistributedSampler

    optimizer = make_optimizer(model.parameters(), settings)
    sampler = DistributedSampler(dataset, num_replicas=settings.world_size, rank=dist.get_rank(), shuffle=False)
    loader = DataLoader(dataset, batch_size=settings.batch_size, sampler=sampler)
    groups = {axis: mesh.get_group(axis) for axis in MESH_AXES}
    autocast = settings.precision == "bf16-mixed"
    probe = StepProbe(settings)
    model.train()
    try:
        for index, batch in enumerate(loader):
            if index == settings.steps_per_run:
                break
            batch = batch.to(device)
            probe.batch_start(index, groups)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = lm_loss(model(batch[:, :-1]), batch)
            loss.backward()
            probe.before_optimizer_step(index, model)
            optimizer.step()
            probe.batch_end(index, model, [optimizer], groups)
    finally:
        probe.close()
    return probe


def plain_mp_policy(settings: Settings) -> Any:
    """The ``MixedPrecisionPolicy`` the strategy's FSDP2 engine uses for ``settings.precision``, for the plain loop."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if settings.precision in ("32-true", "32"):
        return MixedPrecisionPolicy()
    if settings.precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(f"precision={settings.precision!r} is not supported by the plain loop")


def run_torch_fsdp2(spec: ConfigSpec, settings: Settings, dataset: Dataset, device: torch.device) -> StepProbe:
    """The FSDP2 floor: plain ``fully_shard`` on the same mesh as ``smp_hybrid_fsdp2`` (2-D for hybrid sharding,
    the shard axis when one group is the world, ``(world, 1)`` for degree 1), each block then the root, and a
    hand-written loop; no Lightning."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world, degree = settings.world_size, spec.degree
    assert degree is not None
    mesh = init_device_mesh(device.type, (world // degree, degree), mesh_dim_names=MESH_AXES)
    fsdp_mesh = mesh[SHARD_AXIS] if spec.sharding_strategy(world) == FULL_SHARD else mesh
    model = make_model(settings).to(device)  # same seed on every rank: replicas start equal without a broadcast
    policy = plain_mp_policy(settings)
    for block in model.modules():
        if isinstance(block, Block):
            fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=policy)
    return plain_loop(model, mesh, settings, dataset, device)


# ---------------------------------------------------------------------------------------------- accumulation


def run_accumulation(spec: ConfigSpec, settings: Settings, dataset: Dataset, device: torch.device) -> dict[str, Any]:
    """Two optimizer steps of ``spec.micro_batches`` micro-batches each; the memory report of the second one: bytes
    across replicas and inside the shard group, and the most gradient memory held during the step."""
    import lightning as L
    from lightning.pytorch.accelerators import CPUAccelerator

    from lightning_smp.callbacks import MemorySavingsCallback

    callback = MemorySavingsCallback(comm_step=2, print_table=False, log_metrics=False, filename=None)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", settings.world_size))
    trainer = L.Trainer(
        strategy=lightning_strategy(spec, device), accelerator=CPUAccelerator() if device.type == "cpu" else
        settings.accelerator, devices=local_world, num_nodes=settings.world_size // local_world,
        precision=settings.precision, max_steps=2, accumulate_grad_batches=spec.micro_batches, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[callback],
    )
    trainer.fit(make_model(settings), DataLoader(dataset, batch_size=settings.batch_size, shuffle=False))
    report = callback.reports["fit_end"][dist.get_rank()]
    comm = report["comm"]
    return {
        "grads_bytes": report["grads_bytes"],
        "params_bytes": report["params_bytes"],
        "unsharded_grads_bytes": report["unsharded_grads_bytes"],
        "replicate_bytes": sum(e["bytes"] for e in comm.get(REPLICATE_AXIS, {}).values()),
        "shard_bytes": sum(e["bytes"] for e in comm.get(SHARD_AXIS, {}).values()),
        "comm_mismatch": report["comm_mismatch"],
        "backward_passes": report["backward_passes"],
    }


# ---------------------------------------------------------------------------------------------- one rank, one run


def run_config(spec: ConfigSpec, settings: Settings, dataset: Dataset, device: torch.device) -> dict[str, Any]:
    """Run one configuration on this rank (the process group must exist); return this rank's record."""
    quiet()
    if device.type == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.reset_peak_memory_stats(device)
    reset_peak_rss()
    start_rss = current_rss()
    if spec.micro_batches is not None:
        return {"config": spec.name, "kind": spec.kind, "degree": spec.degree, "rank": dist.get_rank(),
                "micro_batches": spec.micro_batches, "accumulation": spec.accumulation,
                **run_accumulation(spec, settings, dataset, device)}
    if spec.kind == "torch_hsdp":
        probe = run_torch_hsdp(spec, settings, dataset, device)
    elif spec.kind == "torch_fsdp2":
        probe = run_torch_fsdp2(spec, settings, dataset, device)
    else:
        probe = run_lightning(spec, settings, dataset, device)
    if not probe.measured:
        raise RuntimeError(f"{spec.name}: the measured step {probe.measured_step} never ran")
    record: dict[str, Any] = {
        "config": spec.name,
        "kind": spec.kind,
        "degree": spec.degree,
        "memory_callback": spec.memory_callback,
        "sharding_strategy": spec.sharding_strategy(settings.world_size),
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "threads": torch.get_num_threads(),
        "step_times": probe.step_times(),
        "step_cpu_times": probe.step_times(cpu=True),
        "start_rss_bytes": start_rss,
        **probe.measured,
        **peak_memory(device),
    }
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record
