"""Predicted step time: compute at the device's throughput, and the communication FSDP cannot hide behind it.

One optimizer step runs ``k`` micro-batches. Each micro-batch's forward and backward take their FLOPs (counted on the
model, or ``6 N`` per token for a transformer, ``8 N`` under full activation checkpointing) divided by the device's
achieved throughput. Each collective of the step's textbook figure takes its alpha-beta time on the link its group
uses (:mod:`.links`). FSDP runs the collectives on their own stream, one after the other, and overlaps them with the
compute of the neighbouring units:

- forward: the first unit's all-gather is exposed; the other units' all-gathers run while the previous unit
  computes (prefetch), so they cost only what exceeds the forward's compute;
- backward: the all-gathers of the backward (FULL_SHARD and HYBRID_SHARD gather non-root units again), and, in a
  micro-batch that reduces, the reduce-scatters and the cross-replica all-reduces run behind the backward's compute;
  the last unit's reduction is exposed (nothing computes after it);
- which micro-batches reduce follows the accumulation mode (``no_sync``: the last; FSDP2's ``defer_all_reduce``:
  reduce-scatter in every one, all-reduce in the last; ``every_micro_batch``: all);
- without overlap (``Links.overlap=False``: gloo on CPU, where collectives and compute share the cores) every
  collective adds to the compute.

The engine's own work adds to each micro-batch where it shares the cores with the compute (CPU): per unit, a fixed
cost (its hooks) and a cost per byte of the unit (its copies into and out of the collectives' buffers), as
:func:`~.calibrate.calibrate` measures them (``Links.engine_costs``, :func:`engine_seconds`).

Left out, the same at every degree or small next to a step: the optimizer's own update (it runs on the local shard,
so a larger degree makes it faster), kernel launch gaps, the data loader. The figure is a prediction to choose a
configuration by, and :mod:`benchmarks` checks it against measured step times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_smp.names import HYBRID_SHARD_ZERO2, NO_SHARD, SHARD_GRAD_OP
from lightning_smp.planner.links import as_run, collective_seconds


@dataclass(frozen=True)
class StepTime:
    """One optimizer step's predicted time, in seconds: ``seconds = compute + engine + exposed`` (``engine``: the FSDP
    engine's own work, where it adds to the compute)."""

    compute: float
    communication: float
    exposed: float
    engine: float = 0.0

    @property
    def seconds(self) -> float:
        return self.compute + self.engine + self.exposed


def engine_seconds(engine_costs: dict[str, tuple[float, float]], engine: str, unit_bytes: Sequence[int]) -> float:
    """The work of ``engine`` itself in one micro-batch (forward and backward) over units of ``unit_bytes``: per unit
    its fixed cost and its cost per byte (``Links.engine_costs``; an engine not measured costs nothing)."""
    fixed, per_byte = engine_costs.get(engine, (0.0, 0.0))
    return sum(fixed + per_byte * size for size in unit_bytes)


def _op_seconds(axis: dict[str, dict[str, float]], op: str, group: int, link: tuple[float, float]) -> float:
    entry = axis.get(op)
    if not entry or not entry["count"]:
        return 0.0
    return collective_seconds({op: entry}, group, *link)


def step_time(figure: dict[str, dict[str, dict[str, float]]], *, sharding_strategy: str, shard: int, replicas: int,
              shard_link: tuple[float, float], replicate_link: tuple[float, float], units: int, micro_batches: int,
              reduce_scatter_passes: int, synced_passes: int, forward_flops: float, backward_flops: float,
              device_flops: float, overlap: bool = True, reduce_scatter_as_all_reduce: bool = False,
              engine_seconds: float = 0.0) -> StepTime:
    """The step time of one configuration.

    Args:
        figure: the step's textbook figure (``{axis: {op: {"count", "bytes", "ring_bytes"}}}``), axes ``"shard"`` and
            ``"replicate"``.
        shard_link, replicate_link: ``(bandwidth, latency)`` of the link each axis's groups use.
        units: FSDP units with parameters (the root included).
        reduce_scatter_passes, synced_passes: micro-batches that reduce-scatter, and that all-reduce across replicas.
        forward_flops, backward_flops: one micro-batch's (recomputation under activation checkpointing in backward).
        device_flops: achieved FLOP/s of one rank; ``0``: unknown (compute counts nothing).
        reduce_scatter_as_all_reduce: the backend runs reduce-scatters as all-reduces (gloo, :func:`.links.as_run`).
        engine_seconds: the engine's own work in one micro-batch (:func:`engine_seconds`).
    """
    shard_axis, replicate_axis = figure.get("shard", {}), figure.get("replicate", {})
    k = max(micro_batches, 1)
    n = max(units, 1)
    gathers = _op_seconds(shard_axis, "all_gather", shard, shard_link)
    scattering = as_run({op: e for op, e in shard_axis.items() if op == "reduce_scatter"}, reduce_scatter_as_all_reduce)
    scatters = sum(_op_seconds(scattering, op, shard, shard_link) for op in scattering)
    # the cross-replica all-reduce (NO_SHARD: the whole gradient, over the world); the bitmap of unused parameters
    # on each axis is one small all-reduce per step, after the backward
    all_reduces = _op_seconds(replicate_axis, "all_reduce", replicas, replicate_link)
    bitmap = _op_seconds(shard_axis, "all_reduce", shard, shard_link) if sharding_strategy != NO_SHARD else 0.0
    forward_share = 1.0 if sharding_strategy in (SHARD_GRAD_OP, HYBRID_SHARD_ZERO2, NO_SHARD) else n / (2 * n - 1)
    compute_f = forward_flops / device_flops if device_flops else 0.0
    compute_b = backward_flops / device_flops if device_flops else 0.0
    total = exposed = 0.0
    for index in range(k):
        gather_f = gathers / k * forward_share
        gather_b = gathers / k - gather_f
        reduce = (scatters / reduce_scatter_passes if index >= k - reduce_scatter_passes else 0.0) + (
            all_reduces / synced_passes if synced_passes and index >= k - synced_passes else 0.0)
        total += gather_f + gather_b + reduce
        if not overlap:
            exposed += gather_f + gather_b + reduce
            continue
        first, last = gather_f / n, reduce / n
        exposed += first + max(0.0, gather_f - first - compute_f)
        exposed += max(0.0, gather_b + reduce - last - compute_b) + last
    total += bitmap
    exposed += bitmap
    return StepTime(compute=k * (compute_f + compute_b), communication=total, exposed=exposed,
                    engine=k * engine_seconds)


def transformer_flops(params: int, tokens: int, layers: int, hidden: int, seq_len: int,
                      checkpointing: bool = False) -> tuple[float, float]:
    """``(forward, backward)`` FLOPs of one micro-batch of ``tokens`` tokens through a transformer: ``2 N`` per
    token forward and ``4 N`` backward for the weights (Kaplan et al., "Scaling Laws for Neural Language Models",
    2020, section 2.1), plus attention's ``2 * 2 s h`` per token and layer forward (scores and weighted sum) and twice
    that backward; full activation checkpointing runs the forward again in backward."""
    forward = tokens * (2.0 * params + 4.0 * layers * seq_len * hidden)
    backward = 2.0 * forward + (forward if checkpointing else 0.0)
    return forward, backward


__all__ = ["StepTime", "engine_seconds", "step_time", "transformer_flops"]
