"""``lightning-smp plan``: the planner from the command line.

The model comes from a LightningCLI config (``--config fit.yaml``, with ``--model.class_path``/``--model.init_args.*``
overrides; it is built on the meta device, so a 70B model costs nothing) or, for quick what-ifs, from a parameter
count and a transformer shape (``--params 7B --layers 32 --hidden 4096 --heads 32``). The SMP keys come as
``lightning-smp fit`` takes them: the config's ``smp:`` section with ``--smp "{...}"`` and ``--smp.KEY VALUE`` over it
(the same argument, :mod:`lightning_smp.config.section`), under the strategy's own arguments, over the environment's
sources; ``--smp.replica_sync "{every: 20}"`` plans semi-synchronous replica groups. The world, the budget and the
links come from flags (``--nodes``, ``--devices``, ``--memory-budget``, ``--preset``; every flag also with
underscores, as LightningCLI spells them), else from the config's ``trainer:`` section and the SMP keys. Prints the
table, and writes JSON (``--json``) and a plot (``--plot``)::

    lightning-smp plan --params 7B --layers 32 --hidden 4096 --heads 32 --seq_len 4096 --micro_batch 1 \\
        --nodes 1 --devices 8 --memory-budget 80GB --preset aws-p4d --precision bf16-mixed \\
        --activation-checkpointing true
    lightning-smp plan --config examples/configs/hybrid_auto.yaml --json plan.json
    lightning-smp plan --config examples/configs/replica_sync.yaml --smp.replica_sync "{every: 20, backup: cpu}"
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.nn import Module

from lightning_smp.config import CALIBRATE, SMPConfig, resolve_config
from lightning_smp.config.keys import IMPLEMENTED_KEYS
from lightning_smp.config.section import add_smp_section, section_values
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.links import DEFAULT_PRESET, LINK_PRESETS, Links, save_links
from lightning_smp.names import HYBRID_SHARD, STRATEGY_NAMES
from lightning_smp.planner.activations import transformer_activation_bytes
from lightning_smp.planner.budget import default_budget
from lightning_smp.planner.choose import plan
from lightning_smp.planner.result import Plan
from lightning_smp.planner.shape_model import ShapeModel, _Block, parse_count
from lightning_smp.planner.timing import transformer_flops
from lightning_smp.sizes import UNITS, parse_bytes


def _parser() -> Any:
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(prog="lightning-smp plan", description="Choose hybrid_shard_degree for a model.",
                            default_meta=False)
    parser.add_argument("--config", action=ActionConfigFile, help="A LightningCLI config (model, trainer, smp).")
    parser.add_subclass_arguments(Module, "model", required=False)
    for section in ("trainer", "data", "optimizer", "lr_scheduler"):  # read from a LightningCLI config
        parser.add_argument(f"--{section}", type=Any, default=None)
    add_smp_section(parser)  # (the same argument as lightning-smp fit's)
    parser.add_argument("--seed_everything", type=Any, default=None)
    parser.add_argument("--ckpt_path", type=Any, default=None)
    parser.add_argument("--params", type=str | None, default=None, help="Parameter count (e.g. 7B), without a model.")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq_len", "--seq-len", type=int, default=4096)
    parser.add_argument("--micro_batch", "--micro-batch", type=int, default=1)
    parser.add_argument("--nodes", type=int | None, default=None, help="Default: trainer.num_nodes, else 1.")
    parser.add_argument("--devices", type=int | None, default=None, help="Per node. Default: trainer.devices, else 8.")
    parser.add_argument("--memory_budget", "--memory-budget", type=str | None, default=None,
                        help=f"Per device, e.g. 80GB (units: {', '.join(u for u in UNITS if u)}); default: the"
                             " SMP keys' memory_budget, else this machine's free device memory.")
    parser.add_argument("--preset", type=str | None, default=None,
                        help=f"Links: {', '.join(LINK_PRESETS)}, or a JSON file (--save_links); default: the SMP"
                             f" keys' links, else {DEFAULT_PRESET}.")
    parser.add_argument("--calibrate", type=bool, default=False,
                        help="Measure the links and the compute of this job (run under torchrun, every rank).")
    parser.add_argument("--calibrate_model", "--calibrate-model", type=bool, default=False,
                        help="With --calibrate: time the compute as forward and backward passes of the model"
                             " (--model or --config, with example_input_array; built unsharded on each rank, so it"
                             " must fit on one device) instead of a matrix multiplication.")
    parser.add_argument("--save_links", "--save-links", type=Path | None, default=None,
                        help="Write the links used (a calibration) as JSON, for --preset FILE.")
    parser.add_argument("--fsdp_version", "--fsdp-version", type=int | None, default=None,
                        help="Default: the SMP keys' fsdp_version.")
    parser.add_argument("--precision", type=str | None, default=None, help="Default: trainer.precision, else 32-true.")
    parser.add_argument("--optimizer_name", "--optimizer-name", type=str | None, default=None,
                        help="adamw, adam, sgd, sgd_momentum (default: the model's configure_optimizers, else adamw).")
    parser.add_argument("--accumulate", type=int | None, default=None, help="Micro-batches per optimizer step.")
    parser.add_argument("--activation_checkpointing", "--activation-checkpointing", type=bool | None, default=None,
                        help="true: every layer checkpointed; false: never; default: turned on by the planner when"
                             " nothing fits without it.")
    parser.add_argument("--attention_scores", "--attention-scores", type=bool, default=False,
                        help="The model materialises the s x s attention scores (no fused/flash attention).")
    parser.add_argument("--activation_bytes", "--activation-bytes", type=str | None, default=None,
                        help="Override the activations, e.g. 12GB.")
    parser.add_argument("--wrap", type=list[str] | None, default=None, help="Class paths of the FSDP units.")
    parser.add_argument("--headroom", type=float, default=0.1)
    parser.add_argument("--json", type=Path | None, default=None, help="Write the plan as JSON.")
    parser.add_argument("--plot", type=Path | None, default=None, help="Save per-rank memory by degree (PNG).")
    return parser


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise HybridShardConfigError(f"{path!r} cannot be imported. Fix: give a class path such as"
                                     " 'torch.nn.TransformerEncoderLayer'.") from None


def _strategy_args(trainer: dict[str, Any]) -> dict[str, Any]:
    """``trainer.strategy.init_args`` of a config (a dict, or the Namespace jsonargparse resolves a class path to)."""
    strategy = trainer.get("strategy")
    if isinstance(strategy, str):  # a registered name: what it registers
        return next((dict(args) for name, _, args in STRATEGY_NAMES if name == strategy), {})
    init_args = strategy.get("init_args") if isinstance(strategy, dict) else getattr(strategy, "init_args", None)
    if init_args is None:
        return {}
    return {k: v for k, v in (init_args.items() if isinstance(init_args, dict) else vars(init_args).items())
            if v is not None}


def smp_config(cfg: Any) -> SMPConfig:
    """The SMP configuration of parsed arguments, as ``lightning-smp fit`` resolves it from the same config and
    flags: the strategy's own arguments (``init_args``, or what a registered name passes) over the ``smp:`` section
    over ``lightning_smp.init`` and the environment's sources (:func:`~lightning_smp.config.resolve_config`)."""
    trainer = cfg.trainer if isinstance(cfg.trainer, dict) else {}
    explicit = {key: value for key, value in _strategy_args(trainer).items() if key in IMPLEMENTED_KEYS}
    return resolve_config(explicit or None, cli=section_values(cfg.smp) or {})


