"""The process group across replica groups, and what ends a crossing when a group vanishes (``fault_tolerance``).

Two things torchft 0.2.0's process group across groups does not do (measured on torch 2.13, gloo):

- a collective whose peer vanished without closing its connections (power lost, a link cut) waits out the process
  group's timeout (``fault_tolerance.timeout``): ``abort()`` does not unblock a gloo operation, and dropping the
  process group waits for the same operation in its destructor, which joins its worker threads;
- gloo binds to ``GLOO_SOCKET_IFNAME``'s interface or to the address the host name resolves to, which need not be the
  address the other groups reach (a host name that resolves to 127.0.1.1, as on a default Debian install).

Here the gloo process group across groups is bound to the address the option resolves (``host``); a crossing is
waited for in slices and, once it has been in flight for ``grace`` seconds, the lighthouse's status page is read
between slices (:class:`LighthouseWatch`): a participant the lighthouse has stopped hearing from ends the wait (the
step is dropped, as for any failed collective, and the next quorum forms without that group). A gloo process group
that torchft replaces (at every new quorum) is kept alive by a reaper thread until its last operation has ended, so
that neither the training thread nor torchft's quorum thread waits for an abandoned one. NCCL's and XCCL's process
groups are torchft's own, whose ``abort()`` ends an operation in flight.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: one heartbeat on the lighthouse's status page (torchft 0.2.0's template): its class has ``old`` once the lighthouse
#: stopped hearing from the replica for its heartbeat timeout, and the text starts with the replica's id
_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*(.+?): seen ', re.DOTALL)


#: the quorum the lighthouse formed last (it bumps the id when the members change, or a member failed its last commit)
_QUORUM_ID = re.compile(r"Current quorum_id:\s*(-?\d+)")
#: the next quorum's requests so far: ``[healthy/all participants healthy]`` (torchft 0.2.0's status line)
_PENDING = re.compile(r"\[(\d+)/(\d+) participants healthy\]")


def heard_from(page: str) -> dict[str, bool]:
    """Every replica on a lighthouse status page, and whether the lighthouse still hears from it."""
    return {replica.strip(): not old for old, replica in _HEARTBEAT.findall(page)}


@dataclass(frozen=True)
class LighthouseView:
    """What a lighthouse's status page says at one moment: every replica group it lists and whether it still hears
    from it, the id of the quorum it formed last (``None``: not on the page), and how many groups have asked for the
    next quorum."""

    heard: dict[str, bool]
    quorum_id: int | None
    pending: int

    @classmethod
    def of(cls, page: str) -> LighthouseView:
        quorum = _QUORUM_ID.search(page)
        pending = _PENDING.search(page)
        return cls(heard_from(page), int(quorum.group(1)) if quorum else None, int(pending.group(2)) if pending else 0)

    def silent(self, replica_ids: Sequence[str]) -> list[str]:
        """Those of ``replica_ids`` the lighthouse has stopped hearing from (marked old, or not listed)."""
        return [replica for replica in replica_ids if not self.heard.get(replica, False)]


class LighthouseWatch:
    """The lighthouse's status page (``/status``), read: which replica groups it has stopped hearing from (those it
    marks old, or does not list), the quorum it formed last, who asks for the next. A page that cannot be read
    concludes nothing (``None``), and is remembered (:attr:`lost_since`): a rank that cannot reach the lighthouse may
    have been cut off from it, and from its peers."""

    def __init__(self, lighthouse_url: str, timeout: float = 2.0) -> None:
        self.url = f"{lighthouse_url.rstrip('/')}/status"
        self.timeout = timeout
        #: when a read failed last (``time.monotonic()``), ``None`` if none has
        self.lost_since: float | None = None

    def view(self) -> LighthouseView | None:
        """The page now; ``None``: no answer (recorded in :attr:`lost_since`)."""
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout) as page:
                return LighthouseView.of(page.read().decode("utf-8", "replace"))
        except Exception as err:  # noqa: BLE001  # (OSError, or an answer cut short: no verdict either way)
            self.lost_since = time.monotonic()
            log.debug("the lighthouse's status page could not be read: %s", err)
            return None

    def heard(self) -> dict[str, bool] | None:
        """Every replica group the lighthouse lists and whether it still hears from it; ``None``: no answer."""
        view = self.view()
        return None if view is None else view.heard

    def silent(self, replica_ids: Sequence[str]) -> list[str]:
        view = self.view()
        return [] if view is None else view.silent(replica_ids)


class _Reaper:
    """Process groups kept alive until their abandoned operations have ended, then dropped in this thread (a gloo
    process group's destructor joins its worker threads, which wait out an operation in flight)."""

    def __init__(self, every: float = 1.0) -> None:
        self._held: list[tuple[Any, list[Any]]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._every = every

    def hold(self, process_group: Any, works: Sequence[Any]) -> None:
        with self._lock:
            self._held.append((process_group, list(works)))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True, name="lightning_smp-reaper")
                self._thread.start()

    @property
    def holding(self) -> int:
        """How many process groups are still held."""
        with self._lock:
            return len(self._held)

    def _run(self) -> None:
        while True:
            time.sleep(self._every)
            with self._lock:
                ended = [entry for entry in self._held if all(work.is_completed() for work in entry[1])]
                self._held = [entry for entry in self._held if all(entry is not e for e in ended)]
                if not self._held:
                    self._thread = None
            ended.clear()  # (the destructors run here, outside the lock)
            if self._thread is None:
                return


REAPER = _Reaper()


@functools.cache  # (one class: isinstance tells a gloo group across groups from torchft's NCCL one)
def _bound_gloo_class() -> type:
    from torch._C._distributed_c10d import ProcessGroupGloo as GlooBackend
    from torch.distributed import ProcessGroup as BaseProcessGroup
    from torchft.process_group import ProcessGroupGloo

    class BoundGloo(ProcessGroupGloo):  # torchft's reconfigurable gloo group, known at run time only
        """torchft's gloo process group, bound to one address, whose replaced or abandoned groups the reaper drops."""

        _pg: Any
        _timeout: timedelta

        def __init__(self, timeout: timedelta, host: str, device_type: str) -> None:
            super().__init__(timeout=timeout)
            self.host = host
            self.device_type = device_type  # (its tensors' device: the root device's type)
            self._abandoned: list[Any] = []

        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            # torchft's own, with the device on ``host`` (torchft's takes GLOO_SOCKET_IFNAME or the host name's address)
            pg = BaseProcessGroup(store, rank, world_size)
            pg._set_default_backend(BaseProcessGroup.BackendType.GLOO)
            options = GlooBackend._Options()  # type: ignore[attr-defined]  # (torch's stubs omit it)
            options._devices = [GlooBackend.create_device(hostname=self.host)]
            options._timeout = self._timeout
            backend = GlooBackend(store, rank, world_size, options)
            backend._set_sequence_number_for_group()
            for kind in dict.fromkeys(("cpu", self.device_type)):
                pg._register_backend(torch.device(kind), BaseProcessGroup.BackendType.GLOO, backend)
            return pg

        def abandon(self, work: Any) -> None:
            """``work`` is not waited for any more: the group is dropped (by the reaper) once it has ended."""
            self._abandoned.append(work)

        def abort(self, errored: bool = True) -> None:
            # (torchft calls it before each reconfiguration: the group goes to the reaper instead of its destructor)
            pg, self._pg = self._pg, None
            if pg is not None:
                REAPER.hold(pg, self._abandoned)
            self._abandoned = []

    return BoundGloo


def crossing_process_group(device: torch.device, timeout: timedelta, host: str) -> Any:
    """torchft's reconfigurable process group across replica groups for torch's default backend of ``device``'s type:
    NCCL on CUDA, XCCL on XPU (torchft's own), gloo elsewhere (bound to ``host``)."""
    from torchft import process_group

    backend = dist.Backend.default_device_backend_map.get(device.type, "gloo")
    if backend == "nccl":
        return process_group.ProcessGroupNCCL(timeout=timeout)
    if backend == "xccl":
        return process_group.ProcessGroupXCCL(timeout=timeout)
    return _bound_gloo_class()(timeout, host, device.type)


@dataclass(frozen=True)
class Crossing:
    """How a collective across groups ended: ``error`` (it failed: a peer closed its connection, the collective's
    timeout) or ``abandoned`` (why it was left while in flight: the lighthouse stopped hearing from a participant, or
    the peers moved on without this group), neither when it completed."""

    error: BaseException | None = None
    abandoned: str | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and self.abandoned is None


def wait_for_crossing(work: Any, process_group: Any, *, verdict: Callable[[], str | None], timeout: float,
                      grace: float = 1.0, every: float = 0.5) -> Crossing:
    """Wait for ``work`` (a collective on ``process_group``, torchft's); from ``grace`` seconds on, every ``every``
    seconds, ask ``verdict()`` whether to leave it (a reason, or ``None``), and abandon the collective if so, or once
    it has run ``timeout`` seconds (gloo's own timeout ends it first; NCCL's is torchft's). Returns how it ended
    (never raises for the collective's own failure)."""
    start = time.monotonic()
    look_at = start + grace
    on_cpu = isinstance(process_group, _bound_gloo_class())
    while True:
        if time.monotonic() - start > timeout:
            _abandon(work, process_group, on_cpu)
            return Crossing(error=TimeoutError(f"the collective ran past its timeout ({timeout:g} s)"))
        try:
            if on_cpu:
                # gloo: wait() blocks up to the slice and returns the moment the collective ends
                work.wait(timedelta(seconds=max(0.01, min(every, look_at - time.monotonic()))))
                return Crossing()
            # (NCCL, XCCL: wait() only orders the stream; is_completed() does not block. torchft wraps the work in a
            # Python Work whose own is_completed() is always False: the one it wraps is asked)
            if getattr(work, "_work", work).is_completed():
                work.wait()
                return Crossing()
            time.sleep(0.001)
        except RuntimeError as err:
            if not on_cpu or work.is_completed():  # (the collective's own failure, not the end of a slice)
                return Crossing(error=err)
        if time.monotonic() >= look_at:
            reason = verdict()
            if reason:
                _abandon(work, process_group, on_cpu)
                return Crossing(abandoned=reason)
            look_at = time.monotonic() + every


def _abandon(work: Any, process_group: Any, on_cpu: bool) -> None:
    if on_cpu:
        process_group.abandon(work)  # (dropped by the reaper once gloo's own timeout has ended it)
    else:
        process_group.abort()  # (torchft's NCCL/XCCL abort ends the operation in flight)


__all__ = ["REAPER", "Crossing", "LighthouseView", "LighthouseWatch", "crossing_process_group", "heard_from", "wait_for_crossing"]
