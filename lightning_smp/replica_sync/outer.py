"""DiLoCo's outer loop (Douillard et al. 2023, arXiv 2311.08105) over what one rank holds of the parameters.

Each replica group trains on its own for ``every`` inner steps (the user's optimizer, nothing crossing the groups);
then each rank averages, across the replica groups, its part of the *pseudo-gradient* (the parameters as last synced
minus as they are now), an outer optimizer (SGD, Nesterov momentum: the paper's, torchft's and torchtitan's) steps
the synced copy with it, and every group takes the result. Rank ``r`` of every group holds the same part of every
parameter (the same sharding in every group), so the average runs over the mesh's replicate axis, one rank of each
group, and the groups leave a sync bit-equal.

Streaming DiLoCo (arXiv 2501.18512) syncs ``fragments`` contiguous pieces of the model in turn, each every
``every`` steps at its own offset, with its own outer optimizer (one outer optimizer over several fragments would step
the others on stale pseudo-gradients: a pitfall measured in torchft 0.2.0).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_smp.errors import HybridShardConfigError
from lightning_smp.names import AUTO, COMPRESS_NONE
from lightning_smp.replica_sync.auto import CALIBRATION_STEPS, Calibration, Schedule
from lightning_smp.replica_sync.compress import Exchange, check_compression, sync_payload_bytes
from lightning_smp.replicas import broadcast_tensors, local_part

#: Largest flat buffer of one all-reduce of pseudo-gradients, in bytes (DDP's default bucket is 25 MiB).
BUCKET_BYTES = 25 * 1024 * 1024


def fragment_sizes(numels: Sequence[int], fragments: int) -> list[int]:
    """How many of the tensors (in order, sizes ``numels``) each of ``fragments`` contiguous fragments takes: as
    equal in elements as whole tensors allow, none empty."""
    if not 1 <= fragments <= len(numels):
        raise HybridShardConfigError(
            f"replica_sync fragments={fragments} for {len(numels)} parameters: each fragment needs at least one."
            f" Fix: fragments between 1 and {len(numels)}."
        )
    total, sizes, start, taken = sum(numels), [], 0, 0
    for fragment in range(fragments):
        target = total * (fragment + 1) / fragments
        end = start + 1
        left = fragments - fragment - 1  # fragments after this one, each needs a tensor
        while end < len(numels) - left and taken + sum(numels[start:end]) + numels[end] / 2 <= target:
            end += 1
        if fragment == fragments - 1:
            end = len(numels)
        sizes.append(end - start)
        taken += sum(numels[start:end])
        start = end
    return sizes


class Rounds(Protocol):
    """How a sync crosses replica groups that are separate jobs (:class:`~lightning_smp.fault_tolerance.rounds.SyncRounds`
    on torchft): it syncs at least ``indices`` (more if another group asks for more), through the outer loop's
    :meth:`OuterSync.pseudo_gradients`, :meth:`OuterSync.step_outer` and :meth:`OuterSync.roll_back`."""

    def start(self, outer: OuterSync) -> None: ...

    def sync(self, outer: OuterSync, indices: list[int], *, after_step: bool) -> None: ...


@dataclass(frozen=True)
class SyncReport:
    """What one sync did, as this rank saw it (:attr:`OuterSync.report`; the front ends log it: :meth:`metrics`)."""

    #: syncs committed so far (this one included)
    syncs: int
    #: the inner step it came after
    step: int
    #: the fragments it carried
    fragments: tuple[int, ...]
    #: the groups whose pseudo-gradients it averaged
    groups: int
    #: bytes this rank sent across the groups for the pseudo-gradients: a ring all-reduce of its part of them
    #: sends 2 (groups - 1) / groups times their bytes
    sent_bytes: int
    #: wall time of its crossing(s)
    seconds: float
    #: the norm of the averaged pseudo-gradient (the whole model's, over the group's ranks): how far the outer step
    #: moves the synced weights before its learning rate and momentum
    pseudo_gradient_norm: float
    #: how far this group had drifted from the average: the norm of its own pseudo-gradient minus the average, over
    #: the average's norm, over the fragments it trained and sent (0: every group trained alike; about 1 and above:
    #: the groups' windows disagree; NaN: it sent none, having just healed or not trained them)
    drift: float

    def metrics(self) -> dict[str, float]:
        """As metrics for a logger: ``replica_sync/syncs``, ``replica_sync/fragment`` (the first it carried),
        ``replica_sync/sent_bytes``, ``replica_sync/seconds``, ``replica_sync/pseudo_gradient_norm``,
        ``replica_sync/drift``."""
        return {"replica_sync/syncs": float(self.syncs),
                "replica_sync/fragment": float(self.fragments[0]) if self.fragments else -1.0,
                "replica_sync/sent_bytes": float(self.sent_bytes), "replica_sync/seconds": self.seconds,
                "replica_sync/pseudo_gradient_norm": self.pseudo_gradient_norm, "replica_sync/drift": self.drift}


@dataclass
class Fragment:
    """One fragment: its parameters, their copies as last synced (what the outer optimizer steps), the outer
    optimizer, and the step of the window at which it syncs."""

    params: list[Tensor]
    synced: list[torch.nn.Parameter]
    outer: torch.optim.SGD
    offset: int
    #: the inner step count at its last sync (0: the start, when the synced copies were taken)
    synced_at: int = 0

    @property
    def parts(self) -> list[Tensor]:
        """This rank's part of each parameter, taken anew each time (loading a state dict may give a sharded
        parameter new local storage: FSDP2's ``reset_sharded_param``)."""
        return [local_part(p) for p in self.params]

    def momentum(self) -> list[Tensor]:
        """The outer optimizer's momentum buffer of each of its parameters (empty without momentum)."""
        return [self.outer.state[synced]["momentum_buffer"] for synced in self.synced
                if "momentum_buffer" in self.outer.state.get(synced, {})]


