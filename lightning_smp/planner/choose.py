"""Choosing the degree: every valid degree's memory and communication, and the recommendation.

For each candidate the per-rank peak is the fullest rank's model state (:func:`~.state.model_state`, exact), the
transient state at the step's peak (the units gathered at the end of forward, gradient-accumulation buffers), the
buffers (never sharded) and one micro-batch's activations (measured on fake
tensors, given, or estimated). The traffic of one optimizer step per axis is the textbook figure the memory report
compares against (equal to what is measured), and its time on the links the alpha-beta model of :mod:`.links`.

The recommendation is the degree with the least predicted step time (:mod:`.timing`: compute at the device's
throughput, and the communication FSDP cannot hide behind it) among those that fit the budget with the headroom to
spare; degrees within :data:`TIE` of the fastest count as tied, and the smallest of them is chosen (SMP's own
guidance, "the lowest degree that fits", is what the tie keeps: the fewer ranks in a shard group, the less can go
wrong in it).

What :func:`plan` returns, its table and the message when no degree fits are in :mod:`.result`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from torch.nn import Module

from lightning_smp.accumulation import accumulation_mode
from lightning_smp.config.replica_sync import ReplicaSync, check_replica_sync, one_group_refusal
from lightning_smp.degree import resolve_layout, valid_degrees
from lightning_smp.engines import engine_for, engine_for_layout, replica_sync_refusal
from lightning_smp.engines.textbook import ring_bytes
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.links import Links, links_for
from lightning_smp.names import BACKUP_CPU, BACKUP_DEVICE, HYBRID_SHARD, NO_SHARD
from lightning_smp.planner.links import as_run, axis_link, collective_seconds
from lightning_smp.planner.result import GIVEN, MEASURED, NOT_INCLUDED, DegreePlan, Plan, _no_fit_message
from lightning_smp.planner.state import fsdp_units, model_state, optimizer_name
from lightning_smp.planner.step import textbook, transient_bytes
from lightning_smp.planner.timing import engine_seconds, step_time
from lightning_smp.replica_sync.auto import choose_schedule
from lightning_smp.replica_sync.compress import sync_payload_bytes
from lightning_smp.sizes import parse_bytes

#: Predicted step times within this fraction of the fastest count as tied (the smaller degree wins).
TIE = 0.05


def _checkpointing(classes: tuple[type[Module], ...]) -> Callable[[Module], None]:
    def apply(module: Module) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(module, check_fn=lambda m: isinstance(m, classes))

    return apply


def plan(model: Module, *, world_size: int, devices_per_node: int | None = None, budget_bytes: int | str,
         fsdp_version: int = 1, auto_wrap_policy: Any = None, optimizer: Any = None,
         sharding_strategy: str = HYBRID_SHARD, precision: str = "32-true", micro_batches: int = 1,
         accumulation: str | None = None, example_input: Any = None, step: Callable | None = None,
         checkpoint: Callable[[Module], None] | set[type[Module]] | None = None, activation_bytes: int | None = None,
         headroom: float = 0.1, links: str | Links | None = None, device: Any = "cpu",
         degrees: Sequence[int] | None = None, training: bool = True, cpu_offload: bool = False,
         flops: tuple[float, float] | None = None, may_checkpoint: Any = None, replica_sync: Any = None) -> Plan:
    """Every valid degree's figures for ``model`` on ``world_size`` ranks, and the recommended degree.

    Args:
        model: an ``nn.Module`` or ``LightningModule``, best built on the meta device (nothing is allocated).
        devices_per_node: ranks per node (default: all ranks in one node).
        budget_bytes: what one rank's training may use: bytes, or a string such as ``"40GB"``.
        optimizer: a name (``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd_momentum"``), an optimizer, or ``None``:
            the LightningModule's ``configure_optimizers``, else AdamW.
        sharding_strategy: ``HYBRID_SHARD`` or ``_HYBRID_SHARD_ZERO2`` (what degrees >= 2 run).
        precision: a Lightning precision string (mixed precision reduces in 16 bits).
        micro_batches, accumulation: gradient accumulation per optimizer step and its mode (default: the engine's).
        example_input, step, checkpoint: one rank's micro-batch (real tensors, or meta tensors of its shape and
            dtype: ``torch.empty(2, 4096, dtype=torch.long, device="meta")``), traced on fake tensors to measure
            activations (:func:`~.activations.measure_activations`); ``checkpoint`` is activation checkpointing: a
            set of module classes (each checkpointed, as the strategies' ``activation_checkpointing_policy``) or a
            function applying it. ``activation_bytes`` gives the activations instead.
        headroom: kept free on top of the peak, as a fraction of it.
        links: a preset name (:data:`~.links.LINK_PRESETS`) or :class:`~.links.Links` (links, device throughput,
            overlap), for the step time.
        flops: ``(forward, backward)`` FLOPs of one micro-batch; default: counted in the trace of ``example_input``,
            else unknown (the step time is then the communication alone).
        may_checkpoint: when no degree fits, what the planner may checkpoint to make one fit: a set of module
            classes (default: ``auto_wrap_policy``'s, the FSDP units, when ``example_input`` is traced and
            ``checkpoint`` is not given), or ``(names, activation_bytes, flops)`` of the checkpointed micro-batch
            (a parameter count's estimate); ``False``: never.
        degrees: the candidates (default: every valid degree >= 1 of ``world_size``).
        training: ``False`` for validate/test/predict: no gradients, no optimizer state.
        cpu_offload: the sharded parameters, gradients and optimizer state live in CPU memory (FSDP1
            ``CPUOffload(offload_params=True)``, FSDP2 ``CPUOffloadPolicy``): the device holds the gathered units and
            the activations only.
        replica_sync: ``replica_sync``'s value (a mapping or :class:`~lightning_smp.config.replica_sync.ReplicaSync`):
            the candidates are the degrees the strategies run it on (two replica groups or more, on an engine whose
            capabilities allow it: FSDP1 is left out, degree 1's DDP engine kept; ``Plan.left_out`` says why);
            nothing crosses the groups in an inner step, the sync's all-reduce of each rank's part of the parameters
            counts ``1 / every`` of its time and bytes per step (after the step: not hidden), and each rank holds the
            outer loop's copies of its part (the synced parameters, and the outer momentum).

    Raises:
        HybridShardConfigError: no degree fits (the message says what would help), or none runs ``replica_sync``.
    """
    from lightning_smp.planner.activations import trace_micro_batch

    budget = parse_bytes(budget_bytes, "memory_budget")
    per_node = devices_per_node or world_size
    sync = None if replica_sync is None else ReplicaSync.from_mapping(check_replica_sync(replica_sync) or {})
    engine = engine_for(fsdp_version)
    # (what the strategies refuse is left out first, before anything is traced)
    candidates = list(degrees or [d for d in valid_degrees(world_size) if d >= 1])
    left_out = _left_out(candidates, sync, world_size, sharding_strategy, fsdp_version, cpu_offload)
    planned = [degree for degree in candidates if degree not in left_out]
    if not planned:
        raise HybridShardConfigError(
            f"no hybrid_shard_degree of {', '.join(map(str, candidates))} runs replica_sync on {world_size} rank(s): "
            + " ".join(f"Degree {degree}: {why}" for degree, why in left_out.items()))
    mode = accumulation or engine.capabilities.accumulations[0]
    name = optimizer_name(model if optimizer is None else optimizer)
    link = links_for(links)
    units = fsdp_units(model, auto_wrap_policy, engine.prediction)
    wrapped = {id(p) for target in engine.prediction.units_of(model, auto_wrap_policy) for p in target.parameters()}
    root_is_last = bool(units) and any(id(p) not in wrapped for p in units[-1])
    unit_bytes = [sum(p.numel() * p.element_size() for p in unit) for unit in units]
    element_size = next((p.element_size() for p in model.parameters()), 4)  # (the pseudo-gradients' dtype)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    if activation_bytes is not None:
        activations, source = int(activation_bytes), GIVEN
    elif example_input is not None:
        if isinstance(checkpoint, (set, frozenset, list, tuple)):
            checkpoint = _checkpointing(tuple(checkpoint))
        trace = trace_micro_batch(model, example_input, step=step, device=device, precision=precision,
                                  checkpoint=checkpoint)
        activations, source = trace.activation_bytes, MEASURED
        if flops is None:
            flops = (trace.forward_flops, trace.backward_flops)
    else:
        activations, source = 0, NOT_INCLUDED

    def rows_for(activations: int, flops: tuple[float, float] | None, sync: ReplicaSync | None = sync
                 ) -> list[DegreePlan]:
        return [row_for(degree, activations, flops, sync) for degree in planned]

    def row_for(degree: int, activations: int, flops: tuple[float, float] | None,
                sync: ReplicaSync | None) -> DegreePlan:
        layout = resolve_layout(world_size, degree, sharding_strategy)
        states = model_state(model, world_size=world_size, hybrid_shard_degree=degree, fsdp_version=fsdp_version,
                             auto_wrap_policy=auto_wrap_policy, optimizer=name, sharding_strategy=sharding_strategy,
                             cpu_offload=cpu_offload)
        state = max(s.total_bytes if training else s.params_bytes for s in states)
        # replica_sync: the synced copy of this rank's part of the parameters, and the outer momentum
        part = max(s.params_bytes for s in states)
        # (backup="cpu": in host memory, out of the device's peak)
        outer = (part * (2 if sync.outer_momentum else 1)
                 if sync is not None and training and sync.backup == BACKUP_DEVICE else 0)
        runs = engine_for_layout(fsdp_version, layout, cpu_offload=cpu_offload or None)  # DDP's when unsharded
        transient = transient_bytes(units, root_is_last, layout, runs.prediction,
                                    micro_batches if training else 1, mode, precision)
        peak = (0 if cpu_offload else state + outer) + transient + buffers + activations
        figure = textbook(units, layout, runs.prediction, micro_batches, mode, precision)
        replicas = world_size if layout.sharding_strategy == NO_SHARD else layout.replicate
        shard_link, shard_inter = axis_link(link, world_size, layout.shard, True, per_node)
        replica_link, replica_inter = axis_link(link, world_size, layout.shard, False, per_node)
        if sync is not None:  # an inner step sends nothing across the groups; a sync, each rank's part, every H
            figure = {**figure, "replicate": {}}
            # (a compressed payload: its encoded bytes)
            sent = sync_payload_bytes(part // element_size, sync.compress, element_size)
            sync_ops = {"all_reduce": {"count": 1, "bytes": sent,
                                       "ring_bytes": ring_bytes("all_reduce", sent, replicas)}}
        run = {axis: as_run(ops, link.reduce_scatter_as_all_reduce) for axis, ops in figure.items()}  # as run
        shard_s = collective_seconds(run["shard"], layout.shard, *shard_link)
        scattered, synced = accumulation_mode(mode).passes(micro_batches)
        timed = step_time(figure, sharding_strategy=layout.sharding_strategy, shard=layout.shard, replicas=replicas,
                          shard_link=shard_link, replicate_link=replica_link,
                          units=len(units), micro_batches=micro_batches, reduce_scatter_passes=scattered,
                          synced_passes=synced, forward_flops=flops[0] if flops else 0.0,
                          backward_flops=flops[1] if flops else 0.0, device_flops=link.device_flops,
                          overlap=link.overlap, reduce_scatter_as_all_reduce=link.reduce_scatter_as_all_reduce,
                          engine_seconds=engine_seconds(link.engine_costs, runs.name, unit_bytes))
        schedule = None
        if sync is None:
            replica_s = collective_seconds(run["replicate"], replicas, *replica_link)
        else:  # (the window and overlap as "auto" would choose them from this row's crossing and step, or as given)
            # (no device throughput: the step's compute unknown, nothing known to hide the crossing under)
            schedule = choose_schedule(collective_seconds(sync_ops, replicas, *replica_link),
                                       timed.seconds if link.device_flops else 0.0, sync.fragments, sync.every,
                                       sync.delay)
            replica_s = schedule.shown_s / schedule.every if schedule.every else schedule.shown_s
        return DegreePlan(
            degree=degree, sharding_strategy=layout.sharding_strategy, shard=layout.shard, replicas=replicas,
            model_state_bytes=state, transient_bytes=transient, buffer_bytes=buffers, activation_bytes=activations,
            peak_bytes=peak, fits=peak * (1 + headroom) <= budget,
            shard_bytes=int(sum(e["bytes"] for e in figure["shard"].values())),
            replicate_bytes=(int(sum(e["bytes"] for e in figure["replicate"].values())) if schedule is None else
                             int(sent / (schedule.every or 1))),
            shard_seconds=shard_s, replicate_seconds=replica_s,
            shard_link="-" if layout.shard <= 1 else ("inter-node" if shard_inter else "intra-node"),
            replicate_link="-" if replicas <= 1 else ("inter-node" if replica_inter else "intra-node"),
            compute_seconds=timed.compute, exposed_seconds=timed.exposed + (replica_s if sync else 0.0),
            engine_seconds=timed.engine, step_seconds=timed.seconds + (replica_s if sync else 0.0),
            outer_bytes=outer, sync_every=schedule.every if schedule else 0,
            sync_delay=schedule.delay if schedule else 0, sync_why=schedule.why if schedule else "")

    rows = rows_for(activations, flops)
    fitting = [r for r in rows if r.fits]
    checkpointed: tuple[str, ...] = ()
    if not fitting and training:
        # the lever: activation checkpointing, when nothing fits without it and the planner knows what to checkpoint
        lever = _checkpointed_figures(model, example_input, step, device, precision, checkpoint, activation_bytes,
                                      auto_wrap_policy, may_checkpoint)
        if lever is not None:
            names, lever_activations, lever_flops = lever
            lever_rows = rows_for(lever_activations, lever_flops if lever_flops is not None else flops)
            if any(r.fits for r in lever_rows):
                rows, checkpointed = lever_rows, names
                fitting = [r for r in rows if r.fits]
    if not fitting:
        # replica_sync's outer copies in host memory (backup="cpu"): the same rows planned again, for the advice
        on_host = ([r for r in rows_for(activations, flops, replace(sync, backup=BACKUP_CPU)) if r.fits]
                   if sync is not None and sync.backup == BACKUP_DEVICE and training and not cpu_offload else [])
        raise HybridShardConfigError(_no_fit_message(rows, budget, headroom, world_size, source, fsdp_version, mode,
                                                     micro_batches, cpu_offload, on_host))
    chosen, runner_up = _fastest(fitting)
    from lightning_smp.accounting.render import fmt_bytes

    reason = "nothing fits without activation checkpointing: turned on for " + ", ".join(checkpointed) + "; " if (
        checkpointed) else ""
    reason += (f"degree {chosen.degree} has the least predicted step time of the degrees that fit:"
              f" {_ms(chosen.step_seconds)} (compute {_ms(chosen.compute_seconds)}, "
              + (f"the engine's own work {_ms(chosen.engine_seconds)}, " if chosen.engine_seconds else "")
              + f"communication not hidden {_ms(chosen.exposed_seconds)})")
    if runner_up is not None:
        tied = runner_up.step_seconds <= chosen.step_seconds * (1 + TIE)
        reason += (f"; runner-up degree {runner_up.degree}: {_ms(runner_up.step_seconds)}"
                   + (f" (within {TIE:.0%}: the smaller degree is chosen)" if tied else ""))
    reason += f"; {fmt_bytes(chosen.peak_bytes)} of {fmt_bytes(budget)} per rank with {headroom:.0%} headroom"
    if not link.device_flops:
        reason += " (device throughput unknown: compute not counted)"
    if source == NOT_INCLUDED:
        reason += " (activations not included: pass an example input or activation_bytes)"
    if cpu_offload:
        reason += " (model state offloaded to CPU memory, not counted)"
    return Plan(degree=chosen.degree, reason=reason, rows=tuple(rows), budget_bytes=budget, headroom=headroom,
                activation_checkpointing=checkpointed,
                world_size=world_size, devices_per_node=per_node, fsdp_version=fsdp_version, optimizer=name,
                activations=source, links=link, replica_sync=sync, left_out=tuple(left_out.items()))


def _left_out(candidates: Sequence[int], sync: ReplicaSync | None, world_size: int, sharding_strategy: str,
              fsdp_version: int, cpu_offload: bool) -> dict[int, str]:
    """The candidate degrees the strategies would refuse, and why (their own refusals): under ``replica_sync``, one
    replica group, or an engine whose capabilities do not run it."""
    if sync is None:
        return {}
    left_out: dict[int, str] = {}
    for degree in candidates:
        layout = resolve_layout(world_size, degree, sharding_strategy)
        runs = engine_for_layout(fsdp_version, layout, cpu_offload=cpu_offload or None)  # DDP's when unsharded
        why = replica_sync_refusal(runs) or one_group_refusal(layout)  # (in the order the core refuses them)
        if why is not None:
            left_out[degree] = why
    return left_out


def _checkpointed_figures(model: Module, example_input: Any, step: Callable | None, device: Any, precision: str,
                          checkpoint: Any, activation_bytes: int | None, auto_wrap_policy: Any,
                          may_checkpoint: Any) -> tuple[tuple[str, ...], int, tuple[float, float] | None] | None:
    """``(names, activations, flops)`` of one micro-batch with activation checkpointing turned on by the planner, or
    ``None`` where it may not (the user chose checkpointing already, or said not to) or cannot say what it saves."""
    from lightning_smp.planner.activations import trace_micro_batch

    if may_checkpoint is False or checkpoint is not None:
        return None
    if isinstance(may_checkpoint, tuple):
        names, activations, flops = may_checkpoint
        return tuple(names), int(activations), flops
    classes = may_checkpoint
    if classes is None and isinstance(auto_wrap_policy, (set, frozenset, list, tuple)):
        classes = auto_wrap_policy
    if not classes or example_input is None or activation_bytes is not None:
        return None
    classes = tuple(classes)
    trace = trace_micro_batch(model, example_input, step=step, device=device, precision=precision,
                              checkpoint=_checkpointing(classes))
    return (tuple(f"{c.__module__}.{c.__qualname__}" for c in classes), trace.activation_bytes,
            (trace.forward_flops, trace.backward_flops))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _fastest(fitting: Sequence[DegreePlan]) -> tuple[DegreePlan, DegreePlan | None]:
    """The chosen row, the smallest degree within :data:`TIE` of the least step time, and the runner-up: the fastest
    of the others."""
    best = min(r.step_seconds for r in fitting)
    chosen = min((r for r in fitting if r.step_seconds <= best * (1 + TIE)), key=lambda r: r.degree)
    others = [r for r in fitting if r is not chosen]
    return chosen, min(others, key=lambda r: (r.step_seconds, r.degree)) if others else None


__all__ = ["TIE", "plan"]
