"""The lighthouse: the one process that keeps the quorum of live replica groups (torchft's ``LighthouseServer``).

Run it once per job, on a host every group reaches, before the groups start::

    lightning-smp lighthouse --bind 10.0.0.1:29510 --min_groups 1 --heartbeat_timeout 5

A group that misses heartbeats for ``heartbeat_timeout`` seconds is dropped from the next quorum; a quorum needs more
than half of the groups that were heartbeating (torchft's split-brain rule), and waits ``join_timeout`` seconds for
stragglers at most. The job survives the death of any group, not the lighthouse's: without it no quorum forms, so
every group's next step waits (``fault_tolerance.quorum_timeout``) and then fails with torchft's quorum error, and
the job must be restarted from its last checkpoint with a new lighthouse (``docs/fault-tolerance.md``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any


@dataclass
class Lighthouse:
    """A lighthouse running in this process; :meth:`shutdown` stops it."""

    server: Any
    address: str

    def shutdown(self) -> None:
        self.server.shutdown()


def start_lighthouse(bind: str = "127.0.0.1:0", *, min_groups: int = 1, heartbeat_timeout: float = 5.0,
                     join_timeout: float = 60.0, quorum_tick: float = 0.1) -> Lighthouse:
    """Start a lighthouse in this process, listening on ``bind`` (``host:port``; port 0: any free port). Its
    ``address`` is what ``fault_tolerance.lighthouse`` names (``http://host:port``, with the host of ``bind``, not
    the machine's name)."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind=bind, min_replicas=min_groups, join_timeout_ms=int(join_timeout * 1000),
                              quorum_tick_ms=int(quorum_tick * 1000),
                              heartbeat_timeout_ms=int(heartbeat_timeout * 1000))
    port = server.address().rsplit(":", 1)[1]
    host = bind.rsplit(":", 1)[0]
    return Lighthouse(server, f"http://{host}:{port}")


def main(argv: list[str] | None = None) -> None:
    """``lightning-smp lighthouse``: run a lighthouse until interrupted (Ctrl-C, SIGTERM)."""
    parser = argparse.ArgumentParser(prog="lightning-smp lighthouse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bind", default="0.0.0.0:29510", help="host:port to listen on (default %(default)s)")
    parser.add_argument("--min_groups", type=int, default=1, help="fewest groups that form a quorum (default %(default)s)")
    parser.add_argument("--heartbeat_timeout", type=float, default=5.0,
                        help="seconds without a heartbeat after which a group is dropped (default %(default)s)")
    parser.add_argument("--join_timeout", type=float, default=60.0,
                        help="seconds a quorum waits for stragglers at most (default %(default)s)")
    parser.add_argument("--quorum_tick", type=float, default=0.1,
                        help="seconds between quorum checks while waiting (default %(default)s)")
    args = parser.parse_args(argv)
    lighthouse = start_lighthouse(args.bind, min_groups=args.min_groups, heartbeat_timeout=args.heartbeat_timeout,
                                  join_timeout=args.join_timeout, quorum_tick=args.quorum_tick)
    print(f"lightning-smp lighthouse: {lighthouse.address}", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    lighthouse.shutdown()
    sys.exit(0)


__all__ = ["Lighthouse", "main", "start_lighthouse"]
