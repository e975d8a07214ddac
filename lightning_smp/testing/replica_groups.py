"""Fault-tolerant replica groups on one machine, for tests and benchmarks.

:func:`run_replica_groups` forks the ranks of every group from this process (each group its own world) beside a
lighthouse in this process, and returns what each rank's function returned: runs with no failure, compared with DDP.
:class:`ReplicaGroupJobs` starts a lighthouse in this process and one ``torchrun`` job per group, each group its own world (on loopback, or on a node of a
:class:`~lightning_smp.testing.cluster.Cluster`), with what a test needs to kill a group and start it again and to read
what every rank recorded.

Each group runs ``script`` with ``--lighthouse``, ``--group``, ``--groups`` and ``--out`` given; the script writes one
JSON line per committed step to ``out/group{g}_rank{r}.jsonl`` (``benchmarks/fault_run.py`` does).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning_smp.fault_tolerance.lighthouse import Lighthouse, start_lighthouse
from lightning_smp.testing import PROCESS_TIMEOUT, free_port, run_worlds

#: ``launch(group, argv, env, log) -> process``: how a group's job starts (default: a process on this machine)
Launch = Callable[[int, Sequence[str], dict[str, str], Any], subprocess.Popen]


def _local_launch(group: int, argv: Sequence[str], env: dict[str, str], log: Any) -> subprocess.Popen:
    return subprocess.Popen(list(argv), env={**os.environ, **env}, start_new_session=True, stdout=log,
                            stderr=subprocess.STDOUT)


class ReplicaGroupJobs:
    """A lighthouse and the jobs of ``groups`` replica groups of ``degree`` ranks each.

    Arguments:
        script: the script (and its own arguments) each group's ``torchrun`` runs.
        out: where the scripts write their records, and each group's log (``log{g}.txt``).
        lighthouse: the lighthouse (default: one in this process, on loopback, with ``heartbeat_timeout`` and
            ``min_groups``); give one to run it elsewhere (a cluster node). Either is stopped by :meth:`close`.
        launch: how a group's job starts (default: on this machine); ``address``: the address of a group's host.
    """

    def __init__(self, script: Sequence[str], out: Path, *, groups: int = 2, degree: int = 2,
                 heartbeat_timeout: float = 2.0, min_groups: int = 1, join_timeout: float = 30.0,
                 lighthouse: Lighthouse | ForkedLighthouse | None = None, launch: Launch = _local_launch,
                 address: Callable[[int], str] = lambda group: "127.0.0.1") -> None:
        self.script, self.out, self.groups, self.degree = list(script), Path(out), groups, degree
        self.out.mkdir(parents=True, exist_ok=True)
        # (a lighthouse of its own runs in a process forked from this one: see ForkedLighthouse)
        self.lighthouse = lighthouse or ForkedLighthouse(min_groups=min_groups, heartbeat_timeout=heartbeat_timeout,
                                                         join_timeout=join_timeout)
        self._launch, self._address = launch, address
        self.jobs: dict[int, subprocess.Popen] = {}
        self.started: dict[int, list[float]] = {}
        self._killed: set[int] = set()

    def start(self, group: int, *args: str) -> subprocess.Popen:
        """Start group ``group``'s job (again, after :meth:`kill`), with extra script arguments ``args``."""
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(self.degree),
                "--master-addr", self._address(group), "--master-port", str(free_port()), *self.script,
                "--lighthouse", self.lighthouse.address, "--group", str(group), "--groups", str(self.groups),
                "--degree", str(self.degree), "--out", str(self.out), *args]
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, (str(Path.cwd()),
                                                                                 os.environ.get("PYTHONPATH"))))}
        log = (self.out / f"log{group}.txt").open("a")
        self.jobs[group] = self._launch(group, argv, env, log)
        self.started.setdefault(group, []).append(time.time())
        self._killed.discard(group)
        return self.jobs[group]

    def kill(self, group: int) -> float:
        """SIGKILL every process of group ``group``'s job (torchrun's agent and its workers); returns when."""
        import psutil

        job = self.jobs[group]
        self._killed.add(group)
        try:
            tree = psutil.Process(job.pid)
            processes = [tree, *tree.children(recursive=True)]
        except psutil.NoSuchProcess:
            processes = []
        for process in processes:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        job.wait()
        return time.time()

    def expect_end(self, group: int) -> None:
        """Group ``group`` is expected to end on its own (it kills itself): :meth:`wait_for` does not fail on it."""
        self._killed.add(group)

    def records(self, group: int, rank: int = 0) -> list[dict[str, Any]]:
        """What group ``group``'s rank ``rank`` recorded so far, one entry per committed step."""
        path = self.out / f"group{group}_rank{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``condition`` until it holds; ``TimeoutError`` naming ``what`` (and the groups' logs' tails)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not happen within {timeout} s.\n{self.logs()}")
            for group, job in self.jobs.items():
                if group not in self._killed and job.poll() not in (None, 0):
                    raise RuntimeError(f"group {group} ended with {job.returncode} while waiting for {what}.\n"
                                       f"{self.logs()}")
            time.sleep(0.1)

    def wait(self, timeout: float) -> dict[int, int | None]:
        """Wait for every job to end (at most ``timeout`` seconds in all); each one's exit code (``None``: killed)."""
        deadline = time.monotonic() + timeout
        codes: dict[int, int | None] = {}
        for group, job in self.jobs.items():
            try:
                codes[group] = job.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(group)
                codes[group] = None
        return codes

    def logs(self, lines: int = 30) -> str:
        """The last ``lines`` lines of every group's log, without torchft's INFO lines."""
        text = []
        for group in sorted(self.jobs):
            path = self.out / f"log{group}.txt"
            kept = [line for line in (path.read_text(errors="replace").splitlines() if path.exists() else [])
                    if "[INFO]" not in line]
            text.append(f"--- group {group} ---\n" + "\n".join(kept[-lines:]))
        return "\n".join(text)

    def close(self) -> None:
        """Kill every job still running and stop the lighthouse (if it is this object's)."""
        for group, job in self.jobs.items():
            if job.poll() is None:
                self.kill(group)
        self.lighthouse.shutdown()

    def __enter__(self) -> ReplicaGroupJobs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_replica_groups(fn: Callable[..., Any], groups: int, degree: int, *args: Any, min_groups: int | None = None,
                       heartbeat_timeout: float = 2.0, timeout: float = PROCESS_TIMEOUT) -> list[list[Any]]:
    """Run ``fn(group, rank, degree, lighthouse, *args)`` on ``groups`` replica groups of ``degree`` forked ranks each
    (every group its own world: its own store and process group, as one ``torchrun`` job per group), beside a
    lighthouse in this process whose address is ``lighthouse``; returns ``results[group][rank]``. ``min_groups``
    (default: every group) is the lighthouse's: with all of them, every step has every group in it."""
    with forked_lighthouse(min_groups=min_groups or groups, heartbeat_timeout=heartbeat_timeout) as lighthouse:
        return run_worlds(fn, groups, degree, lighthouse, *args, timeout=timeout)


