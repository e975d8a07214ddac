"""What a benchmark run measures, as plain data: sizes of the two modes, the configurations, their order.

Nothing here starts a process or builds a model, so the whole plan of a run (and of ``--large``) can be checked
on any machine.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from lightning_smp.degree import resolve_layout, valid_degrees
from lightning_smp.names import (
    DEFER_ALL_REDUCE,
    EVERY_MICRO_BATCH,
    FULL_SHARD,
    HYBRID_SHARD,
    HYBRID_SHARD_ZERO2,
    NO_SYNC,
)

#: The kinds of configuration, in display order.
Kind = Literal["ddp", "lightning_fsdp", "torch_hsdp", "smp_hybrid", "smp_hybrid_zero2", "torch_fsdp2",
               "smp_hybrid_fsdp2"]
KINDS: tuple[str, ...] = ("ddp", "lightning_fsdp", "torch_hsdp", "smp_hybrid", "smp_hybrid_zero2", "torch_fsdp2",
                          "smp_hybrid_fsdp2")
#: Micro-batches per optimizer step of the gradient-accumulation runs.
MICRO_BATCHES: tuple[int, ...] = (1, 2, 4)
#: The accumulation runs: (kind, gradient_accumulation) at the hybrid degree, for every k of MICRO_BATCHES.
ACCUMULATION_MODES: tuple[tuple[str, str], ...] = (
    ("smp_hybrid", NO_SYNC), ("smp_hybrid", EVERY_MICRO_BATCH), ("smp_hybrid_fsdp2", DEFER_ALL_REDUCE),
)


@dataclass(frozen=True)
class ModelSize:
    """Arguments of :class:`lightning_smp.demo.TinyGPT` (and of its data) for one mode."""

    vocab_size: int
    dim: int
    layers: int
    heads: int
    block_size: int

    def parameter_count(self) -> int:
        """Parameters of ``TinyGPT`` of this size, computed without building it."""
        d, v = self.dim, self.vocab_size
        # attention: in-projection 3d^2 + 3d, out-projection d^2 + d; MLP: 8d^2 + 5d; two LayerNorms: 4d
        block = 12 * d * d + 13 * d
        return v * d + self.block_size * d + self.layers * block + 2 * d + d * v + v


@dataclass(frozen=True)
class Settings:
    """Everything that sizes a benchmark run.

    Attributes:
        mode: ``"quick"`` (CPU, gloo, forked ranks) or ``"large"`` (GPU nodes, NCCL, launched by torchrun/SLURM).
        world_size: ranks; in ``--large`` mode the launcher's world size.
        model: the ``TinyGPT`` size.
        batch_size: sequences per rank and step.
        warmup: steps run before timing (at least 3); the last one is the step whose memory and traffic are
            measured (the first steps are not representative: DDP rebuilds its gradient buckets in the second).
        steps: timed steps per run.
        rounds: runs of every configuration, interleaved (A B C, C B A, ...); the median is over all of them.
        precision: the Trainer's ``precision`` (``"32-true"`` or ``"bf16-mixed"``); the plain-torch loop uses the
            same FSDP ``MixedPrecision``.
        backend: ``"gloo"`` or ``"nccl"``.
        accelerator: ``"cpu"`` or ``"gpu"``.
        seed: model and data seed (the same model, data and optimizer in every configuration).
        lr: AdamW learning rate.
        degrees: hybrid shard degrees to run; default every valid degree (>= 1) of ``world_size``.
        only: configuration names to keep (``None``: all).
        timeout: seconds one run may take before its ranks are killed (quick mode).
    """

    mode: Literal["quick", "large"] = "quick"
    world_size: int = 4
    model: ModelSize = field(default_factory=lambda: QUICK_MODEL)
    batch_size: int = 8
    warmup: int = 3
    steps: int = 10
    # two like programs' ratio moves by about 5% from round to round on 2 shared cores; 12 rounds (an even number:
    # interleaved() reverses every other one) put its 95% interval at about +-3%, inside the 1.03-1.05 targets
    rounds: int = 12
    precision: str = "32-true"
    backend: str = "gloo"
    accelerator: str = "cpu"
    seed: int = 0
    lr: float = 3e-3
    degrees: tuple[int, ...] | None = None
    only: tuple[str, ...] | None = None
    timeout: float = 600.0

    @property
    def steps_per_run(self) -> int:
        """Optimizer steps of one run: warm-up, timed steps, and one more whose start closes the last timed step."""
        return self.warmup + self.steps + 1

    @property
    def samples(self) -> int:
        """Sequences in the data set: enough for every rank to run ``steps_per_run`` distinct batches."""
        return self.steps_per_run * self.batch_size * self.world_size

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Quick mode: a step of tens of ms per process with one thread (4 ranks on 2 CPU cores), five FSDP units.
QUICK_MODEL = ModelSize(vocab_size=256, dim=128, layers=4, heads=4, block_size=32)
#: ``--large``: about 1.03 B parameters (20 blocks of width 2048), sequences of 1024 tokens.
LARGE_MODEL = ModelSize(vocab_size=4096, dim=2048, layers=20, heads=16, block_size=1024)


def quick_settings(**overrides: Any) -> Settings:
    """Settings of quick mode (``python -m benchmarks``): 4 CPU ranks, gloo, fp32."""
    return replace(Settings(), **overrides)


def large_settings(world_size: int, **overrides: Any) -> Settings:
    """Settings of ``--large`` (one process per GPU, NCCL, bf16 mixed precision, ~1B parameters)."""
    base = Settings(
        mode="large", world_size=world_size, model=LARGE_MODEL, batch_size=4, warmup=5, steps=20, rounds=2,
        precision="bf16-mixed", backend="nccl", accelerator="gpu", timeout=3600.0,
    )
    return replace(base, **overrides)


@dataclass(frozen=True)
class ConfigSpec:
    """One configuration of the comparison.

    Attributes:
        kind: ``"ddp"`` (Lightning ``DDPStrategy``), ``"lightning_fsdp"`` (Lightning ``FSDPStrategy`` FULL_SHARD),
            ``"torch_hsdp"`` (plain PyTorch FSDP1 on a hand-built mesh with a hand-written loop, no Lightning),
            ``"smp_hybrid"`` / ``"smp_hybrid_zero2"`` (:class:`~lightning_smp.HybridShardFSDPStrategy`),
            ``"torch_fsdp2"`` (plain PyTorch ``fully_shard`` on the same mesh with a hand-written loop) and
            ``"smp_hybrid_fsdp2"`` (the strategy with ``fsdp_version=2``).
        degree: the hybrid shard degree (``None`` for DDP and Lightning FSDP).
        memory_callback: run :class:`~lightning_smp.MemorySavingsCallback` too (to time its overhead).
        micro_batches: ``accumulate_grad_batches`` of a gradient-accumulation run (``None``: a timed run).
        accumulation: the strategy's ``gradient_accumulation`` in an accumulation run.
        find_unused_parameters: passed to Lightning's ``DDPStrategy`` or to the strategy (whose DDP engine, at degree
            1, takes it); ``None``: their defaults (``False`` for DDP, ``True`` for the DDP engine).
    """

    kind: str
    degree: int | None = None
    memory_callback: bool = False
    micro_batches: int | None = None
    accumulation: str | None = None
    find_unused_parameters: bool | None = None

    @property
    def name(self) -> str:
        base = self.kind if self.degree is None else f"{self.kind} d={self.degree}"
        if self.find_unused_parameters is not None:
            base += f" find_unused_parameters={self.find_unused_parameters}"
        if self.micro_batches is not None:
            return f"{base} {self.accumulation} k={self.micro_batches}"
        return f"{base} +memory callback" if self.memory_callback else base

    @property
    def fsdp_version(self) -> int | None:
        """The FSDP engine of a sharded configuration (``None`` for DDP)."""
        if self.kind == "ddp":
            return None
        return 2 if self.kind in ("torch_fsdp2", "smp_hybrid_fsdp2") else 1

    def sharding_strategy(self, world_size: int) -> str:
        """What FSDP runs (``"DDP"`` for DDP): the same SMP rule for our strategy and the plain-torch loop."""
        if self.kind == "ddp":
            return "DDP"
        if self.kind == "lightning_fsdp":
            return FULL_SHARD
        requested = HYBRID_SHARD_ZERO2 if self.kind == "smp_hybrid_zero2" else HYBRID_SHARD
        assert self.degree is not None
        return resolve_layout(world_size, self.degree, requested).sharding_strategy


def benchmark_degrees(world_size: int) -> list[int]:
    """Every valid ``hybrid_shard_degree`` of ``world_size`` except 0 (native, the same as one of the others)."""
    return [d for d in valid_degrees(world_size) if d >= 1]


def hybrid_degree(world_size: int, degrees: Sequence[int]) -> int | None:
    """The degree that shows hybrid sharding best: the largest one strictly between 1 and the world size."""
    inner = [d for d in degrees if 1 < d < world_size]
    return max(inner) if inner else (max(degrees) if degrees else None)


def build_configs(settings: Settings) -> list[ConfigSpec]:
    """The configurations of a run, in the order one round runs them.

    The runs a target compares are neighbours, so that slow drifts of the machine's load hit both sides of a ratio
    alike: each Lightning DDP run sits between the degree-1 runs of both engines with the same
    ``find_unused_parameters``, plain-torch HSDP next to ``smp_hybrid`` at the same degree, and ``smp_hybrid`` with
    and without the memory callback. (:func:`interleaved` reverses every other round, so each side of a pair runs
    first as often as second.)
    """
    degrees = list(settings.degrees or benchmark_degrees(settings.world_size))
    for degree in degrees:
        resolve_layout(settings.world_size, degree)  # HybridShardConfigError for a bad --degrees
    main = hybrid_degree(settings.world_size, degrees)
    if 1 in degrees:
        # degree 1 runs the DDP engine: each Lightning DDP run between the degree-1 runs of both engines told the same
        # find_unused_parameters (False, then the DDP engine's default, True)
        beside_ddp = [ConfigSpec("smp_hybrid", 1, find_unused_parameters=False), ConfigSpec("ddp"),
               ConfigSpec("smp_hybrid_fsdp2", 1, find_unused_parameters=False),
               ConfigSpec("smp_hybrid", 1), ConfigSpec("ddp", find_unused_parameters=True),
               ConfigSpec("smp_hybrid_fsdp2", 1)]
    else:
        beside_ddp = [ConfigSpec("ddp"), ConfigSpec("ddp", find_unused_parameters=True)]
    configs = [*beside_ddp, ConfigSpec("lightning_fsdp")]
    for degree in degrees:
        configs.append(ConfigSpec("torch_hsdp", degree))
        if degree != 1:  # degree 1's smp_hybrid runs are next to DDP's
            configs.append(ConfigSpec("smp_hybrid", degree))
        if degree == main:
            configs.append(ConfigSpec("smp_hybrid", degree, memory_callback=True))
        configs.append(ConfigSpec("smp_hybrid_zero2", degree))
        configs.append(ConfigSpec("torch_fsdp2", degree))
        if degree != 1:
            configs.append(ConfigSpec("smp_hybrid_fsdp2", degree))
    if settings.only:
        wanted = set(settings.only)
        unknown = wanted - {c.name for c in configs} - {c.name for c in _accumulation_specs(settings)}
        if unknown:
            from lightning_smp.errors import HybridShardConfigError

            raise HybridShardConfigError(
                f"--only {sorted(unknown)} names no configuration of this run. Valid names: "
                + ", ".join(repr(c.name) for c in configs)
            )
        configs = [c for c in configs if c.name in wanted]
    return configs


def _accumulation_specs(settings: Settings) -> list[ConfigSpec]:
    degrees = list(settings.degrees or benchmark_degrees(settings.world_size))
    main = hybrid_degree(settings.world_size, degrees)
    if main is None:
        return []
    return [ConfigSpec(kind, main, micro_batches=k, accumulation=mode)
            for kind, mode in ACCUMULATION_MODES for k in MICRO_BATCHES]


def build_accumulation_configs(settings: Settings) -> list[ConfigSpec]:
    """The gradient-accumulation runs (bytes and memory only, so one round): FSDP1 ``no_sync``, FSDP1 reducing every
    micro-batch and FSDP2's deferred all-reduce, for k in :data:`MICRO_BATCHES`, at the hybrid degree (with
    ``--only``, those it names)."""
    specs = _accumulation_specs(settings)
    return [c for c in specs if c.name in set(settings.only)] if settings.only else specs


def interleaved(configs: Sequence[ConfigSpec], rounds: int) -> list[tuple[int, ConfigSpec]]:
    """``[(round, config)]``: every configuration once per round, every other round in reverse (A B C, C B A, ...).

    A run may pay for what ran just before it (the state the previous run's processes left the machine in): reversing
    every other round puts each configuration before and after each neighbour equally often in an even number of
    rounds.
    """
    return [(r, c) for r in range(rounds) for c in (configs if r % 2 == 0 else list(reversed(configs)))]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of ``python -m benchmarks`` (see :mod:`benchmarks` for examples)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Memory, traffic and step time of lightning_smp against DDP, Lightning FSDP and plain-torch HSDP.",
    )
    parser.add_argument("--large", action="store_true",
                        help="GPU nodes: NCCL, bf16-mixed, ~1B parameters; run under torchrun or srun (one process per GPU)")
    parser.add_argument("--cpu", action="store_true",
                        help="with --large: CPU ranks (gloo, fp32) instead of GPUs, to try the launch path anywhere")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks of quick mode (default 4); --large takes the launcher's WORLD_SIZE")
    parser.add_argument("--degrees", type=int, nargs="+", default=None,
                        help="hybrid shard degrees to run (default: every valid degree of the world size)")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="run only these configurations, e.g. 'ddp' 'smp_hybrid d=2'")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved runs of every configuration")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=None, help="steps before timing (at least 3; the last one is measured)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per rank and step")
    parser.add_argument("--dim", type=int, default=None, help="model width (default: the mode's)")
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks (default: the mode's)")
    parser.add_argument("--out", default=None,
                        help="results folder (default benchmarks/results); files are named quick.* or large.*")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the PNG plot")
    parser.add_argument("--report-only", metavar="JSON", default=None,
                        help="run nothing: rebuild the table, markdown and plot from a results JSON")
    return parser.parse_args(argv)


def settings_from_dict(values: dict[str, Any]) -> Settings:
    """Rebuild :class:`Settings` from :meth:`Settings.as_dict` (e.g. the ``settings`` of a results JSON)."""
    values = dict(values)
    values["model"] = ModelSize(**values["model"])
    for key in ("degrees", "only"):
        if values.get(key) is not None:
            values[key] = tuple(values[key])
    return Settings(**values)


def settings_from_args(args: argparse.Namespace, launcher_world_size: int | None = None) -> Settings:
    """Turn parsed arguments into :class:`Settings` (``launcher_world_size``: ``WORLD_SIZE`` under ``--large``)."""
    from lightning_smp.errors import HybridShardConfigError

    overrides: dict[str, Any] = {}
    for name in ("rounds", "steps", "warmup", "batch_size"):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                raise HybridShardConfigError(f"--{name.replace('_', '-')}={value} must be at least 1.")
            overrides[name] = value
    if overrides.get("warmup", 3) < 3:
        raise HybridShardConfigError(
            f"--warmup={overrides['warmup']} is too short: memory and traffic are measured on the last warm-up step,"
            " which must be the third step or later (DDP rebuilds its gradient buckets, with two small broadcasts,"
            " in the second). Fix: --warmup 3 or more."
        )
    if args.degrees:
        overrides["degrees"] = tuple(args.degrees)
    if args.only:
        overrides["only"] = tuple(args.only)
    if args.large:
        world = launcher_world_size or args.world_size or 1
        if args.cpu:
            # Lightning's FSDP precision plugin autocasts on "cuda" only, so CPU ranks train in fp32
            overrides.update(backend="gloo", accelerator="cpu", precision="32-true")
        settings = large_settings(world, **overrides)
    else:
        if args.cpu:
            raise HybridShardConfigError("--cpu only applies to --large (quick mode always runs on CPU).")
        world = args.world_size or 4
        if world < 2:
            raise HybridShardConfigError(f"--world-size={world} must be at least 2 (a comparison of data parallelism).")
        settings = quick_settings(world_size=world, **overrides)
    if args.dim is not None or args.layers is not None:
        model = replace(settings.model, dim=args.dim or settings.model.dim, layers=args.layers or settings.model.layers)
        if model.dim % model.heads:
            raise HybridShardConfigError(f"--dim={model.dim} must be divisible by the {model.heads} attention heads.")
        settings = replace(settings, model=model)
    build_configs(settings)  # validates --degrees and --only now, before any process starts
    return settings
