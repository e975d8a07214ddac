"""Saying which node stopped answering when a collective fails.

gloo reports a lost peer as ``Timed out waiting 10000ms for recv operation to complete`` (the link was cut, or a node
hangs) or ``Connection closed by peer [169.254.77.2]:51234`` (a node's processes died), NCCL as a watchdog timeout:
nothing says which node that was. At setup every rank learns where every other rank runs (:func:`gather_addresses`,
one small collective); when a collective fails, :func:`lost_peer_note` names the nodes and ranks across the link
that this rank's groups were waiting for, or the node whose address closed the connection, and what to do next.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

#: what gloo and NCCL say when a peer stopped answering or went away
_LOST_PEER = re.compile(r"Timed out waiting|Connection closed by peer|Connection reset by peer|Broken pipe|"
                        r"Connection refused|Watchdog caught collective operation timeout|timed out", re.IGNORECASE)
_ADDRESS = re.compile(r"\[?(\d{1,3}(?:\.\d{1,3}){3}|[0-9a-fA-F:]+:[0-9a-fA-F:]*)\]?:\d+")


@dataclass(frozen=True)
class RankAddress:
    """Where one rank runs: its node, host name and the address it reaches the rendezvous from."""

    rank: int
    node: int
    host: str
    address: str | None


def local_address() -> str | None:
    """The address this process reaches the rendezvous master (``MASTER_ADDR``) from; nothing is sent."""
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return None
    try:
        with socket.socket(socket.AF_INET6 if ":" in master else socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def gather_addresses(node: int) -> list[RankAddress]:
    """Every rank's :class:`RankAddress`, in rank order. Collective on the default group."""
    mine = RankAddress(dist.get_rank(), node, socket.gethostname(), local_address())
    table: list[RankAddress | None] = [None] * dist.get_world_size()
    dist.all_gather_object(table, mine)
    return [entry for entry in table if entry is not None]


def _where(entries: Sequence[RankAddress]) -> str:
    first = entries[0]
    ranks = ", ".join(str(e.rank) for e in entries)
    address = f", {first.address}" if first.address else ""
    return f"node {first.node} ({first.host}{address}; rank{'s' if len(entries) > 1 else ''} {ranks})"


def lost_peer_note(error: BaseException, table: Sequence[RankAddress], groups: Sequence[Sequence[int]],
                   rank: int) -> str | None:
    """What this rank can say about a collective that failed because a peer stopped answering; ``None`` for any
    other error (or without a table). ``groups`` are the process groups this rank communicates on."""
    text = f"{type(error).__name__}: {error}"
    if not table or not _LOST_PEER.search(text):
        return None
    me = table[rank]
    by_node: dict[int, list[RankAddress]] = {}
    for peer in sorted({r for group in groups for r in group if table[r].node != me.node}):
        by_node.setdefault(table[peer].node, []).append(table[peer])
    closing = set(_ADDRESS.findall(text))
    closed = [entries for entries in by_node.values() if entries[0].address in closing]
    here = f"rank {rank} on node {me.node}"
    if closed:
        what = "; ".join(_where(e) for e in closed) + " closed the connection (its processes stopped)"
    elif by_node:
        what = ("this rank's process groups wait for " + "; ".join(_where(e) for e in by_node.values())
                + " across the inter-node link, which stopped answering (the node hangs or died, or the link is down)")
    else:
        what = "every peer of this rank's process groups runs on its own node: a rank of this node stopped answering"
    if not closed and any(e.node == me.node and e.rank != rank and e.address in closing for e in table):
        what += "; a rank of this node closed its connection first (it stopped on its own error)"
    return (f"lightning_smp: {here} ({me.host}): a collective failed because a peer stopped answering: {what}."
            " Checkpoints are committed atomically, so the last one committed before the failure is whole: resume"
            " from it (ckpt_path=...), on the nodes that remain with hybrid_shard_degree='auto' or a degree that"
            " divides the new world size.")


__all__ = ["RankAddress", "gather_addresses", "local_address", "lost_peer_note"]