def plan_from_args(argv: list[str]) -> tuple[Plan, Any]:
    """Parse ``argv`` (what follows ``lightning-smp plan``) and plan; the plan and the parsed arguments. Raises
    ``HybridShardConfigError``."""
    parser = _parser()
    cfg = parser.parse_args(argv)
    config = smp_config(cfg)
    trainer = cfg.trainer if isinstance(cfg.trainer, dict) else {}
    strategy = _strategy_args(trainer)
    precision = cfg.precision or str(trainer.get("precision") or "32-true")
    nodes = cfg.nodes or int(trainer.get("num_nodes") or 1)
    given = trainer.get("devices")
    if cfg.devices is None and given is not None and not (isinstance(given, int) and given > 0):
        raise HybridShardConfigError(f"trainer.devices={given!r} does not say how many devices a node has. Fix: pass"
                                     " --devices N (per node).")
    devices = cfg.devices or given or 8
    version = cfg.fsdp_version or config.fsdp_version
    wrap = cfg.wrap or strategy.get("auto_wrap_policy")  # a list of class paths, as LightningCLI configs give it
    policy = ({_import(p) if isinstance(p, str) else p for p in wrap}
              if isinstance(wrap, (list, tuple, set, frozenset)) else None)
    activation_bytes = None if cfg.activation_bytes is None else parse_bytes(cfg.activation_bytes, "--activation_bytes")
    example_input = None
    checkpoint: set[type[Module]] | None = None
    flops: tuple[float, float] | None = None
    may_checkpoint: Any = None if cfg.activation_checkpointing is None else False
    if cfg.params is not None:
        dtype = torch.bfloat16 if precision.startswith("bf16-true") else torch.float16 if precision.startswith(
            "16-true") else torch.float32
        with torch.device("meta"):
            model: Module = ShapeModel(parse_count(cfg.params), cfg.layers, cfg.hidden, cfg.vocab).to(dtype)
        policy = policy or {_Block}
        def shape_figures(checkpointing: bool) -> tuple[int, tuple[float, float]]:
            return transformer_activation_bytes(
                layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, seq_len=cfg.seq_len, micro_batch=cfg.micro_batch,
                checkpointing=checkpointing, bytes_per_value=2 if "16" in precision else 4,
                attention_scores=cfg.attention_scores), transformer_flops(
                parse_count(cfg.params), cfg.micro_batch * cfg.seq_len, cfg.layers, cfg.hidden, cfg.seq_len,
                checkpointing=checkpointing)

        estimated, flops = shape_figures(bool(cfg.activation_checkpointing))
        if activation_bytes is None:
            activation_bytes = estimated
            if cfg.activation_checkpointing is None:  # the planner may turn it on
                may_checkpoint = (("every layer",), *shape_figures(True))
    elif cfg.model is not None:
        with torch.device("meta"):
            model = parser.instantiate_classes(cfg).model
        example_input = getattr(model, "example_input_array", None)
        classes = strategy.get("activation_checkpointing_policy") or strategy.get("activation_checkpointing")
        if isinstance(classes, type):
            classes = {classes}
        if isinstance(classes, (set, frozenset, list, tuple)) and classes:
            checkpoint = {_import(c) if isinstance(c, str) else c for c in classes}  # as the strategy would
        elif cfg.activation_checkpointing:
            if not policy:
                raise HybridShardConfigError(
                    "--activation_checkpointing true needs the modules to checkpoint. Fix: give --wrap CLASS_PATHS, or"
                    " the strategy's auto_wrap_policy or activation_checkpointing_policy in the config."
                )
            checkpoint = set(policy)  # the FSDP units, checkpointed
    else:
        raise HybridShardConfigError("lightning-smp plan needs a model: --config FILE / --model.class_path PATH, or"
                                     " --params COUNT with the layer shape (--layers, --hidden, --heads).")
    budget = cfg.memory_budget or config.memory_budget
    if budget is None:
        accelerator = torch.accelerator.current_accelerator()  # this machine's, whatever its type
        device = accelerator if accelerator is not None else torch.device("cpu")
        budget = default_budget(device, devices)
    accumulate = cfg.accumulate or int(trainer.get("accumulate_grad_batches") or 1)
    timed: Module | None = None
    if cfg.calibrate and cfg.calibrate_model:
        if cfg.model is None or example_input is None:
            raise HybridShardConfigError(
                "--calibrate_model true times the model, and there is none with an example_input_array. Fix: give"
                " --model / --config with a LightningModule that sets example_input_array, or drop --calibrate_model"
                " (a matrix multiplication's rate)."
            )
        timed = parser.instantiate_classes(cfg).model  # for real this time: its passes are timed
    preset = cfg.preset or config.links or DEFAULT_PRESET
    calibrating = cfg.calibrate or preset == CALIBRATE  # (links: calibrate measures, as the strategy's "auto" does)
    links = _calibrated(devices, timed, example_input, precision) if calibrating else preset
    return plan(model, world_size=nodes * devices, devices_per_node=devices, budget_bytes=budget,
                fsdp_version=version, auto_wrap_policy=policy, optimizer=cfg.optimizer_name, precision=precision,
                sharding_strategy=strategy.get("sharding_strategy") or HYBRID_SHARD,
                micro_batches=accumulate, example_input=example_input, checkpoint=checkpoint,
                activation_bytes=activation_bytes, headroom=cfg.headroom, links=links, flops=flops,
                may_checkpoint=may_checkpoint,
                replica_sync=config.replica_sync), cfg


