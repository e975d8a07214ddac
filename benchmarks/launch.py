"""Starting the ranks of a run: forked CPU ranks (quick mode), or the processes torchrun/SLURM started (``--large``).

Quick mode forks fresh ranks for every run from the already-imported parent (well under a second), so each run's
peak memory is its own and no state leaks from one configuration into the next. The ranks look to Lightning
like processes started by an external launcher (``LOCAL_RANK`` is set), so every strategy runs as it would
under ``torchrun``, without re-running this script.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.settings import ConfigSpec, Settings
from benchmarks.workloads import run_config
from lightning_smp.testing import run_distributed


def _forked_rank(rank: int, world_size: int, spec: ConfigSpec, settings: Settings, dataset: Any) -> dict[str, Any]:
    return run_config(spec, settings, dataset, torch.device("cpu"))


def run_forked(spec: ConfigSpec, settings: Settings, dataset: Any) -> list[dict[str, Any]]:
    """Run one configuration on ``settings.world_size`` freshly forked CPU ranks; return their records by rank.

    Raises ``RuntimeError`` with the failing rank's traceback; ranks still running after ``settings.timeout``
    seconds are killed.
    """
    try:
        return run_distributed(_forked_rank, settings.world_size, spec, settings, dataset, backend=settings.backend,
                               timeout=settings.timeout)
    except RuntimeError as err:
        raise RuntimeError(f"{spec.name}: {err}") from None


def launcher_world_size() -> int | None:
    """``WORLD_SIZE`` set by torchrun (or by ``srun`` through torchrun), ``None`` outside a launcher."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def init_launched_process(settings: Settings) -> torch.device:
    """Join the process group of a launcher-started rank (``--large``) and return this rank's device."""
    if "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
        from lightning_smp.errors import HybridShardConfigError

        raise HybridShardConfigError(
            "--large runs one process per GPU started by a launcher, but RANK/LOCAL_RANK are not set."
            " Fix: torchrun --nproc-per-node <gpus> -m benchmarks --large (see python -m benchmarks --help)."
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    if settings.accelerator == "gpu":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(settings.backend)
    return device


def run_in_process(spec: ConfigSpec, settings: Settings, dataset: Any, device: torch.device) -> list[dict[str, Any]]:
    """Run one configuration on every launcher-started rank; every rank returns all ranks' records."""
    record = run_config(spec, settings, dataset, device)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    return sorted(gathered, key=lambda r: r["rank"])


def run_all(plan: Sequence[tuple[int, ConfigSpec]], run_one: Callable[[ConfigSpec], list[dict[str, Any]]],
            progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run ``plan`` (``[(round, config)]``) in order with ``run_one``; every record gets its round."""
    records: list[dict[str, Any]] = []
    for i, (round_index, spec) in enumerate(plan):
        progress(f"[{i + 1}/{len(plan)}] round {round_index + 1}: {spec.name}")
        for record in run_one(spec):
            records.append({**record, "round": round_index})
    return records
