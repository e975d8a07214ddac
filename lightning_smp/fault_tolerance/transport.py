"""The address a replica group is reached at, checked at setup, and how a healing group fetches a live peer's state:
torchft's HTTP transport, bound to that address.

Everything a group advertises to the others is at one address (``fault_tolerance.host``, by default the address of
the interface that reaches the lighthouse): its store, where the process group across groups is built (torchft
advertises ``MASTER_ADDR``, which torchrun sets to 127.0.0.1 unless told otherwise), its manager server, its process
group across groups (:mod:`.crossing`) and its healing server. torchft's ``HTTPTransport`` serves on every interface and advertises ``socket.gethostname()``, which in a cluster of
network namespaces (or any host whose name does not resolve to the address its peers reach) is the wrong address,
and on every interface is more than it needs. Here each rank serves on the one address its peers reach it at, and
advertises that address.

A heal (:meth:`recv_checkpoint`, run in torchft's quorum thread) is leavable as a crossing is: the transfer runs in a
thread of its own and is waited for in slices; from ``grace`` seconds on, the transport's ``verdict`` (set by the
session: :func:`.agreement.abandon_reason` against the lighthouse) is asked whether the peers moved on, and the heal
is left (raised: torchft reports it, the step is dropped) instead of waiting out a transfer that a partition stalled
(TCP's retransmission backoff after a cut lasts seconds, and the group asks for its next quorum only after its heal,
while the survivors' quorum waits for it).
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

import torch
from torch.utils._pytree import tree_map

from lightning_smp.errors import FaultToleranceError

log = logging.getLogger(__name__)


def _transport_class() -> type:
    from torchft.checkpointing.http_transport import HTTPTransport

    return HTTPTransport


def _server_for(host: str, handler: Any) -> ThreadingHTTPServer:
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET

    class Server(ThreadingHTTPServer):
        address_family = family
        request_queue_size = 1024

    return Server((host, 0), handler)


def _serving_handler(transport: Any, timeout: float) -> type:
    """The healing server's requests: ``/checkpoint/<step>/full``, the state a peer staged for that step. torchft's own
    handler holds the transport's lock while it streams, and the peer's next commit (``disallow_checkpoint``) waits for
    that lock: a transfer that a partition stalls would stall the serving group's training for up to the transport's
    timeout. Here the lock is held only while the staged state is looked up (waiting, as torchft's, while nothing is
    staged), and the state streamed is a copy taken when it was staged (:meth:`send_checkpoint`), which training
    never writes to."""
    from http.server import BaseHTTPRequestHandler

    from torchft.checkpointing._serialization import _streaming_save

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802  (BaseHTTPRequestHandler dispatches by this name)
            answered = False
            try:
                with transport._checkpoint_lock.r_lock():  # (a request that comes before the state is staged waits)
                    step, state = transport._step, getattr(transport, "_state_dict", None)
            except TimeoutError as err:
                self.send_error(503, f"no state was staged to serve ({err})")
                return
            try:
                parts = self.path.split("/")
                if len(parts) != 4 or parts[1] != "checkpoint" or parts[3] != "full" or parts[2] != str(step):
                    self.send_error(400, f"this server serves /checkpoint/{step}/full, not {self.path}")
                    return
                self.send_response(200)
                self.send_header("Content-type", "application/octet-stream")
                self.end_headers()
                answered = True
                _streaming_save(state, self.wfile)
            except (ConnectionError, TimeoutError) as err:  # (the peer left the heal, or its link is gone)
                log.info("a healing transfer from this rank ended: %s", err)
            except Exception as err:  # noqa: BLE001  # (a state that does not serialize)
                log.warning("a healing transfer from this rank failed: %s", err, exc_info=True)
                if not answered:
                    self.send_error(500, str(err))

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
            pass  # (no line on stderr per request)

    Handler.timeout = timeout  # (each request's socket: a peer gone mid-transfer ends it)
    return Handler


def bound_http_transport(timeout: timedelta, host: str, *, grace: float = 1.0, every: float = 0.25) -> Any:
    """torchft's ``HTTPTransport`` serving on ``host`` (an IP address) only and advertising it; its
    ``received_seconds`` is how long the last healing transfer into this rank took. A heal is left when ``verdict``
    (an attribute, ``None``: never) gives a reason, asked from ``grace`` seconds into the transfer, every ``every``
    seconds."""
    base: Any = _transport_class()

    class BoundHTTPTransport(base):  # torchft's class, known at run time only
        _server: Any
        _thread: Any
        received_seconds: float | None = None
        #: a fresh verdict per heal: called once as a heal starts, it returns what is asked while the heal waits
        #: (a reason to leave it, or ``None``)
        verdict: Callable[[], Callable[[], str | None]] | None = None

        def __init__(self) -> None:
            self._lock = threading.Lock()
            #: the sockets of the transfers into this rank in flight, each with its heal's "left" flag
            self._open: dict[socket.socket, threading.Event] = {}
            #: the heal the current thread fetches for (its "left" flag)
            self._fetching = threading.local()
            super().__init__(timeout=timeout, num_chunks=0)
            # torchft's server, on every interface, is replaced before anyone could have learnt its address
            self._server.shutdown()
            self._thread.join()
            self._server.server_close()
            self._server = _server_for(host, _serving_handler(self, timeout.total_seconds()))
            self._thread = threading.Thread(target=self._serve, daemon=True, name="lightning_smp-heal-server")
            self._thread.start()

        def _load_from_address(self, address: str, timeout: timedelta) -> Any:
            # (torchft's, through a socket that a heal left can shut: its bytes then stop crossing the link, where a
            # stalled transfer left to itself would resume when the link comes back and compete with the next heal)
            from torchft.checkpointing._serialization import _streaming_load

            left: threading.Event = getattr(self._fetching, "left", None) or threading.Event()
            url = urlparse(address)
            connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=timeout.total_seconds())
            # (opened here and kept: http.client hands an HTTP/1.0 answer's socket to the response and forgets it; a
            # connection still opening when its heal is left sends nothing, and stops here)
            connection.connect()
            sock = connection.sock
            with self._lock:
                if left.is_set():
                    connection.close()
                    raise FaultToleranceError("the heal was left before its transfer began")
                self._open[sock] = left
            try:
                connection.request("GET", url.path)
                response = connection.getresponse()
                if response.status != 200:
                    raise FaultToleranceError(f"the peer's healing server answered {response.status}"
                                              f" ({response.reason}) for {address}")
                return _streaming_load(response, weights_only=False)
            finally:
                with self._lock:
                    self._open.pop(sock, None)
                connection.close()
                sock.close()

        def _cut_short(self, left: threading.Event) -> None:
            """The transfers of the heal whose flag is ``left`` end now (their sockets shut: the fetching thread
            fails), and none of it begins."""
            with self._lock:
                left.set()
                sockets = [sock for sock, flag in self._open.items() if flag is left]
            for sock in sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # (already closed)

        def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
            # (torchft keeps a tensor already in host memory as it is, the live parameter or optimizer state: a copy,
            # so that a transfer in flight never holds training back nor sends a state that training moved; a
            # device's tensors torchft copies to host memory itself. Containers the pytree knows are walked: the
            # tracked state and torchft's are dicts, lists and tuples)
            def copied(value: Any) -> Any:
                return value.detach().clone() if isinstance(value, torch.Tensor) and value.device.type == "cpu" else value

            super().send_checkpoint(dst_ranks, step, tree_map(copied, state_dict), timeout)

        def disallow_checkpoint(self) -> None:
            super().disallow_checkpoint()
            # (the staged copy is dropped once nothing may be served from it: a transfer still streaming holds its own
            # reference until it ends)
            self._state_dict = None

        def recv_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            self.received_seconds = None
            verdict = self.verdict() if self.verdict is not None else None
            fetched: dict[str, Any] = {}
            done, left = threading.Event(), threading.Event()
            receive = super().recv_checkpoint

            def fetch() -> None:
                self._fetching.left = left
                try:
                    fetched["state"] = receive(*args, **kwargs)
                except BaseException as err:  # noqa: BLE001  # (raised in the waiting thread)
                    fetched["error"] = err
                finally:
                    done.set()

            threading.Thread(target=fetch, daemon=True, name="lightning_smp-heal").start()
            look_at = start + grace
            try:
                while not done.wait(max(0.0, look_at - time.monotonic())):
                    reason = verdict() if verdict is not None else None
                    if reason and not done.is_set():  # (a transfer that has just ended is taken)
                        raise FaultToleranceError(f"the heal from a peer was left after"
                                                  f" {time.monotonic() - start:.2f} s, {reason}")
                    look_at = time.monotonic() + every
            except BaseException:
                self._cut_short(left)  # (what it brought is dropped)
                raise
            if "error" in fetched:
                raise fetched["error"]
            self.received_seconds = time.monotonic() - start
            return fetched["state"]

        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            shown = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
            return f"http://{shown}:{port}/checkpoint/"

    return BoundHTTPTransport()


def address_towards(url: str) -> str:
    """This host's address on the interface that reaches ``url`` (the lighthouse): the address its peers reach it at
    in a cluster whose nodes all reach the lighthouse. No packet is sent (a UDP socket is only connected)."""
    parsed = urlparse(url if "://" in url else f"http://{url}")
    host = parsed.hostname or "127.0.0.1"
    infos = socket.getaddrinfo(host, parsed.port or 80, type=socket.SOCK_DGRAM)
    family, _, _, _, target = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return str(probe.getsockname()[0])


def check_host(host: str, group: int, lighthouse_url: str) -> None:
    """``host`` must be an address of this machine, and not a loopback address unless the lighthouse is on loopback
    too: the other groups reach this group's store, its process group across groups and its healing server there
    (nothing else is advertised)."""
    try:
        address = ipaddress.ip_address(host)
        family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    except ValueError:
        raise FaultToleranceError(
            f"replica group {group}: fault_tolerance host={host!r} is not an IP address. Fix: the address of this"
            " machine's interface that the other groups reach (e.g. host='10.0.0.2'), or leave host out (the"
            " interface that reaches the lighthouse)."
        ) from None
    towards = urlparse(lighthouse_url if "://" in lighthouse_url else f"http://{lighthouse_url}").hostname or ""
    if address.is_loopback and not _is_loopback(towards):
        raise FaultToleranceError(
            f"replica group {group}: fault_tolerance host={host} is a loopback address, but the lighthouse"
            f" ({towards}) is not on loopback: groups on other machines would dial {host}, their own machine. Fix:"
            " the address of this machine that the other groups reach (or leave host out: the interface that"
            " reaches the lighthouse)."
        )
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
    except OSError as err:
        raise FaultToleranceError(
            f"replica group {group}: the address {host} is not one of this machine's ({err.strerror}): the other"
            " groups could not reach this group there. Fix: fault_tolerance host=<an address of this machine that"
            " the other groups reach>, or leave host out (the interface that reaches the lighthouse)."
        ) from None


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or a name: every address it resolves to) is on loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except OSError:
        return False


def check_store(host: str, port: int, group: int, timeout: float = 10.0) -> None:
    """This group's ``TCPStore`` (torchrun's, at ``MASTER_PORT``) must answer at ``host``: the other groups meet
    there to build the process group across groups. torch's store listens on every interface whatever
    ``MASTER_ADDR`` says, so a store that does not answer is bound elsewhere or firewalled."""
    from torch.distributed import TCPStore

    try:
        TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as err:  # noqa: BLE001  # (torch raises RuntimeError or its DistNetworkError)
        raise FaultToleranceError(
            f"replica group {group}: this group's store (MASTER_PORT={port}) does not answer at {host}:{port}, the"
            f" address the other groups would use ({type(err).__name__}: {str(err).splitlines()[0]}). Fix: let"
            f" the store listen there (torchrun --master-addr {host}), or name the address the store answers at"
            " with fault_tolerance host=..."
        ) from None


__all__ = ["address_towards", "bound_http_transport", "check_host", "check_store"]
