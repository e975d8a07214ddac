"""``python -m benchmarks``: run every configuration, print the table, write the results."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.figures import summarise
from benchmarks.launch import init_launched_process, launcher_world_size, run_all, run_forked, run_in_process
from benchmarks.report import write_results
from benchmarks.settings import (
    Settings,
    build_accumulation_configs,
    build_configs,
    interleaved,
    parse_args,
    settings_from_args,
    settings_from_dict,
)
from benchmarks.tables import print_tables
from benchmarks.workloads import make_dataset

#: Where results go by default: ``benchmarks/results/`` next to this file.
RESULTS = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, Any]:
    """What the figures were measured on (no host names, no paths)."""
    import lightning

    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "gpus": gpus,
        "platform": platform.system(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def run(settings: Settings, out: Path | None = None, plot: bool = True, command: str = "python -m benchmarks",
        echo: bool = True) -> dict[str, Any]:
    """Run a whole benchmark and write its results; returns ``{"summary", "records", "paths"}`` (paths on rank 0).

    Quick mode forks the ranks of every run from this process; ``--large`` expects this process to be one rank
    started by torchrun/srun and every rank to call it.
    """
    progress = print if echo else (lambda _: None)
    machine = machine_info()
    # the accumulation runs measure bytes and memory only (exact counts): one round, after the timed rounds
    plan = interleaved(build_configs(settings), settings.rounds)
    plan += [(0, spec) for spec in build_accumulation_configs(settings)]
    if settings.mode == "quick":
        torch.set_num_threads(1)
        dataset = make_dataset(settings)
        records = run_all(plan, lambda spec: run_forked(spec, settings, dataset), progress)
        is_writer = True
    else:
        device = init_launched_process(settings)
        dataset = make_dataset(settings)
        is_writer = dist.get_rank() == 0
        records = run_all(plan, lambda spec: run_in_process(spec, settings, dataset, device),
                          progress if is_writer else (lambda _: None))
    summary = summarise(settings, records)
    summary["parameters"] = settings.model.parameter_count()
    # other programs on the machine move the step times: say how busy it was at both ends
    machine["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    paths: dict[str, Path] = {}
    if is_writer:
        if echo:
            print_tables(summary, settings)
        paths = write_results(summary, records, settings, machine, command, out or RESULTS, plot=plot)
        progress("wrote " + ", ".join(str(p) for p in paths.values()))
    return {"summary": summary, "records": records, "paths": paths}


def report_only(path: Path, out: Path | None = None, plot: bool = True, echo: bool = True) -> dict[str, Any]:
    """Rebuild the summary, markdown and plot of a results JSON without running anything (same command, machine)."""
    import json

    payload = json.loads(Path(path).read_text())
    settings = settings_from_dict(payload["settings"])
    records = payload["records"]
    summary = summarise(settings, records)
    summary["parameters"] = settings.model.parameter_count()
    if echo:
        print_tables(summary, settings)
    paths = write_results(summary, records, settings, payload["machine"], payload["command"], out or Path(path).parent,
                          plot=plot)
    return {"summary": summary, "records": records, "paths": paths}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.report_only:
        report_only(Path(args.report_only), Path(args.out) if args.out else None, plot=not args.no_plot)
        return 0
    settings = settings_from_args(args, launcher_world_size() if args.large else None)
    command = shlex.join(["python", "-m", "benchmarks", *argv])
    result = run(settings, Path(args.out) if args.out else None, plot=not args.no_plot, command=command)
    if settings.mode == "large" and dist.is_initialized():
        dist.destroy_process_group()
    missed = [c["name"] for c in result["summary"]["checks"] if not c["ok"]]
    if missed and result["paths"]:
        print("targets missed: " + "; ".join(missed))
    return 0
