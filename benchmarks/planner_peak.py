"""``python -m benchmarks.planner_peak``: the planner's predicted per-rank peak against the peak a real step reaches.

GPT-style models (:class:`~benchmarks.workloads.BenchGPT`, one FSDP unit per block plus the root) of about 10 M,
50 M and 100 M parameters, every asked ``hybrid_shard_degree`` and engine, 4 forked CPU ranks (gloo, fp32, one
thread each), AdamW, 2 sequences of 64 tokens per rank:

- **predicted**: :func:`lightning_smp.plan` of a meta-device copy of the model with one rank's micro-batch (its
  activations traced on fake tensors): ``peak_bytes`` = model state + transient + buffers + activations;
- **measured**: :class:`~lightning_smp.HybridShardFSDPStrategy` in a Lightning ``Trainer``; after a warm-up step (so
  that the gradients and the AdamW state exist), one whole step (batch start to batch end: forward, zero_grad,
  backward, optimizer step) under torch's ``MemTracker`` (:class:`StepTracker`), model and optimizer registered with
  ``track_external``: the tracker's peak total of live tensor storage, the fullest rank's.

Writes ``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/planner_peak``)::

    python -m benchmarks.planner_peak                        # 10M,50M,100M x degrees 1,2,4 x FSDP1 and FSDP2
    python -m benchmarks.planner_peak --sizes 10M --engines 1 --out /tmp/planner_peak
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from benchmarks.settings import ModelSize, Settings
from benchmarks.workloads import lm_loss, make_dataset, make_model, quiet
from lightning_smp.demo import Block

#: Model sizes by name: vocabulary 4096, sequences of 64 tokens, heads of width 64 (``tiny`` is for the test).
SIZES = {
    "tiny": ModelSize(vocab_size=256, dim=128, layers=2, heads=2, block_size=64),
    "10M": ModelSize(vocab_size=4096, dim=256, layers=10, heads=4, block_size=64),
    "50M": ModelSize(vocab_size=4096, dim=512, layers=15, heads=8, block_size=64),
    "100M": ModelSize(vocab_size=4096, dim=768, layers=13, heads=12, block_size=64),
}
#: The prediction is "within" when ``|predicted / measured - 1|`` is at most this.
TOLERANCE = 0.10
#: Steps run before the measured one: one is enough for the AdamW state and last step's gradients to exist.
MEASURED_STEP = 1
RESULTS = Path(__file__).resolve().parent / "results" / "planner_peak"
PHASES = ("forward", "backward", "optimizer step")  # zero_grad counts as backward: Lightning calls it right before


def bench_settings(size: ModelSize, world_size: int = 4, batch_size: int = 2) -> Settings:
    """The run's settings: ``warmup + steps + 1`` = 3 steps of data per rank (the first two are run)."""
    return Settings(world_size=world_size, model=size, batch_size=batch_size, warmup=1, steps=1)


def predict(settings: Settings, engine: int, degrees: Sequence[int]) -> dict[int, dict[str, int]]:
    """The planner's row of every degree, from one fake-tensor trace of one rank's micro-batch."""
    import lightning_smp

    with torch.device("meta"):  # nothing is allocated: the planner reads shapes only
        model = make_model(settings)
    batch = torch.zeros(settings.batch_size, settings.model.block_size + 1, dtype=torch.long)
    plan = lightning_smp.plan(model, world_size=settings.world_size, budget_bytes=10**12, fsdp_version=engine,
                              auto_wrap_policy={Block}, optimizer="adamw", example_input=batch,
                              step=lambda m, b: lm_loss(m(b[:, :-1]), b), degrees=list(degrees))
    keys = ("peak_bytes", "model_state_bytes", "transient_bytes", "buffer_bytes", "activation_bytes")
    return {d: {k: getattr(plan.row(d), k) for k in keys} for d in degrees}