class OuterSync:
    """The outer loop of DiLoCo over ``parameters`` (this rank's model parameters, plain or ``DTensor``), averaging
    across ``group`` (the process group of the replicate axis: this rank's peers in the other replica groups).

    Call :meth:`after_step` after every inner optimizer step (it syncs the fragments whose turn it is) and
    :meth:`sync` to sync every fragment that trained since its last sync (training that stops between syncs). The
    synced copies live on ``backup_device`` (default: the parameters' device). ``buffers`` (BatchNorm's running
    statistics, ...) are not averaged: each sync gives every group the first group's, as DDP gives every rank
    rank 0's.

    The outer optimizer's momentum starts as zeros: with SGD's dampening 0 its first step is then the same as
    torch's first step without a buffer, and the state exists from the start (a checkpoint holds it whole).
    """

    #: how an overlapped crossing lands: ``None``, the rule above (the group's parameters move by the synced copy's
    #: move); a number ``alpha``, Streaming DiLoCo's mix ``(1 - alpha) x synced + alpha x the group's own``, which the
    #: benchmark measures against (``make bench-semi-sync``)
    mix: float | None = None

    def __init__(self, parameters: Iterable[Tensor], group: dist.ProcessGroup | None, *, every: int | str,
                 outer_lr: float = 1.0, outer_momentum: float = 0.0, nesterov: bool = False, fragments: int = 1,
                 backup_device: torch.device | None = None, bucket_bytes: int = BUCKET_BYTES,
                 buffers: Iterable[Tensor] = (), rounds: Rounds | None = None,
                 group_ranks: dist.ProcessGroup | None = None, delay: int | str = 0,
                 compress: str = COMPRESS_NONE) -> None:
        trained = [p for p in parameters if p.requires_grad]
        check_compression(compress)
        #: ``every`` or ``delay`` left to the first sync's measurement (:mod:`lightning_smp.replica_sync.auto`): until
        #: then the first sync comes after :data:`CALIBRATION_STEPS` steps, blocking, every fragment at once
        self.calibration: Calibration | None = None
        #: what ``"auto"`` chose, once it has (``None``: nothing to choose, or not yet)
        self.chosen: Schedule | None = None
        if AUTO in (every, delay):
            if every != AUTO and (isinstance(every, bool) or not isinstance(every, int) or every < fragments
                                  or every % fragments):
                raise HybridShardConfigError(
                    f"replica_sync every={every!r} with delay='auto' and fragments={fragments}: not a multiple of the"
                    f" fragments. Fix: e.g. every={20 * fragments}, or every='auto'.")
            if delay != AUTO and (isinstance(delay, bool) or not isinstance(delay, int) or delay < 0):
                raise HybridShardConfigError(
                    f"replica_sync delay={delay!r} with every='auto' is not a number of steps >= 0. Fix: e.g."
                    " delay=2, or delay='auto'.")
            self.calibration = Calibration(every=every, delay=delay, fragments=fragments)
            every, delay = CALIBRATION_STEPS * fragments, 0
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise HybridShardConfigError(f"replica_sync every={every!r} is not a number of steps >= 1. Fix: e.g. 20.")
        if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < every // fragments:
            raise HybridShardConfigError(
                f"replica_sync delay={delay!r} with every={every}, fragments={fragments}: the crossing must land"
                f" before the next fragment's sync. Fix: a delay from 0 to {max(every // fragments - 1, 0)}.")
        if every % fragments:
            raise HybridShardConfigError(
                f"replica_sync every={every} is not a multiple of fragments={fragments}: the fragments sync in turn,"
                f" each every {every} steps. Fix: every={every - every % fragments or fragments}, or fragments=1."
            )
        self.group = group
        #: how a sync crosses the replica groups when they are separate jobs (``fault_tolerance``: torchft's quorum,
        #: all-reduce and commit vote); ``None``: an all-reduce over :attr:`group`
        self.rounds = rounds
        self.every = every
        #: inner steps a crossing runs under before its outer step lands (0: each sync blocks)
        self.delay = delay
        #: how the pseudo-gradients cross (:mod:`lightning_smp.replica_sync.compress`)
        self.compress = compress
        #: the step from which the fragments' turns count (after a calibration, the step of its sync)
        self.origin = 0
        self._in_flight: list[InFlight] = []
        #: the collectives across the groups started since the last inner step (by kind: ``"all_reduce"``, or
        #: under ``compress`` ``"other"``, the all-to-all, and ``"all_gather"``): what crossed in that step
        self.crossed: list[str] = []
        #: the trained parameters, in the order the fragments cut them
        self.parameters = trained
        self.buffers = [b for b in buffers if b.numel()]
        self._kept: list[list[Tensor]] | None = None  # this group's own parts while the synced ones are shown
        self.bucket_bytes = bucket_bytes
        self.steps = 0  # inner steps since the start (a checkpoint carries it)
        #: the ranks of this rank's own replica group (the norms of a sync's report are the whole model's over them;
        #: ``None``: the default group's)
        self.group_ranks = group_ranks
        #: syncs committed so far, and the last one's report (``None`` before the first)
        self.syncs = 0
        self.report: SyncReport | None = None
        self.fragments: list[Fragment] = []
        start = 0
        # (whole parameters' sizes, a DTensor's too: every rank cuts the same fragments, one collective each)
        for index, size in enumerate(fragment_sizes([p.numel() for p in trained], fragments)):
            params = trained[start:start + size]
            parts = [local_part(p) for p in params]
            start += size
            synced = [torch.nn.Parameter(_backup(part, backup_device)) for part in parts]
            outer = torch.optim.SGD(synced, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
            if outer_momentum:
                for copy in synced:
                    outer.state[copy]["momentum_buffer"] = torch.zeros_like(copy)
            self.fragments.append(Fragment(params, synced, outer, (index + 1) * every // fragments % every))

    def after_step(self) -> list[int]:
        """After an inner optimizer step: land the crossings whose delay ran out (their outer step), then sync the
        fragments whose turn it is; returns their indices."""
        self.steps += 1
        self.crossed.clear()
        if self.calibration is not None:
            return self._calibrate()
        for flight in self._in_flight:  # (a compressed crossing's next stage starts once its first is done)
            if not flight.poll():
                break  # (the next flight's stages after this one's, on every rank)
        landing = [flight for flight in self._in_flight if flight.lands <= self.steps]
        if landing:
            self.hide_synced()
            self._land(landing)
        due = [index for index, fragment in enumerate(self.fragments)
               if (self.steps - self.origin) % self.every == fragment.offset]
        self._sync_fragments(due, after_step=True)
        return due

    def sync(self) -> list[int]:
        """Sync every fragment that trained since its last sync (training that stops between syncs: a checkpoint,
        the end of fit), a crossing in flight landed first; the groups leave bit-equal. Returns the fragments synced
        (none: the groups are equal already, and nothing is sent)."""
        self.drain()
        pending = [index for index, fragment in enumerate(self.fragments) if fragment.synced_at < self.steps]
        self._sync_fragments(pending, after_step=False)
        return pending

    def _drop_in_flight(self) -> None:
        """Every crossing in flight completed (its collectives stay paired across ranks) and dropped, unapplied;
        nothing shown in place of this group's parameters any more (a load replaces both)."""
        for flight in self._in_flight:
            for _, exchange in flight.exchanges:
                exchange.wait()
        self._in_flight.clear()
        self._kept = None

    def drain(self) -> None:
        """Land every crossing in flight now (a checkpoint, the end of fit, a sync of every fragment)."""
        if self._in_flight:
            self.hide_synced()
            self._land(list(self._in_flight))

    def _calibrate(self) -> list[int]:
        """``every`` or ``delay`` ``"auto"``: time the steps, and at the calibration's step sync every fragment,
        blocking, timed; then choose (the same on every rank: the slowest rank's figures)."""
        calibration = self.calibration
        assert calibration is not None
        device = self.parameters[0].device if self.parameters else torch.device("cpu")
        _synchronize(device)  # (an accelerator's queue drained: the step's time, not its launch's)
        calibration.step_done()
        if len(calibration.marks) < self.every:  # (timed steps: a run resumed past them still times its own)
            return []
        due = list(range(len(self.fragments)))
        started = time.perf_counter()
        self._sync_fragments(due, after_step=True)
        _synchronize(device)
        crossing = time.perf_counter() - started
        self.chosen = calibration.choose(crossing, device)
        self.calibration = None
        self._reschedule(self.chosen.every, self.chosen.delay, self.steps)
        rank_zero_info(f"replica_sync chose from {self.chosen.why}")
        return due

    @torch.no_grad()
    def show_synced(self) -> None:
        """Put the parameters as last synced in place of this group's own (every group then holds the same model,
        without a sync: nothing is sent), until :meth:`hide_synced` or the next sync, which put this group's back
        first (training continues as if nothing had been shown). Nothing when no fragment trained since its last
        sync."""
        if not self.pending or self._kept is not None:
            return
        self._kept = [[part.clone() for part in fragment.parts] for fragment in self.fragments]
        for fragment in self.fragments:
            for synced, part in zip(fragment.synced, fragment.parts):
                part.copy_(synced)

    @torch.no_grad()
    def hide_synced(self) -> None:
        """This group's own parameters back in place of those :meth:`show_synced` put there (nothing if none)."""
        if self._kept is None:
            return
        for fragment, own in zip(self.fragments, self._kept):
            for part, value in zip(fragment.parts, own):
                part.copy_(value)
        self._kept = None

    @property
    def state_bytes(self) -> int:
        """Bytes this rank keeps for the outer loop: the synced copies of its parts and the outer momentum."""
        return sum(t.numel() * t.element_size() for fragment in self.fragments
                   for t in (*fragment.synced, *fragment.momentum()))

    @property
    def sync_bytes(self) -> int:
        """Bytes of the pseudo-gradients this rank's part of one full window puts into the crossing: every fragment
        once, its parts in the parameters' dtype, or encoded (``compress``)."""
        return sum(sync_payload_bytes(sum(part.numel() for part in fragment.parts), self.compress,
                                      fragment.parts[0].element_size())
                   for fragment in self.fragments if fragment.parts)

    @property
    def pending(self) -> bool:
        """Whether some fragment trained since its last sync, or a crossing is in flight (the groups may differ)."""
        return bool(self._in_flight) or any(fragment.synced_at < self.steps for fragment in self.fragments)

    def schedule(self) -> dict[str, int] | None:
        """When the fragments sync: ``every``, ``delay`` and the step their turns count from (a checkpoint keeps
        them: ``"auto"`` chose them once); ``None`` while ``"auto"`` has not chosen yet."""
        if self.calibration is not None:
            return None
        return {"every": self.every, "delay": self.delay, "origin": self.origin, "fragments": len(self.fragments)}

    @property
    def schedule_chosen(self) -> bool:
        """Whether ``"auto"`` chose the schedule (a checkpoint then keeps it)."""
        return self.chosen is not None

    def set_schedule(self, schedule: dict[str, Any]) -> bool:
        """Back from :meth:`schedule` (a checkpoint of a run whose ``"auto"`` chose them: no new calibration), where
        it fits this loop (its fragments, and ``every`` or ``delay`` as given, not ``"auto"``); returns whether it
        did (else the loop calibrates as if new, and the caller says why)."""
        every, delay, origin = (int(schedule[k]) for k in ("every", "delay", "origin"))
        fragments = len(self.fragments)
        given = self.calibration
        if (int(schedule.get("fragments", fragments)) != fragments or every % fragments
                or not 0 <= delay < every // fragments
                or (given is not None and given.every != AUTO and int(given.every) != every)
                or (given is not None and given.delay != AUTO and int(given.delay) != delay)):
            return False
        if given is not None:
            self.chosen = Schedule(every, delay, f"every {every} steps, delay {delay}: kept by the checkpoint")
        self.calibration = None
        self._reschedule(every, delay, origin)
        return True

    def _reschedule(self, every: int, delay: int, origin: int) -> None:
        """The fragments' turns every ``every`` steps counted from step ``origin``, each crossing under ``delay``."""
        self.every, self.delay, self.origin = every, delay, origin
        for index, fragment in enumerate(self.fragments):
            fragment.offset = (index + 1) * every // len(self.fragments) % every

    def _sync_fragments(self, indices: list[int], *, after_step: bool) -> None:
        if indices:
            self.hide_synced()  # (a sync while the synced weights are shown: a checkpoint during validation)
        if self.rounds is not None:
            if indices:
                self.rounds.sync(self, indices, after_step=after_step)
            return
        flights = [self._launch(index, overlapped=bool(self.delay) and after_step) for index in indices]
        if self.delay and after_step:
            self._in_flight.extend(flights)  # (each lands ``delay`` steps later, in :meth:`after_step`)
        elif flights:
            self._land(flights)

    @torch.no_grad()
    def _launch(self, index: int, overlapped: bool = False) -> InFlight:
        """Fragment ``index``'s crossing started: its pseudo-gradients on their way to the average, in flat buckets,
        each an :class:`~lightning_smp.replica_sync.compress.Exchange` of its own (``overlapped``: training goes on
        while it crosses, and the parameters as sent are kept for its landing)."""
        fragment = self.fragments[index]
        started = time.perf_counter()
        exchanges = []
        for bucket in _buckets(self.pseudo_gradients(fragment), self.bucket_bytes):
            flat = _flatten_dense_tensors(bucket)  # (only the flat buffers are held while it crosses)
            if self.compress != COMPRESS_NONE:
                flat = flat.float()  # (the codes and scales are taken from float32)
            shapes = [torch.empty_like(t, device="meta") for t in bucket]  # (to cut the average back into tensors)
            exchanges.append((shapes, Exchange(flat, self.group, self.compress, log=self.crossed)))
        sent = [part.clone() for part in fragment.parts] if overlapped else None
        return InFlight(index, exchanges, sent, fragment.synced_at < self.steps, self.steps,
                        self.steps + (self.delay if overlapped else 0), time.perf_counter() - started)

    @torch.no_grad()
    def _land(self, flights: list[InFlight]) -> None:
        """The crossings of ``flights`` completed (waiting where they have not) and their outer steps taken: each
        fragment's synced copies stepped with the average, its parameters set to them, or, where training went on
        while it crossed, moved by as much as the synced copies moved (the group keeps its own progress of those
        steps). One report for them all."""
        measured, seconds, payload = torch.zeros(3, dtype=torch.float64), 0.0, 0
        for flight in flights:
            started = time.perf_counter()
            average: list[Tensor] = []
            for shapes, exchange in flight.exchanges:
                average += _unflatten_dense_tensors(exchange.wait(), shapes)
                payload += exchange.sent_bytes
            seconds += flight.seconds + time.perf_counter() - started
            fragment = self.fragments[flight.fragment]
            for synced, gradient in zip(fragment.synced, average, strict=True):
                synced.grad = gradient.to(device=synced.device, dtype=synced.dtype)
            measured += self.measure(fragment, own=flight.trained, sent=flight.sent)
            if flight.sent is None or flight.launched == self.steps:
                self.step_outer(fragment)
            else:
                fragment.outer.step()
                fragment.outer.zero_grad(set_to_none=True)
                for part, synced, sent in zip(fragment.parts, fragment.synced, flight.sent):
                    if self.mix is None:
                        part.add_(synced.to(part.device) - sent)  # (the synced copy's move, from where it was sent)
                    else:  # (Streaming DiLoCo's rule, measured against: a mix of the new synced copy and the group's)
                        part.mul_(self.mix).add_(synced.to(part.device), alpha=1 - self.mix)
                fragment.synced_at = flight.launched  # (the steps since are this group's own: still to sync)
            if flight in self._in_flight:
                self._in_flight.remove(flight)
        if flights:
            groups = dist.get_world_size(self.group)
            self.record([flight.fragment for flight in flights], measured, groups=groups, sent_bytes=payload,
                        seconds=seconds)
        if flights and self.buffers:
            broadcast_tensors(self.buffers, dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                              self.group, self.buffers[0].device)

    @torch.no_grad()
    def pseudo_gradients(self, fragment: Fragment) -> list[Tensor]:
        """This rank's part of ``fragment``'s pseudo-gradient: the parameters as last synced minus as they are now."""
        return [synced.to(part.device) - part for synced, part in zip(fragment.synced, fragment.parts)]

    @torch.no_grad()
    def measure(self, fragment: Fragment, own: bool = True, sent: list[Tensor] | None = None) -> Tensor:
        """Before ``fragment``'s outer step, with the averaged pseudo-gradient in its synced copies' ``.grad``: this
        rank's squared norms of (its own pseudo-gradient minus the average) and of the average where ``own`` (this
        group trained the fragment and sent its own part; zeros otherwise), and of the average, float64 on the CPU
        (its own is taken again from the parameters as they were sent: ``sent``, or the parameters themselves, which
        nothing has moved since)."""
        sums = []  # (on the parameters' device, brought to the CPU once: no wait per parameter)
        for synced, part in zip(fragment.synced, sent if sent is not None else fragment.parts):
            if synced.grad is None:
                continue
            mean = synced.grad.to(part.device, torch.float64)
            drift = ((synced.to(part.device, torch.float64) - part.to(torch.float64) - mean).square().sum() if own
                     else torch.zeros((), dtype=torch.float64, device=part.device))
            sums.append(torch.stack([drift, mean.square().sum()]))
        drift, average = torch.stack(sums).sum(0).cpu() if sums else torch.zeros(2, dtype=torch.float64)
        return torch.stack([drift, average if own else torch.zeros_like(average), average])

    def record(self, indices: Sequence[int], measured: Tensor, *, groups: int, sent_bytes: int,
               seconds: float) -> None:
        """A committed sync of ``indices`` (``measured``: :meth:`measure`'s sums over its fragments): the report,
        its norms summed over this replica group's ranks (one all-reduce of three numbers inside the group, on the
        parameters' device, at the sync; nothing between syncs)."""
        if dist.is_initialized() and dist.get_world_size(self.group_ranks) > 1:
            device = self.parameters[0].device if self.parameters else measured.device
            summed = measured.to(device)  # (NCCL takes no CPU tensor)
            dist.all_reduce(summed, group=self.group_ranks)
            measured = summed.cpu()
        drift, own, average = (math.sqrt(max(float(v), 0.0)) for v in measured)
        self.syncs += 1
        self.report = SyncReport(self.syncs, self.steps, tuple(indices), groups, sent_bytes, seconds, average,
                                 drift / own if own > 0 else math.nan)

    @torch.no_grad()
    def step_outer(self, fragment: Fragment) -> None:
        """The outer step of ``fragment`` with the averaged pseudo-gradient in its synced copies' ``.grad``; every
        group then takes the result."""
        fragment.outer.step()
        fragment.outer.zero_grad(set_to_none=True)
        self.roll_back(fragment)

    @torch.no_grad()
    def roll_back(self, fragment: Fragment) -> None:
        """``fragment``'s parameters set to its synced copies (after an outer step: the new ones; after a sync that
        was not committed: the last synced, the window's own training dropped, as torchft's DiLoCo drops it)."""
        for synced, part in zip(fragment.synced, fragment.parts):
            part.copy_(synced)
        fragment.synced_at = self.steps

    def state_dict(self) -> dict[str, Any]:
        """The steps, each fragment's synced copies and its outer optimizer's state (this rank's parts)."""
        if self._in_flight:  # (the front ends sync before they save: nothing of a crossing is lost)
            raise RuntimeError("OuterSync.state_dict() with a crossing in flight: call sync() or drain() first")
        return {"steps": self.steps,
                "fragments": [{"synced": [s.detach().clone() for s in f.synced], "outer": f.outer.state_dict(),
                               "synced_at": f.synced_at} for f in self.fragments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back from :meth:`state_dict` (the same parameters and fragments); a crossing in flight is dropped."""
        self._drop_in_flight()
        self.steps = int(state["steps"])
        for fragment, saved in zip(self.fragments, state["fragments"], strict=True):
            with torch.no_grad():
                for synced, value in zip(fragment.synced, saved["synced"], strict=True):
                    synced.copy_(value)
            fragment.outer.load_state_dict(saved["outer"])
            fragment.synced_at = int(saved.get("synced_at", self.steps))

    def momentum(self) -> list[Tensor]:
        """The outer momentum of each trained parameter's part, in :attr:`parameters`' order (empty without
        momentum)."""
        return [buffer for fragment in self.fragments for buffer in fragment.momentum()]

    @torch.no_grad()
    def restart_from_parameters(self, steps: int, momentum: list[Tensor] | None) -> None:
        """After a checkpoint (a sync point: the parameters are the synced ones) was loaded: the synced copies taken
        from the parameters, ``steps`` inner steps done, the outer momentum ``momentum`` (this rank's parts, in
        :attr:`parameters`' order; ``None``: zeros, a checkpoint without it). A crossing in flight is dropped: it
        belonged to the weights the checkpoint replaced."""
        self._drop_in_flight()
        self.steps = steps
        buffers = iter(momentum) if momentum is not None else None
        for fragment in self.fragments:
            fragment.synced_at = steps
            for synced, part in zip(fragment.synced, fragment.parts):
                synced.copy_(part)
                state = fragment.outer.state.get(synced, {})
                if "momentum_buffer" in state:
                    if buffers is None:
                        state["momentum_buffer"].zero_()
                    else:
                        state["momentum_buffer"].copy_(next(buffers))


@dataclass
class InFlight:
    """A fragment's crossing on its way (:meth:`OuterSync._launch`), until it lands (:meth:`OuterSync._land`)."""

    fragment: int
    #: each bucket of this rank's part of the fragment's pseudo-gradient (its tensors' shapes, on the meta device)
    #: and its exchange, which averages it in a flat buffer
    exchanges: list[tuple[list[Tensor], Exchange]]
    #: the parameters as they were sent, where training goes on while it crosses (``delay``); else ``None``
    sent: list[Tensor] | None
    #: whether this group trained the fragment since its last sync (its own pseudo-gradient is in the average)
    trained: bool
    #: the inner step it left at, and the one it lands after
    launched: int
    lands: int
    #: the wall time its start took (the pseudo-gradients taken and the first collectives launched)
    seconds: float

    def poll(self) -> bool:
        """Advance the exchanges whose collectives completed, in bucket order, without waiting; stop at the first
        still under way (each rank then starts the next stages' collectives in the same order: gloo pairs a process
        group's collectives by the order they were issued). True when all are done."""
        return all(exchange.poll() for _, exchange in self.exchanges)  # (all() stops at the first False)


def _buckets(tensors: Sequence[Tensor], bucket_bytes: int) -> Iterator[list[Tensor]]:
    """``tensors`` in order, cut into runs of one dtype and device of at most ``bucket_bytes`` each (a tensor larger
    than that alone)."""
    bucket: list[Tensor] = []
    filled = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if bucket and (tensor.dtype != bucket[0].dtype or tensor.device != bucket[0].device
                       or filled + size > bucket_bytes):
            yield bucket
            bucket, filled = [], 0
        bucket.append(tensor)
        filled += size
    if bucket:
        yield bucket


def _synchronize(device: torch.device) -> None:
    """Wait for what ``device`` has queued (an accelerator's collectives and kernels return to the host at once)."""
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


def _backup(part: Tensor, device: torch.device | None) -> Tensor:
    """A copy of ``part`` on ``device`` (``None``: its own), pinned when it leaves an accelerator for the host (the
    copies at each sync then run at the link's speed, as torchft's ``pin_memory``)."""
    copy = part.detach().to(device or part.device, copy=True)
    if copy.device.type == "cpu" and part.device.type != "cpu":
        copy = copy.pin_memory()
    return copy


__all__ = ["BUCKET_BYTES", "Fragment", "InFlight", "OuterSync", "Rounds", "SyncReport", "fragment_sizes"]
