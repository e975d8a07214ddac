"""Running a function on several ranks of one machine, for tests and benchmarks (CPU/gloo by default).

``run_distributed(fn, world_size)`` forks ``world_size`` ranks from the calling process, gives each a process
group, and returns what ``fn(rank, world_size, *args)`` returned on every rank. ``run_worlds(fn, worlds,
world_size)`` does the same for several worlds side by side, each with its own store and process group (the replica
groups of a fault-tolerant job: :func:`lightning_smp.testing.replica_groups.run_replica_groups`). The ranks look to Lightning like
processes started by an external launcher on one node (``LOCAL_RANK``, ``NODE_RANK``, ``LOCAL_WORLD_SIZE`` are
set), so a ``Trainer`` created inside ``fn`` runs as it would under ``torchrun``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

#: Default limit, in seconds, for every rank's result (a rank that dies early leaves the others waiting).
PROCESS_TIMEOUT = 180


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` different TCP ports on the loopback interface that nothing listens on right now (held together while
    they are chosen: one port released and chosen again would put two worlds' stores on one port)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _child(fn: Callable, rank: int, world_size: int, port: int, backend: str, args: tuple, queue: Any,
           key: Any = None, env: dict[str, str] | None = None) -> None:
    os.environ.update(env or {})
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0",
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        if dist.is_initialized():
            # A rank that leaves right after creating a group (new_group, a DeviceMesh) closes its sockets while a
            # slower peer may still be connecting to it, and that peer fails ("Connection closed by peer"). Every
            # rank waits here until all of them are done.
            dist.barrier()
        # by value: a tensor put on the queue as is travels as a shared-memory handle that the parent can only open
        # while this process is alive, and this process exits right after
        queue.put((rank if key is None else key, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank
        queue.put((rank if key is None else key, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, backend: str = "gloo",
                    timeout: float = PROCESS_TIMEOUT) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks with a process group; return per-rank results.

    Raises ``RuntimeError`` with the first failing rank's traceback. Ranks still running after ``timeout`` seconds
    are killed. Results are pickled by value: keep them to tensors and plain Python objects.
    """
    return run_worlds(lambda world, rank, size, *rest: fn(rank, size, *rest), 1, world_size, *args, backend=backend,
                      timeout=timeout)[0]


def run_worlds(fn: Callable, worlds: int, world_size: int, *args: Any, backend: str = "gloo",
               timeout: float = PROCESS_TIMEOUT, env: Callable[[int], dict[str, str]] = lambda world: {}
               ) -> list[list[Any]]:
    """Run ``fn(world, rank, world_size, *args)`` on ``worlds`` worlds of ``world_size`` forked ranks each, side by
    side, every world with its own store (``MASTER_PORT``) and process group, and ``env(world)`` in its environment;
    return ``results[world][rank]``. Failures and timeouts as :func:`run_distributed`."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    ports = free_ports(worlds)
    procs = [ctx.Process(target=_child, args=(_in_world(fn, world), rank, world_size, ports[world], backend, args,
                                              queue, (world, rank), env(world)))
             for world in range(worlds) for rank in range(world_size)]
    for p in procs:
        p.start()
    results: dict[tuple[int, int], Any] = {}
    failed = True
    try:
        for _ in procs:
            key, ok, value = queue.get(timeout=timeout)
            if not ok:
                where = f"rank {key[1]}" if worlds == 1 else f"world {key[0]}, rank {key[1]}"
                raise RuntimeError(f"{where} failed:\n{value}")
            results[key] = pickle.loads(value)
        failed = False
    finally:
        for p in procs:
            # after a failure the other ranks may wait in a collective forever: do not wait for them
            p.join(timeout=0 if failed else 10)
            if p.is_alive():
                p.kill()
                p.join()
    return [[results[(world, rank)] for rank in range(world_size)] for world in range(worlds)]


def _in_world(fn: Callable, world: int) -> Callable:
    def run(rank: int, world_size: int, *args: Any) -> Any:
        return fn(world, rank, world_size, *args)
    return run


__all__ = ["PROCESS_TIMEOUT", "free_port", "free_ports", "run_distributed", "run_worlds"]
