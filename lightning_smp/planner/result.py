"""The planner's answer: each candidate degree's figures (:class:`DegreePlan`), the plan (:class:`Plan`) with its
table and text, where its activation figure comes from, and the message when no degree fits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lightning_smp.accumulation import accumulation_mode
from lightning_smp.config.replica_sync import ReplicaSync
from lightning_smp.engines import FSDP_ENGINES
from lightning_smp.links import Links
from lightning_smp.names import BACKUP_CPU

#: Where the activation figure of a plan comes from.
MEASURED, GIVEN, NOT_INCLUDED = "measured on fake tensors", "given", "not included"


@dataclass(frozen=True)
class DegreePlan:
    """One candidate degree: the figures of its fullest rank, and whether it fits.

    Attributes:
        degree, sharding_strategy, shard, replicas: the ``hybrid_shard_degree``, what FSDP runs, the group sizes.
        model_state_bytes: parameters + gradients + optimizer state (exact, padding included; parameters only when
            not training); left out of the peak under CPU offload, where it lives in CPU memory.
        transient_bytes: on top at the step's peak (the end of forward): the unsharded parameters held then (see
            :func:`~.step.gathered_bytes`) and, between micro-batches, FSDP1 ``no_sync``'s unsharded gradients or
            FSDP2's 1/shard partial buffer.
        buffer_bytes: the model's buffers (replicated). activation_bytes: one micro-batch.
        outer_bytes: ``replica_sync``'s outer loop: the synced copy of the rank's part of the parameters and the
            outer momentum (0 without it, and with ``backup='cpu'``, where they live in host memory).
        peak_bytes: the sum; fits: ``peak_bytes * (1 + headroom) <= budget``.
        shard_bytes, replicate_bytes: logical bytes of one optimizer step inside the shard group and across replicas
            (``replica_sync``: a sync's, divided by its ``every``).
        shard_seconds, replicate_seconds: their time on the links (alpha-beta ring model, no overlap).
        shard_link, replicate_link: ``"intra-node"``, ``"inter-node"`` or ``"-"`` (a group of one rank).
        compute_seconds, exposed_seconds, engine_seconds, step_seconds: one optimizer step's predicted compute,
            the communication not hidden behind it, the engine's own work where it adds to the compute (CPU), and
            their sum (:mod:`.timing`).
        sync_every, sync_delay, sync_why: ``replica_sync``'s window and overlap at this degree (what ``"auto"``
            chooses from the row's crossing and step, or as given), and why (0 and empty without it).
    """

    degree: int
    sharding_strategy: str
    shard: int
    replicas: int
    model_state_bytes: int
    transient_bytes: int
    buffer_bytes: int
    activation_bytes: int
    peak_bytes: int
    fits: bool
    shard_bytes: int
    replicate_bytes: int
    shard_seconds: float
    replicate_seconds: float
    shard_link: str
    replicate_link: str
    compute_seconds: float = 0.0
    exposed_seconds: float = 0.0
    step_seconds: float = 0.0
    engine_seconds: float = 0.0
    outer_bytes: int = 0
    sync_every: int = 0
    sync_delay: int = 0
    sync_why: str = ""


@dataclass(frozen=True)
class Plan:
    """The planner's answer: the recommended ``degree``, why, and every candidate's figures;
    ``activation_checkpointing`` names what the planner checkpointed because nothing fitted without it (the figures
    are then those of the checkpointed model), empty when it did not; ``replica_sync`` the option planned with
    (``None``: synchronous), and ``left_out`` the candidate degrees it left out, each with the strategies' refusal
    (``(degree, why)``: one replica group, an engine that does not run it)."""

    degree: int
    reason: str
    rows: tuple[DegreePlan, ...]
    budget_bytes: int
    headroom: float
    world_size: int
    devices_per_node: int
    fsdp_version: int
    optimizer: str
    activations: str
    links: Links
    activation_checkpointing: tuple[str, ...] = ()
    replica_sync: ReplicaSync | None = None
    left_out: tuple[tuple[int, str], ...] = ()

    def row(self, degree: int) -> DegreePlan:
        return next(r for r in self.rows if r.degree == degree)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for JSON)."""
        return asdict(self)  # (recursive: the rows and the links too)

    def table_rows(self) -> tuple[list[str], list[list[str]]]:
        from lightning_smp.accounting.render import fmt_bytes

        sync = self.replica_sync
        header = ["degree", "mesh", "model state", "transient", "activations", "peak / rank", "fits", "shard bytes",
                  # (replica_sync: nothing crosses the groups between syncs; a sync's bytes spread over its window)
                  "replica bytes" if sync is None else "replica bytes / step (a sync's / every)",
                  "comm time", "step time"]
        rows = []
        for r in self.rows:
            mark = "<- chosen" if r.degree == self.degree else ("yes" if r.fits else "no")
            state = fmt_bytes(r.model_state_bytes) + (f" + {fmt_bytes(r.outer_bytes)} outer" if r.outer_bytes else "")
            rows.append([str(r.degree), f"{r.replicas} x {r.shard}", state,
                         fmt_bytes(r.transient_bytes), fmt_bytes(r.activation_bytes), fmt_bytes(r.peak_bytes), mark,
                         f"{fmt_bytes(r.shard_bytes)} ({r.shard_link})",
                         f"{fmt_bytes(r.replicate_bytes)} ({r.replicate_link})",
                         f"{(r.shard_seconds + r.replicate_seconds) * 1e3:.1f} ms",
                         f"{r.step_seconds * 1e3:.1f} ms ({r.exposed_seconds * 1e3:.1f} exposed)"])
        return header, rows

    def title(self) -> str:
        from lightning_smp.accounting.render import fmt_bytes

        sync = self.replica_sync
        semi = "" if sync is None else (
            f", replica_sync every {sync.every} steps, {sync.fragments} fragment(s), delay {sync.delay}, compress"
            f" {sync.compress}, outer copies "
            + ("in host memory" if sync.backup == BACKUP_CPU else "on the device"))
        return (f"Degree plan: {self.world_size} rank(s), {self.devices_per_node} per node, FSDP{self.fsdp_version},"
                f" {self.optimizer}, budget {fmt_bytes(self.budget_bytes)} per rank, {self.headroom:.0%} headroom,"
                f" activations {self.activations}{semi}")

    def footer(self) -> str:
        """What the table is followed by: the reason, the chosen degree's sync schedule (``replica_sync``), and each
        degree left out with why."""
        chosen = self.row(self.degree) if self.replica_sync is not None else None
        schedule = ([f"replica_sync at degree {self.degree}: {chosen.sync_why}"
                     + (" (chosen for every/delay 'auto')" if self.replica_sync.auto else "")]
                    if chosen is not None and self.replica_sync is not None else [])
        return "\n".join([self.reason, *schedule,
                          *(f"degree {degree} left out: {why}" for degree, why in self.left_out)])

    def text(self, width: int | None = 200) -> str:
        """The table and the reason, as plain text (for logs)."""
        from lightning_smp.accounting.render import tables_text

        header, rows = self.table_rows()
        return tables_text([(self.title(), header, rows)], width=width) + f"\n{self.footer()}"

    def print(self) -> None:
        """The table and the reason on the terminal or in the notebook (rich)."""
        from lightning_smp.accounting.render import print_tables

        header, rows = self.table_rows()
        print_tables([(self.title(), header, rows)], footer=self.footer())


def _no_fit_message(rows: Sequence[DegreePlan], budget: int, headroom: float, world_size: int, source: str,
                    fsdp_version: int, mode: str, micro_batches: int, cpu_offload: bool,
                    on_host: Sequence[DegreePlan] = ()) -> str:
    """Why nothing fits and what would help; ``on_host``: the rows that fit with ``replica_sync``'s outer copies in
    host memory (planned so by the caller)."""
    from lightning_smp.accounting.render import fmt_bytes

    least = min(rows, key=lambda r: r.peak_bytes)
    helps = []
    if on_host:
        best = min(on_host, key=lambda r: r.peak_bytes)
        helps.append(f"replica_sync's backup={BACKUP_CPU!r} (the outer loop's copies in host memory: degree"
                     f" {best.degree} then needs {fmt_bytes(best.peak_bytes)} per rank, which fits)")
    if least.activation_bytes:
        helps.append(f"activation checkpointing or a smaller micro-batch (activations are"
                     f" {fmt_bytes(least.activation_bytes)} per rank)")
    if not cpu_offload:
        helps.append("CPU offload (cpu_offload=True; FSDP2: CPUOffloadPolicy())")
    helps.append(f"more devices (the model state at degree {least.degree} is {fmt_bytes(least.model_state_bytes)} per"
                 " rank and shrinks with the shard group)")
    if accumulation_mode(mode).holds_unsharded and micro_batches > 1:
        helps.extend(f"fsdp_version={other.version} (gradient_accumulation='{other.capabilities.accumulations[0]}': no unsharded"
                     " gradients between micro-batches)" for other in FSDP_ENGINES
                     if other.version != fsdp_version and not accumulation_mode(other.capabilities.accumulations[0]).holds_unsharded)
    return (f"no hybrid_shard_degree fits memory_budget={budget} bytes ({fmt_bytes(budget)}) with {headroom:.0%}"
            f" headroom on {world_size} rank(s): the least is {fmt_bytes(least.peak_bytes)} ({least.peak_bytes} bytes)"
            f" per rank at degree {least.degree} (activations {source}). What would help: " + "; ".join(helps) + ".")


__all__ = ["GIVEN", "MEASURED", "NOT_INCLUDED", "DegreePlan", "Plan"]
