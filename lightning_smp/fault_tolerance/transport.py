"""The address a replica group is reached at, checked at setup, and how a healing group fetches a live peer's state:
torchft's HTTP transport, bound to that address.

Everything a group advertises to the others is at one address (``fault_tolerance.host``, by default the address of
the interface that reaches the lighthouse): its store, where the process group across groups is built (torchft
advertises ``MASTER_ADDR``, which torchrun sets to 127.0.0.1 unless told otherwise), its manager server, its process
group across groups (:mod:`.crossing`) and its healing server. torchft's ``HTTPTransport`` serves on every interface and advertises ``socket.gethostname()``, which in a cluster of
network namespaces (or any host whose name does not resolve to the address its peers reach) is the wrong address,
and on every interface is more than it needs. Here each rank serves on the one address its peers reach it at, and
advertises that address.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

from lightning_smp.errors import FaultToleranceError


def _transport_class() -> type:
    from torchft.checkpointing.http_transport import HTTPTransport

    return HTTPTransport


def _server_for(host: str, handler: Any) -> ThreadingHTTPServer:
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET

    class Server(ThreadingHTTPServer):
        address_family = family
        request_queue_size = 1024

    return Server((host, 0), handler)


def _quiet(handler: Any) -> Any:
    """torchft's request handler without its per-request line on stderr (``BaseHTTPRequestHandler.log_message``)."""

    class Quiet(handler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
            pass

    return Quiet


def bound_http_transport(timeout: timedelta, host: str) -> Any:
    """torchft's ``HTTPTransport`` serving on ``host`` (an IP address) only and advertising it; its
    ``received_seconds`` is how long the last healing transfer into this rank took."""
    base: Any = _transport_class()

    class BoundHTTPTransport(base):  # torchft's class, known at run time only
        _server: Any
        _thread: Any
        received_seconds: float | None = None

        def __init__(self) -> None:
            super().__init__(timeout=timeout, num_chunks=0)
            handler = self._server.RequestHandlerClass
            # torchft's server, on every interface, is replaced before anyone could have learnt its address
            self._server.shutdown()
            self._thread.join()
            self._server.server_close()
            self._server = _server_for(host, _quiet(handler))
            self._thread = threading.Thread(target=self._serve, daemon=True, name="lightning_smp-heal-server")
            self._thread.start()

        def recv_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            received = super().recv_checkpoint(*args, **kwargs)
            self.received_seconds = time.monotonic() - start
            return received

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
