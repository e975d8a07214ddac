"""``replica_sync``'s ``every="auto"`` and ``delay="auto"``: the shortest window whose crossing hides under the
window's compute, from a measured crossing and a measured step.

A sync's crossing takes ``c`` seconds (a fragment's ``c / fragments``), an inner step ``s``. Overlapped by ``delay``
steps, a fragment's crossing is hidden where ``c / fragments <= delay * s``; what is left shows once per fragment
sync. ``delay="auto"`` takes the steps the crossing needs, times :data:`HIDE_MARGIN` (a crossing shares the host's
cores and the link with the step it runs under), and ``every="auto"`` the smallest window (a multiple of the
fragments, each fragment's turn longer than the delay) whose shown crossing costs at most :data:`EXPOSED_SHARE` of
its compute and whose crossings keep the link busy at most :data:`LINK_SHARE` of the time. Shorter windows keep the groups closer (the benchmark's quality is best at the shortest ``every``),
so the smallest that meets the cost is the choice.

At run time the outer loop measures both once (:class:`Calibration`): the first :data:`CALIBRATION_STEPS` steps
per fragment are timed, then every fragment syncs at once, blocking and timed; the slowest rank's figures decide,
the same on every rank. The planner makes the same choice from its calibrated link and its step estimate
(:func:`choose_schedule`).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_smp.names import AUTO

#: inner steps (per fragment) timed before the first sync, which measures the crossing
CALIBRATION_STEPS = 10
#: the largest share of a window's compute that a crossing may show (1.05 x the compute bound)
EXPOSED_SHARE = 0.05
#: how much longer than its measured time (blocking, the cores idle) a crossing is given to hide under compute (it
#: shares the host's cores and the link with the steps it runs under)
HIDE_MARGIN = 1.5
#: the largest share of a fragment's turn its crossing may keep the link busy (measured on ``make bench-semi-sync``:
#: a window with the link busy 63 % of the time cost 1.19x the compute bound, windows at 20-25 % 1.06-1.11x)
LINK_SHARE = 0.5


@dataclass(frozen=True)
class Schedule:
    """What ``"auto"`` chose, and why (one sentence for the log and the plan)."""

    every: int
    delay: int
    why: str
    #: seconds per window that the crossings do not hide (what a window costs beyond its compute)
    shown_s: float = 0.0


def choose_schedule(crossing_s: float, step_s: float, fragments: int, every: int | str,
                    delay: int | str) -> Schedule:
    """``every`` and ``delay`` where either is ``"auto"`` (the other as given; both given: they are kept, and the
    time they show is estimated), for a sync whose crossing takes ``crossing_s`` and an inner step ``step_s``."""
    per_fragment = crossing_s / fragments
    if step_s <= 0:  # (a plan without the device's throughput: nothing to hide the crossing under is known)
        if AUTO in (every, delay):
            return Schedule(0 if every == AUTO else int(every), 0 if delay == AUTO else int(delay),
                            f"a crossing of {crossing_s:.3g} s and no step time (the device's throughput unknown):"
                            " 'auto' chooses at run time, from its own measurement", crossing_s)
        return Schedule(int(every), int(delay), f"a crossing of {crossing_s:.3g} s, every {every} steps, delay"
                        f" {delay} (the step time unknown)", crossing_s)
    if delay == AUTO:
        delay = math.ceil(per_fragment * HIDE_MARGIN / step_s)
        if every != AUTO:  # (a given window caps it: the crossing lands before the next fragment's turn)
            delay = min(delay, int(every) // fragments - 1)
    delay = int(delay)
    if every == AUTO:  # (with the margin: what may show, and how long the link is busy)
        margined = max(0.0, per_fragment * HIDE_MARGIN - delay * step_s) * fragments
        every = max(delay + 1, math.ceil(margined / (EXPOSED_SHARE * step_s * fragments)),
                    math.ceil(per_fragment * HIDE_MARGIN / (LINK_SHARE * step_s)), 1) * fragments
    every = int(every)
    shown = max(0.0, per_fragment - delay * step_s) * fragments  # (per window, as measured)
    compute = f"the window's {every * step_s:.3g} s of compute"
    hidden = (f"hidden under {compute}" if shown == 0 else
              f"{shown:.3g} s shown per window, {shown / (every * step_s):.1%} of {compute}")
    why = (f"a crossing of {crossing_s:.3g} s ({per_fragment:.3g} s per fragment) and a step of {step_s:.3g} s:"
           f" delay {delay} step(s), every {every} steps ({hidden})")
    return Schedule(every, delay, why, shown)


@dataclass
class Calibration:
    """The measurement ``"auto"`` chooses from, taken by :class:`~lightning_smp.replica_sync.outer.OuterSync`:
    the time of each inner step (:meth:`step_done`), then the first sync's crossing (:meth:`choose`)."""

    every: int | str
    delay: int | str
    fragments: int
    marks: list[float] = field(default_factory=list)
    #: what was chosen (``None`` until then)
    chosen: Schedule | None = None

    def step_done(self) -> None:
        self.marks.append(time.perf_counter())

    def step_seconds(self) -> float:
        """The median step between the marks (the first, which starts the clock, and warm-up aside)."""
        gaps = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return statistics.median(gaps) if gaps else 0.0

    def choose(self, crossing_s: float, device: torch.device) -> Schedule:
        """``every`` and ``delay`` from this rank's step and ``crossing_s``, the slowest rank's of both (one all-reduce
        over the world: every rank chooses alike)."""
        figures = torch.tensor([self.step_seconds(), crossing_s], dtype=torch.float64, device=device)
        if dist.is_initialized():
            dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        step_s, crossing = (float(v) for v in figures.cpu())
        self.chosen = choose_schedule(crossing, step_s, self.fragments, self.every, self.delay)
        return self.chosen


__all__ = ["CALIBRATION_STEPS", "EXPOSED_SHARE", "HIDE_MARGIN", "LINK_SHARE", "Calibration", "Schedule", "choose_schedule"]
