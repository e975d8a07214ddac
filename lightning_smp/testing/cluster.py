"""A cluster of several "nodes" on one machine: network namespaces joined by a real, throttled link.

Each node is a network namespace with its own loopback and one interface towards the other nodes: a ``veth`` pair
between two nodes, or a pair per node into a bridge namespace for more. The egress of every node interface is
shaped by ``tbf`` (rate; ``netem`` above it for delay and loss, where the kernel has it), so traffic between ranks
of different nodes crosses a link of the chosen rate, while traffic between ranks of one node stays on that node's loopback (gloo binds to
``GLOO_SOCKET_IFNAME``, the node interface, whose own address is reached over ``lo``). The kernel counts every byte
that crossed (:meth:`Cluster.link_bytes`, or :func:`~lightning_smp.testing.crossing.link_tx_bytes` from inside a node).

Only link-local addresses (``169.254.0.0/16``), only inside namespaces this module created; every name carries the
id of the run (and the pid that made it), everything is deleted on exit, on an error, on Ctrl-C and on SIGTERM, and
namespaces left by a killed run are removed by the next one (:func:`remove_stale`). Needs root or
``CAP_NET_ADMIN`` (:func:`netadmin_problem` says in one line why not)::

    from lightning_smp.testing.cluster import Cluster, LinkShape

    with Cluster(nodes=2, link=LinkShape(rate="100mbit")) as cluster:
        procs = cluster.torchrun(["train.py", "--steps", "4"], nproc_per_node=2)
        outputs = cluster.wait(procs, timeout=300)
        print(cluster.link_bytes())           # bytes each node sent over its link

By hand, the same with ``python -m lightning_smp.testing.cluster --nodes 2 --rate 100mbit -- train.py --steps 4``.

What crosses the links as gloo runs its collectives, and the counter a rank reads, are in
:mod:`lightning_smp.testing.crossing`.

Above 300 lines for a reason: one harness. :class:`Cluster` (about 200 lines) builds, runs, kills and tears down
over shared state: the namespaces it made, the processes it started and the cleanup it registered (``destroy`` kills
what ``popen`` started, ``wait`` kills everything on a timeout); the rest is the ``ip`` helpers it builds with and its
command line, which ``python -m lightning_smp.testing.cluster`` runs from this module.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

#: every namespace and interface this module creates starts with it
PREFIX = "lsmp"
_NAME = re.compile(rf"^{PREFIX}(\d+)x([0-9a-f]+)-")


@dataclass(frozen=True)
class LinkShape:
    """How each node's interface sends: ``rate`` (``tc`` units, ``None``: unthrottled), the longest time a packet may
    wait in the ``tbf`` queue, one-way ``delay_ms`` and ``loss_pct`` (``netem``), and the MTU (jumbo frames keep the
    headers below 1% of what is counted)."""

    rate: str | None = "100mbit"
    queue_ms: int = 50
    delay_ms: float = 0.0
    loss_pct: float = 0.0
    mtu: int = 9000
    burst: str = "256kb"


@dataclass(frozen=True)
class Node:
    """One node: its namespace, its interface towards the others and that interface's address."""

    index: int
    namespace: str
    interface: str
    address: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _in(namespace: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", namespace, *argv], check=check, capture_output=True, text=True)


def netadmin_problem() -> str | None:
    """``None`` when this process can build a cluster; else one line saying why not."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the cluster harness needs {' and '.join(missing)} (iproute2), which is not installed"
    probe = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return ("the cluster harness needs root or CAP_NET_ADMIN to create network namespaces"
                f" (ip netns add: {made.stderr.strip() or made.returncode})")
    _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone (a run killed with SIGKILL cannot clean up); return them."""
    listed = _ip("netns", "list", check=False).stdout.split()
    stale = [name for name in listed if (m := _NAME.match(name)) and not _alive(int(m.group(1)))]
    for name in stale:
        _ip("netns", "del", name, check=False)
    return stale


class Cluster:
    """``nodes`` network namespaces joined by shaped links; a context manager that always removes them.

    Args:
        nodes: how many nodes (2: one ``veth`` pair; more: a bridge namespace between them).
        link: how each node interface sends (:class:`LinkShape`).
    """

    def __init__(self, nodes: int = 2, link: LinkShape | None = None) -> None:
        if nodes < 2:
            raise ValueError(f"nodes={nodes}: a cluster has at least 2 nodes. Fix: nodes=2 or more.")
        self.link = link or LinkShape()
        self.run_id = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        subnet = 1 + secrets.randbelow(254)  # 169.254.0.0/24 and .255.0/24 are reserved
        self.nodes = [Node(i, f"{self.run_id}-n{i}", f"{PREFIX}{secrets.token_hex(3)}{i}", f"169.254.{subnet}.{i + 1}")
                      for i in range(nodes)]
        self.switch = f"{self.run_id}-sw" if nodes > 2 else None
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._previous_handlers: dict[int, Any] = {}

    # ------------------------------------------------------------------ building and tearing down

    def __enter__(self) -> Cluster:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self) -> None:
        problem = netadmin_problem()
        if problem:
            raise PermissionError(problem)
        remove_stale()
        atexit.register(self.destroy)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.destroy()
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        for node in self.nodes:
            self._add_namespace(node.namespace)
        if self.switch is None:
            a, b = self.nodes
            _ip("link", "add", a.interface, "type", "veth", "peer", "name", b.interface)
            for node in (a, b):
                _ip("link", "set", node.interface, "netns", node.namespace)
        else:
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for node in self.nodes:
                port = f"{node.interface}p"
                _ip("link", "add", node.interface, "type", "veth", "peer", "name", port)
                _ip("link", "set", node.interface, "netns", node.namespace)
                _ip("link", "set", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "mtu", str(self.link.mtu), "master", "br0", "up")
        for node in self.nodes:
            _ip("-n", node.namespace, "link", "set", node.interface, "mtu", str(self.link.mtu))
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.interface)
            _ip("-n", node.namespace, "link", "set", node.interface, "up")
            self.shape(node.index, self.link)

    def shape(self, index: int, link: LinkShape) -> None:
        """(Re)shape node ``index``'s egress: ``tbf`` at ``link.rate``, under ``netem`` when there is delay or loss."""
        node = self.nodes[index]
        tc = ["tc", "qdisc"]
        _in(node.namespace, *tc, "del", "dev", node.interface, "root", check=False)
        parent = ["root"]
        if link.delay_ms or link.loss_pct:
            made = _in(node.namespace, *tc, "add", "dev", node.interface, "root", "handle", "1:", "netem",
                       "delay", f"{link.delay_ms}ms", "loss", f"{link.loss_pct}%", check=False)
            if made.returncode != 0:
                raise RuntimeError(
                    f"delay_ms={link.delay_ms}, loss_pct={link.loss_pct} need the netem qdisc, which this kernel refused"
                    f" ({made.stderr.strip()}). Fix: leave delay and loss at 0 (tbf alone shapes the rate), or load"
                    " sch_netem."
                )
            parent = ["parent", "1:"]
        if link.rate is not None:
            _in(node.namespace, *tc, "add", "dev", node.interface, *parent, "handle", "2:", "tbf", "rate", link.rate,
                "burst", link.burst, "latency", f"{link.queue_ms}ms")

    def cut(self, how: str = "down") -> None:
        """Cut the link between the nodes: ``"down"`` sets every node interface down (a pulled cable: packets on the
        open connections are dropped, nobody is told), ``"loss"`` drops every packet (``netem loss 100%``, a switch
        that died; needs the netem qdisc)."""
        for node in self.nodes:
            if how == "down":
                _ip("-n", node.namespace, "link", "set", node.interface, "down")
            else:
                self.shape(node.index, LinkShape(rate=None, loss_pct=100.0, mtu=self.link.mtu))

    def mend(self) -> None:
        """Undo :meth:`cut`: every node interface up again, shaped as the cluster's link."""
        for node in self.nodes:
            _ip("-n", node.namespace, "link", "set", node.interface, "up")
            self.shape(node.index, self.link)

    def pids(self, index: int | None = None) -> list[int]:
        """Every process that runs inside node ``index``'s namespace now (every node's: ``None``); torchrun's workers
        start sessions of their own, so this, not the agent's process group, is what a node runs."""
        names = self._created if index is None else [self.nodes[index].namespace]
        found: list[int] = []
        for name in names:
            found += [int(pid) for pid in _ip("netns", "pids", name, check=False).stdout.split()]
        return found

    def kill_node(self, index: int) -> None:
        """SIGKILL everything node ``index`` runs (a node that lost power: its peers see their connections close)."""
        for pid in self.pids(index):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL every process started here and everything still running inside a node namespace."""
        for proc in self._procs:
            _kill_group(proc)
        for index in range(len(self.nodes)):
            self.kill_node(index)
        for proc in self._procs:
            proc.wait()

    def destroy(self) -> None:
        """Kill every process started here, then delete every namespace (their interfaces go with them). Safe to call
        more than once."""
        self.kill()
        self._procs = []
        for name in reversed(self._created):
            _ip("netns", "del", name, check=False)
        self._created = []
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers = {}
        atexit.unregister(self.destroy)

    # ------------------------------------------------------------------ running

    def env(self, index: int) -> dict[str, str]:
        """What a process on node ``index`` needs: gloo (and NCCL's socket transport) on the node interface."""
        interface = self.nodes[index].interface
        return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface, "OMP_NUM_THREADS": "1"}

    def popen(self, index: int, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any,
              ) -> subprocess.Popen:
        """Start ``argv`` inside node ``index`` (its own session, so that :meth:`destroy` kills all it started)."""
        full_env = {**os.environ, **(env or {}), **self.env(index)}
        proc = subprocess.Popen(["ip", "netns", "exec", self.nodes[index].namespace, *argv], env=full_env,
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def torchrun(self, script: Sequence[str], nproc_per_node: int, env: dict[str, str] | None = None,
                 port: int = 29500, **kwargs: Any) -> list[subprocess.Popen]:
        """One ``torchrun`` agent per node: ``--nnodes N --node-rank i``, rendezvous on node 0's address. Output goes
        to pipes unless ``stdout``/``stderr`` are given."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.STDOUT)
        kwargs.setdefault("text", True)
        master = self.nodes[0].address
        return [
            self.popen(node.index, [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(self.nodes)),
                                    "--node-rank", str(node.index), "--nproc-per-node", str(nproc_per_node),
                                    "--master-addr", master, "--master-port", str(port), *script], env, **kwargs)
            for node in self.nodes
        ]

    def torchrun_node(self, index: int, script: Sequence[str], nproc_per_node: int, env: dict[str, str] | None = None,
                      port: int = 29500, **kwargs: Any) -> subprocess.Popen:
        """A ``torchrun`` job of node ``index`` alone: its own world, rendezvous on its own address (fault-tolerant
        replica groups are one job per node)."""
        return self.popen(index, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
                                  str(nproc_per_node), "--master-addr", self.nodes[index].address, "--master-port",
                                  str(port), *script], env, **kwargs)

    def start_lighthouse(self, index: int = 0, *, min_groups: int = 1, heartbeat_timeout: float = 2.0,
                         join_timeout: float = 30.0) -> Any:
        """``lightning-smp lighthouse`` inside node ``index``, on its address (the others reach it over the link);
        returns a :class:`~lightning_smp.fault_tolerance.lighthouse.Lighthouse` whose ``shutdown`` stops it."""
        from lightning_smp.fault_tolerance.lighthouse import Lighthouse

        proc = self.popen(index, [sys.executable, "-m", "lightning_smp", "lighthouse", "--bind",
                                  f"{self.nodes[index].address}:0", "--min_groups", str(min_groups),
                                  "--heartbeat_timeout", str(heartbeat_timeout), "--join_timeout", str(join_timeout),
                                  "--quorum_tick", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True)
        line = proc.stdout.readline() if proc.stdout is not None else ""
        if not line.startswith("lightning-smp lighthouse: "):
            _kill_group(proc)
            raise RuntimeError(f"the lighthouse in node {index} did not start: {line!r}")
        return Lighthouse(_ProcessServer(proc), line.split(": ", 1)[1].strip())

    def wait(self, procs: Sequence[subprocess.Popen], timeout: float) -> list[tuple[int | None, str]]:
        """Wait for every process, at most ``timeout`` seconds in all; kill what is still running then. Returns each
        one's (exit code, ``None`` if it had to be killed; output)."""
        deadline = time.monotonic() + timeout
        results: list[tuple[int | None, str]] = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
                results.append((proc.returncode, out or ""))
            except subprocess.TimeoutExpired:
                self.kill()  # workers hold the output pipe too: everything in the namespaces goes
                out, _ = proc.communicate()
                results.append((None, out or ""))
        return results

    def link_bytes(self) -> list[int]:
        """Bytes each node has sent over its link so far (the root qdisc's counter: everything that crossed)."""
        sent = []
        for node in self.nodes:
            text = _in(node.namespace, "tc", "-s", "qdisc", "show", "dev", node.interface).stdout
            match = re.search(r"Sent (\d+) bytes", text)
            sent.append(int(match.group(1)) if match else 0)
        return sent


class _ProcessServer:
    """A lighthouse running as a process: ``shutdown`` asks it to stop (SIGTERM), then makes sure."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


@contextmanager
def cluster(nodes: int = 2, **link: Any) -> Iterator[Cluster]:
    """``with cluster(2, rate="100mbit") as c:``: :class:`Cluster` with a :class:`LinkShape` from keywords."""
    with Cluster(nodes, LinkShape(**link)) as made:
        yield made


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_smp.testing.cluster [--nodes N] [--nproc-per-node M] [--rate R] -- SCRIPT ARGS...``:
    run a script under torchrun on a cluster made for it, print what crossed the links, remove everything."""
    parser = argparse.ArgumentParser(prog="python -m lightning_smp.testing.cluster", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--rate", default="100mbit", help="tc rate of each node's link, or 'none' (unthrottled)")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--loss-pct", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("script", nargs=argparse.REMAINDER, help="the script and its arguments, after --")
    args = parser.parse_args(argv)
    script = [a for a in args.script if a != "--"] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("give the script to run after --")
    problem = netadmin_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    link = LinkShape(rate=None if args.rate == "none" else args.rate, delay_ms=args.delay_ms, loss_pct=args.loss_pct)
    with Cluster(args.nodes, link) as made:
        for node in made.nodes:
            print(f"node {node.index}: namespace {node.namespace}, {node.interface} {node.address}")
        results = made.wait(made.torchrun(script, args.nproc_per_node, stdout=None, stderr=None), args.timeout)
        for node, sent in zip(made.nodes, made.link_bytes()):
            print(f"node {node.index} sent {sent} bytes over its link")
    return max((rc if rc is not None else 124) for rc, _ in results)


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "PREFIX",
    "Cluster",
    "LinkShape",
    "Node",
    "cluster",
    "netadmin_problem",
    "remove_stale",
]
