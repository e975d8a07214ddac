"""Converting and reading checkpoints in one process (no process group, no GPU): ``read_full``, ``consolidate``,
``load_from_checkpoint`` and the command line ``python -m lightning_smp.checkpoint consolidate SRC DST``."""

from __future__ import annotations

import argparse
import collections
import io
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

import torch
from typing_extensions import Self

from lightning_smp.checkpoint.atomic import commit, temporary_name, write_file
from lightning_smp.checkpoint.format import (
    FABRIC_KEYS,
    META_FILENAME,
    RUN_KEY,
    checkpoint_kind,
    fabric_layout,
    tensor_entries,
    trainer_layout,
)
from lightning_smp.checkpoint.safety import SafeEmptyLoadPlanner, SafeFileSystemReader
from lightning_smp.errors import CheckpointError
from lightning_smp.names import FULL, SHARDED


class _Loadable(Protocol):
    """A ``LightningModule`` or ``LightningDataModule`` class, as :func:`load_from_checkpoint` uses it."""

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | Path | IO, **kwargs: Any) -> Self: ...


T = TypeVar("T", bound=_Loadable)


def optimizer_state_by_index(optim_state: dict[str, Any]) -> dict[str, Any]:
    """Re-key an optimizer state keyed by parameter name into torch's standard layout (index in group order)."""
    order = [p for g in optim_state.get("param_groups", []) for p in g["params"]]
    if all(isinstance(p, int) for p in order):
        return {"state": dict(optim_state.get("state", {})), "param_groups": list(optim_state.get("param_groups", []))}
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: value for name, value in optim_state.get("state", {}).items()},
        "param_groups": [{**g, "params": [index[p] for p in g["params"]]} for g in optim_state["param_groups"]],
    }


def read_full(path: str | os.PathLike) -> dict[str, Any]:
    """The full checkpoint at ``path`` as a dict of CPU tensors, in one process, in the Trainer's layout (the model
    under ``state_dict``, the optimizers under ``optimizer_states``) whichever front end wrote it: a full file as it
    is, a sharded folder assembled. Loads with ``weights_only=True``."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    if checkpoint_kind(path) == FULL:
        return trainer_layout(torch.load(path, map_location="cpu", weights_only=True))
    state: dict[str, Any] = {}
    # the private loader, as Lightning's utility and torch's dcp_to_torch_save use: the public one keeps only the
    # keys of a template, and here the template is empty
    _load_state_dict(state, storage_reader=SafeFileSystemReader(path), planner=SafeEmptyLoadPlanner(), no_dist=True)
    meta = path / META_FILENAME
    checkpoint: dict[str, Any] = dict(torch.load(meta, map_location="cpu", weights_only=True)) if meta.is_file() else {}
    checkpoint["state_dict"] = collections.OrderedDict(state.pop("model"))
    count = len([k for k in state if k.startswith("optimizer_")])
    if count:
        checkpoint["optimizer_states"] = [optimizer_state_by_index(state[f"optimizer_{i}"]) for i in range(count)]
    for key in tensor_entries(state):  # replica_sync's outer and per-group optimizer states
        checkpoint[key] = optimizer_state_by_index(state[key])
    record = dict(checkpoint.get(RUN_KEY) or {})
    record["state_dict_type"] = FULL
    checkpoint[RUN_KEY] = record
    return checkpoint


def consolidate(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Turn the sharded checkpoint folder ``src`` into the full checkpoint file ``dst``; runs in one process.

    The result equals what ``state_dict_type="full"`` would have written, in the layout of the front end that wrote
    ``src`` (a Fabric checkpoint keeps the keys of the state the user saved, e.g. ``model`` and ``optimizer``, as
    Fabric's own full checkpoints do). ``dst`` must not exist.
    """
    src, dst = Path(src), Path(dst)
    if checkpoint_kind(src) != SHARDED:
        raise CheckpointError(f"src={str(src)!r} is not a sharded checkpoint folder.")
    if os.path.lexists(dst):
        raise CheckpointError(f"dst={str(dst)!r} exists; refusing to overwrite it. Fix: choose a new name.")
    checkpoint = read_full(src)
    record = checkpoint.get(FABRIC_KEYS)
    if isinstance(record, dict):
        checkpoint = fabric_layout(checkpoint, record["module"], record.get("optimizers", []),
                                   drop=record.get("for_the_trainer", []))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(dst)
    write_file(checkpoint, tmp)
    commit(tmp, dst)
    return dst


def load_from_checkpoint(cls: type[T], path: str | os.PathLike, **kwargs: Any) -> T:
    """``cls.load_from_checkpoint(path, **kwargs)`` for a checkpoint of either kind, in one process (no GPU needed).

    ``cls`` is a ``LightningModule`` or ``LightningDataModule`` class; ``kwargs`` are those of Lightning's
    ``load_from_checkpoint`` (``map_location``, ``strict``, hyperparameter overrides). A sharded folder is assembled
    in memory first, which holds the model twice for a moment; for a large model write one file with
    ``python -m lightning_smp.checkpoint consolidate`` instead.
    """
    path = Path(path)
    if checkpoint_kind(path) == FULL:
        return cls.load_from_checkpoint(path, **kwargs)
    buffer = io.BytesIO()
    torch.save(read_full(path), buffer)
    buffer.seek(0)
    kwargs.setdefault("weights_only", True)
    return cls.load_from_checkpoint(buffer, **kwargs)


def main(argv: Iterable[str] | None = None) -> int:
    """``python -m lightning_smp.checkpoint consolidate SRC DST``."""
    parser = argparse.ArgumentParser(prog="python -m lightning_smp.checkpoint",
                                     description="Checkpoint tools of lightning_smp.")
    commands = parser.add_subparsers(dest="command", required=True)
    cons = commands.add_parser("consolidate", help="turn a sharded checkpoint folder into one full checkpoint file")
    cons.add_argument("src", help="sharded checkpoint folder (state_dict_type='sharded')")
    cons.add_argument("dst", help="full checkpoint file to create (must not exist)")
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        out = consolidate(args.src, args.dst)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote full checkpoint {out}")
    return 0


__all__ = ["consolidate", "load_from_checkpoint", "main", "optimizer_state_by_index", "read_full"]