class StepTracker(MemTracker):
    """torch's ``MemTracker`` with the two changes the strategy's runs need; what it counts is unchanged.

    - FSDP1 (``use_orig_params=True``) makes the original parameters non-leaf views of the gathered flat parameter
      in forward, and ``MemTracker`` fails hooking their gradients ("post accumulate grad hooks cannot be registered
      on non-leaf tensors"). The hooks only label gradients (which are op outputs the tracker sees anyway): skipped.
    - FSDP2: the strategy runs the LightningModule's step as the sharded root's forward, and the step calls the root
      again (``self(x)``), which ``MemTracker`` refuses ("multiple iterative calls"): the inner call passes through.

    It also keeps the peak of each phase (:data:`PHASES`, set by the callback): the tracker's labels cannot tell,
    as Lightning runs forward and backward inside ``optimizer.step(closure)``, all filed as optimizer state.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.phase_peaks = PHASES[0], dict.fromkeys(PHASES, 0)
        self._inside: dict[int, int] = {}

    def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> tuple[int, int]:
        leaves = all(p.is_leaf for p in module.parameters())
        return super()._track_module_params_and_buffers(module, install_grad_hooks and leaves)

    def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
        self._inside[id(module)] = self._inside.get(id(module), 0) + 1
        if self._inside[id(module)] == 1:
            super()._pre_fw_hook(module, inputs)

    def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
        self._inside[id(module)] -= 1
        if self._inside[id(module)] == 0:
            super()._post_fw_hook(module, inputs, outputs)

    def _update_peak_stats(self, peak_state: Any) -> None:  # after every op
        super()._update_peak_stats(peak_state)
        now = sum(s["Total"] for s in self._curr_mem_snap.values())
        self.phase_peaks[self.phase] = max(self.phase_peaks[self.phase], now)


def _measure_callback(record: dict[str, Any]) -> Any:
    """The Lightning callback that measures step :data:`MEASURED_STEP` into ``record``."""
    from lightning.pytorch.callbacks import Callback

    class _Measure(Callback):
        tracker: StepTracker | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == MEASURED_STEP:
                self.tracker = StepTracker()
                self.tracker.track_external(trainer.strategy.model, *trainer.optimizers)  # the state so far
                record["start_bytes"] = sum(s["Total"] for s in self.tracker.get_tracker_snapshot().values())
                self.tracker.__enter__()

        def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self.tracker is not None:
                self.tracker.phase = PHASES[1]

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self.tracker is not None:
                self.tracker.phase = PHASES[2]

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.tracker is not None:
                self.tracker.__exit__(None, None, None)
                peak = self.tracker.get_tracker_snapshot("peak")
                record.update(peak_bytes=sum(s["Total"] for s in peak.values()),
                              phase_peak_bytes=self.tracker.phase_peaks)
                self.tracker = None

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            if self.tracker is not None:
                self.tracker.__exit__(None, None, None)

    return _Measure()


def _measure_rank(rank: int, world_size: int, settings: Settings, degree: int, engine: int,
                  dataset: Any) -> dict[str, Any]:
    """One rank: fit ``MEASURED_STEP + 1`` steps with the strategy and return what the callback measured."""
    import lightning as L
    from lightning.pytorch.accelerators import CPUAccelerator
    from torch.utils.data import DataLoader

    from lightning_smp import HybridShardFSDPStrategy

    quiet()
    record: dict[str, Any] = {"rank": rank}
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=engine, auto_wrap_policy={Block},
                                       start_method="fork")
    trainer = L.Trainer(strategy=strategy, accelerator=CPUAccelerator(), devices=world_size,
                        max_steps=MEASURED_STEP + 1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[_measure_callback(record)])
    trainer.fit(make_model(settings), DataLoader(dataset, batch_size=settings.batch_size, shuffle=False))
    return record


def measure(settings: Settings, degree: int, engine: int, timeout: float = 1200.0) -> dict[str, Any]:
    """The measured step on ``settings.world_size`` forked CPU ranks: the fullest rank's figures, every rank's peak."""
    from lightning_smp.testing import run_distributed

    start = time.perf_counter()
    ranks = run_distributed(_measure_rank, settings.world_size, settings, degree, engine, make_dataset(settings),
                            timeout=timeout)
    fullest = max(ranks, key=lambda r: r["peak_bytes"])
    return {"peak_bytes": fullest["peak_bytes"], "rank": fullest["rank"], "start_bytes": fullest["start_bytes"],
            "peak_phase": max(PHASES, key=fullest["phase_peak_bytes"].get),
            "phase_peak_bytes": fullest["phase_peak_bytes"], "rank_peak_bytes": [r["peak_bytes"] for r in ranks],
            "seconds": round(time.perf_counter() - start, 1)}


def compare(size: str, parameters: int, engine: int, degree: int, predicted: dict[str, int],
            measured: dict[str, Any], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """One row of the results: the two peaks, their ratio, the verdict and both breakdowns (pure)."""
    ratio = predicted["peak_bytes"] / measured["peak_bytes"]
    return {"size": size, "parameters": parameters, "engine": f"FSDP{engine}", "degree": degree,
            "predicted_peak_bytes": predicted["peak_bytes"], "measured_peak_bytes": measured["peak_bytes"],
            "predicted_over_measured": ratio, "within_tolerance": abs(ratio - 1) <= tolerance,
            "predicted": predicted, "measured": measured}


HEADER = ["size", "params", "engine", "degree", "predicted peak", "measured peak", "predicted/measured",
          f"within {TOLERANCE:.0%}", "model state", "transient", "activations", "buffers", "state at step start",
          "peak in"]


def table_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The rows as text: the verdict, the predicted breakdown, and the measured state and phase of the peak."""
    from lightning_smp.accounting.render import fmt_bytes

    terms = ("model_state_bytes", "transient_bytes", "activation_bytes", "buffer_bytes")
    return [[r["size"], f"{r['parameters'] / 1e6:.1f} M", r["engine"], str(r["degree"]),
             fmt_bytes(r["predicted_peak_bytes"]), fmt_bytes(r["measured_peak_bytes"]),
             f"{r['predicted_over_measured']:.3f}", "yes" if r["within_tolerance"] else "no",
             *(fmt_bytes(r["predicted"][k]) for k in terms), fmt_bytes(r["measured"]["start_bytes"]),
             r["measured"]["peak_phase"]] for r in rows]