def save_plot(result: Plan, path: Path) -> None:
    """Per-rank memory by degree (model state, transient, activations stacked) against the budget."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HybridShardConfigError("--plot needs matplotlib. Fix: pip install matplotlib.") from None
    gib = 2**30
    labels = [str(r.degree) for r in result.rows]
    parts = [("model state", [r.model_state_bytes / gib for r in result.rows]),
             ("transient + buffers", [(r.transient_bytes + r.buffer_bytes) / gib for r in result.rows]),
             ("activations", [r.activation_bytes / gib for r in result.rows])]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(labels)
    for name, values in parts:
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(result.budget_bytes / gib / (1 + result.headroom), color="red", linestyle="--",
               label=f"budget / (1 + {result.headroom:.0%} headroom)")
    ax.set_xlabel("hybrid_shard_degree")
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"{result.world_size} ranks: degree {result.degree} chosen")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _calibrated(devices: int, model: Module | None = None, example_input: Any = None,
                precision: str = "32-true") -> Links:
    """:func:`~.calibrate.calibrate` under torchrun: the process group from its environment, ``devices`` per node."""
    import torch.distributed as dist

    from lightning_smp.planner.calibrate import calibrate

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise HybridShardConfigError(
            "--calibrate true (or links: calibrate) measures the links of a running job: run every rank of it, e.g."
            " `torchrun --nnodes M --nproc_per_node N -m lightning_smp plan --calibrate true --devices N ...` (or"
            " calibrate in your training script and save_links the result)."
        )
    if not dist.is_initialized():
        accelerator = torch.accelerator.current_accelerator()
        backend = dist.get_default_backend_for_device(accelerator) if accelerator is not None else "gloo"
        dist.init_process_group(backend)
    return calibrate(devices, model=model, example_input=example_input, precision=precision)


def main(argv: list[str]) -> None:
    """``lightning-smp plan ...``: print the plan; exit with the error message when nothing fits. Under torchrun
    (``--calibrate true``) only rank 0 prints and writes."""
    import torch.distributed as dist

    try:
        result, cfg = plan_from_args(argv)
    except HybridShardConfigError as err:
        sys.exit(f"lightning-smp plan: error: {err}")
    finally:
        if dist.is_available() and dist.is_initialized():  # the calibration's process group
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    result.print()
    if cfg.save_links is not None:
        save_links(result.links, cfg.save_links)
    if cfg.json is not None:
        cfg.json.write_text(json.dumps(result.to_dict(), indent=2))
    if cfg.plot is not None:
        save_plot(result, cfg.plot)


__all__ = ["main", "plan_from_args", "save_plot", "smp_config"]
