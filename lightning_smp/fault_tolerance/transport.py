"""How a healing group fetches a live peer's state: torchft's HTTP transport, bound to one address.

torchft's ``HTTPTransport`` serves on every interface and advertises ``socket.gethostname()``, which in a cluster of
network namespaces (or any host whose name does not resolve to the address its peers reach) is the wrong address,
and on every interface is more than it needs. Here each rank serves on the one address its peers reach it at, and
advertises that address.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse


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
    """torchft's ``HTTPTransport`` serving on ``host`` (an IP address) only and advertising it."""
    base: Any = _transport_class()

    class BoundHTTPTransport(base):  # torchft's class, known at run time only
        _server: Any
        _thread: Any

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


__all__ = ["address_towards", "bound_http_transport"]
