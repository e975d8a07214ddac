"""``make bench-async``: how long a sharded checkpoint save blocks training, blocking against ``async_save=True``.

A Fabric loop on 4 CPU ranks (gloo, degree 2, both engines) trains a model large enough that writing its state takes
a visible share of a step, and saves every few steps to a new folder. Per engine and mode:

- **blocked**: how long ``fabric.save`` kept training from going on (the slowest rank, median over saves; the ranks
  enter each save together, so that their skew from the step before is not counted): the whole
  write when blocking; staging (the copy off the training tensors) and the checks before it in the background mode,
  plus any wait for the previous save still in flight;
- **step**: median optimizer step time with no save in flight, and with one in flight (the background write
  competes for the same CPU cores and memory bandwidth);
- **staged**: host memory the staged copy takes per rank (ranks whose shards another replica writes stage nothing).

Target (checked in the same run, a miss is reported): blocked time in the background mode <= 10% of the blocking
save's. Writes ``benchmarks/results/async_checkpoint.{md,json}``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TARGET = 0.10
WORLD, DEGREE = 4, 2


def _model(width: int, layers: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(layers)])


def _loop(fabric: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """Runs in every rank: train, save every ``every`` steps, time the steps and the saves."""
    import torch
    import torch.distributed as dist

    from lightning_smp import memory_report

    model = fabric.setup_module(_model(settings["width"], settings["layers"]))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    strategy = fabric.strategy
    x = torch.randn(settings["batch"], settings["width"])
    steps: list[tuple[bool, float]] = []
    blocked: list[float] = []
    for step in range(settings["steps"]):
        in_flight = strategy.checkpoint_in_flight
        start = time.perf_counter()
        fabric.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        steps.append((in_flight, time.perf_counter() - start))
        if (step + 1) % settings["every"] == 0:
            dist.barrier()  # every rank starts the save together: the figure is the save's, not the ranks' skew
            start = time.perf_counter()
            fabric.save(Path(settings["folder"]) / f"step{step + 1}", {"model": model, "optimizer": optimizer})
            blocked.append(time.perf_counter() - start)
    start = time.perf_counter()
    strategy.wait_for_checkpoint()
    final_wait = time.perf_counter() - start
    report = memory_report(model, [optimizer], print_table=False)
    mine = {"steps": steps, "blocked": blocked, "final_wait": final_wait, "staged": strategy.checkpoint_staging_bytes,
            "state_bytes": report[fabric.global_rank]["params_bytes"] + report[fabric.global_rank]["optimizer_bytes"]}
    everyone: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


def measure(version: int, background: bool, settings: dict[str, Any]) -> dict[str, Any]:
    """One 4-rank Fabric run; the per-save and per-step figures of the slowest rank."""
    import lightning as L

    from lightning_smp.fabric import HybridShardFSDPStrategy

    folder = Path(tempfile.mkdtemp(prefix="bench-async-", dir=settings.get("scratch")))
    try:
        strategy = HybridShardFSDPStrategy(hybrid_shard_degree=DEGREE, fsdp_version=version, async_save=background,
                                           start_method="fork")
        fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD)
        ranks = fabric.launch(_loop, {**settings, "folder": str(folder)})["ranks"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    warm = settings["every"]  # the first steps warm up allocators and process groups
    slowest_blocked = [max(r["blocked"][i] for r in ranks) for i in range(len(ranks[0]["blocked"]))]
    step_times = [(ranks[0]["steps"][i][0], max(r["steps"][i][1] for r in ranks))
                  for i in range(warm, len(ranks[0]["steps"]))]
    quiet = [t for busy, t in step_times if not busy]
    busy = [t for flight, t in step_times if flight]
    return {
        "fsdp_version": version, "async_save": background,
        "blocked_s": statistics.median(slowest_blocked), "blocked_each_s": slowest_blocked,
        "step_s": statistics.median(quiet) if quiet else None,
        "step_in_flight_s": statistics.median(busy) if busy else None,
        "final_wait_s": max(r["final_wait"] for r in ranks),
        "staged_bytes": [r["staged"] for r in ranks], "state_bytes": [r["state_bytes"] for r in ranks],
    }


def evaluate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per engine: blocked time of the background save over the blocking one, against :data:`TARGET`."""
    out = []
    for version in sorted({r["fsdp_version"] for r in rows}):
        blocking = next(r for r in rows if r["fsdp_version"] == version and not r["async_save"])
        background = next(r for r in rows if r["fsdp_version"] == version and r["async_save"])
        ratio = background["blocked_s"] / blocking["blocked_s"]
        out.append({"fsdp_version": version, "ratio": ratio, "target": TARGET, "met": ratio <= TARGET})
    return out


def render(result: dict[str, Any]) -> str:
    from lightning_smp.accounting.render import fmt_bytes, tables_text

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    rows = [[f"FSDP{r['fsdp_version']}", "background" if r["async_save"] else "blocking", seconds(r["blocked_s"]),
             seconds(r["step_s"]), seconds(r["step_in_flight_s"]),
             " / ".join(fmt_bytes(b) for b in r["staged_bytes"]), " / ".join(fmt_bytes(b) for b in r["state_bytes"])]
            for r in result["rows"]]
    header = ["engine", "save", "blocked (s)", "step (s)", "step, save in flight (s)", "staged per rank",
              "state per rank"]
    text = tables_text([("Sharded checkpoint saves on 4 CPU ranks, degree 2 (gloo)", header, rows)],
                       left=["engine", "save"])
    verdicts = [f"FSDP{v['fsdp_version']}: background blocked / blocking blocked = {v['ratio']:.3f} (target <="
                f" {v['target']:.2f}): {'met' if v['met'] else 'MISSED'}" for v in result["verdicts"]]
    model = result["settings"]
    return "\n".join([
        f"Model: {model['layers']} x Linear({model['width']}, {model['width']}) ({result['params']:,} parameters),"
        f" AdamW, batch {model['batch']}; a save every {model['every']} steps, {model['steps']} steps per run.",
        "", text, "", *verdicts])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--scratch", default=None, help="where the checkpoints are written (default: the temp dir)")
    parser.add_argument("--output", type=Path, default=RESULTS / "async_checkpoint")
    args = parser.parse_args(argv)
    settings = {k: getattr(args, k) for k in ("width", "layers", "batch", "steps", "every", "scratch")}
    rows = []
    for version in (1, 2):
        for background in (False, True):
            rows.append(measure(version, background, settings))
    params = args.layers * (args.width * args.width + args.width)
    result = {"settings": settings, "params": params, "rows": rows, "verdicts": evaluate(rows)}
    from benchmarks.report import write_small_results  # matplotlib and the library: only once there is a result

    return write_small_results(args.output, result, render)


if __name__ == "__main__":
    main()