class ForkedLighthouse:
    """A lighthouse on loopback in a process forked from this one (:attr:`address`; :meth:`shutdown` stops it), so
    that this process runs no thread of torchft's runtime: the tests and notebooks that start replica groups also
    fork ranks from this process (the Trainer's fork launcher, :func:`run_distributed`), and a fork copies only the
    forking thread, so a lock another thread held stays locked in the child, which hangs."""

    def __init__(self, *, min_groups: int, heartbeat_timeout: float = 2.0, join_timeout: float = 30.0) -> None:
        ctx = mp.get_context("fork")
        self._pipe, theirs = ctx.Pipe()
        self._process = ctx.Process(target=_serve_lighthouse,
                                    args=(theirs, min_groups, heartbeat_timeout, join_timeout), daemon=True)
        self._process.start()
        if not self._pipe.poll(60):
            self.shutdown()
            raise RuntimeError("the lighthouse process did not start within 60 s")
        self.address: str = self._pipe.recv()

    def shutdown(self) -> None:
        if self._process.is_alive():
            try:
                self._pipe.send("stop")
            except OSError:
                pass
            self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


@contextmanager
def forked_lighthouse(*, min_groups: int, heartbeat_timeout: float = 2.0) -> Iterator[str]:
    """A :class:`ForkedLighthouse` for a ``with`` block, which yields its address."""
    lighthouse = ForkedLighthouse(min_groups=min_groups, heartbeat_timeout=heartbeat_timeout)
    try:
        yield lighthouse.address
    finally:
        lighthouse.shutdown()


def _serve_lighthouse(pipe: Any, min_groups: int, heartbeat_timeout: float, join_timeout: float) -> None:
    lighthouse = start_lighthouse("127.0.0.1:0", min_groups=min_groups, heartbeat_timeout=heartbeat_timeout,
                                  join_timeout=join_timeout, quorum_tick=0.05)
    pipe.send(lighthouse.address)
    try:
        pipe.recv()
    except EOFError:  # (the process that started it is gone)
        pass
    lighthouse.shutdown()


def on_cluster(cluster: Any, script: Sequence[str], out: Path, *, degree: int = 2, heartbeat_timeout: float = 2.0,
               min_groups: int = 1) -> ReplicaGroupJobs:
    """Replica groups on a :class:`~lightning_smp.testing.cluster.Cluster`: group ``g`` is node ``g``'s job, and the
    lighthouse runs in node 0."""
    lighthouse = cluster.start_lighthouse(0, min_groups=min_groups, heartbeat_timeout=heartbeat_timeout)

    def launch(group: int, argv: Sequence[str], env: dict[str, str], log: Any) -> subprocess.Popen:
        return cluster.popen(group, list(argv), env, stdout=log, stderr=subprocess.STDOUT)

    return ReplicaGroupJobs(script, out, groups=len(cluster.nodes), degree=degree, lighthouse=lighthouse,
                            launch=launch, address=lambda group: cluster.nodes[group].address)


__all__ = ["ForkedLighthouse", "Launch", "ReplicaGroupJobs", "forked_lighthouse", "on_cluster", "run_replica_groups"]