def to_markdown(payload: dict[str, Any]) -> str:
    """The results page: command, machine, what was run and measured, the table."""
    from benchmarks.tables import _markdown_table, describe_machine

    models = "; ".join(f"{name}: {m['layers']} blocks of width {m['dim']}, vocabulary {m['vocab_size']}"
                       for name, m in payload["sizes"].items())
    return "\n\n".join([
        "# Planner: predicted against measured peak memory per rank",
        f"Command: `{payload['command']}`  \nMachine: {describe_machine(payload['machine'])}  \n"
        f"Date: {payload['machine'].get('date')}",
        f"BenchGPT ({models}), sequences of 64 tokens, AdamW, fp32, batch {payload['batch_size']} per rank,"
        f" {payload['world_size']} CPU ranks (gloo). Predicted: `lightning_smp.plan` (activations traced on fake"
        " tensors). Measured: the fullest rank's peak of live tensor storage during one whole training step after a"
        " warm-up step (torch `MemTracker`, see `benchmarks/planner_peak.py`).",
        _markdown_table(HEADER, table_rows(payload["rows"])),
    ]) + "\n"


def write(payload: dict[str, Any], out: Path) -> list[Path]:
    """Write ``<out>.json`` and ``<out>.md``; return their paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(".json"), out.with_suffix(".md")]
    paths[0].write_text(json.dumps(payload, indent=1) + "\n")
    paths[1].write_text(to_markdown(payload))
    return paths


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    def names(text: str) -> list[str]:  # "10M,50M" -> ["10M", "50M"]
        return [t.strip() for t in text.split(",") if t.strip()]

    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner_peak", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=names, default=["10M", "50M", "100M"], help=f"of {', '.join(SIZES)}")
    parser.add_argument("--degrees", type=lambda t: [int(d) for d in names(t)], default=[1, 2, 4])
    parser.add_argument("--engines", type=lambda t: [int(e) for e in names(t)], default=[1, 2], help="FSDP versions")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results path without suffix")
    args = parser.parse_args(argv)
    if set(args.sizes) - set(SIZES):
        parser.error(f"unknown size(s) {sorted(set(args.sizes) - set(SIZES))}; valid: {', '.join(SIZES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.cli import machine_info
    from lightning_smp.accounting.render import print_tables

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(1)  # as the forked ranks (run_distributed gives each one thread)
    payload: dict[str, Any] = {"command": shlex.join(["python", "-m", "benchmarks.planner_peak", *argv]),
                               "machine": machine_info(), "world_size": args.world_size,
                               "batch_size": args.batch_size, "tolerance": TOLERANCE, "sizes": {}, "rows": []}
    for name in args.sizes:
        settings = bench_settings(SIZES[name], args.world_size, args.batch_size)
        payload["sizes"][name] = settings.as_dict()["model"]
        for engine in args.engines:
            predicted = predict(settings, engine, args.degrees)
            for degree in args.degrees:
                measured = measure(settings, degree, engine)
                row = compare(name, settings.model.parameter_count(), engine, degree, predicted[degree], measured)
                payload["rows"].append(row)
                print(f"{name} FSDP{engine} d={degree}: predicted/measured {row['predicted_over_measured']:.3f}"
                      f" ({measured['seconds']} s)", flush=True)
                write(payload, args.out)  # after every row: a long run that stops keeps what it measured
    print_tables([("Planner peak: predicted vs measured (per rank)", HEADER, table_rows(payload["rows"]))],
                 left=("size", "engine", "peak in"), width=220)
    print("wrote " + ", ".join(str(p) for p in write(payload, args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
