"""Atomic file operations: write under a temporary name in the same folder, then rename into place; remove by
renaming out of the way first (:func:`remove_atomically`).

A save killed part way leaves the previous checkpoint intact (and a ``.NAME.tmp-*`` leftover, which the run that
left it removes at its next save: :func:`remove_leftovers`).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import torch

#: a temporary of :func:`temporary_name`: never a checkpoint, whatever it holds (it may be half written or half
#: deleted)
_TEMPORARY = re.compile(r"^\..+\.(tmp|old|link|removing)(-[0-9a-f]{8})?-[0-9a-f]{12}$")


def temporary_name(dest: Path, tag: str = "tmp", owner: str | None = None) -> Path:
    """A hidden, unique sibling of ``dest`` (same folder, so a rename is atomic): ``.NAME.tmp-<12 hex digits>``, or
    ``.NAME.tmp-<8 hex digits of owner>-<12 hex digits>`` for a save of run ``owner`` (see :func:`remove_leftovers`).
    """
    middle = f"-{owner[:8]}" if owner else ""
    return dest.with_name(f".{dest.name}.{tag}{middle}-{uuid.uuid4().hex[:12]}")


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is a temporary of :func:`temporary_name`: uncommitted, possibly half written."""
    return bool(_TEMPORARY.match(path.name))


def remove_leftovers(folder: Path, owner: str, keep: Path | None = None) -> list[Path]:
    """Remove the temporaries that run ``owner`` left in ``folder`` (a save killed part way), except ``keep`` (the
    save starting now); return them.

    Only this run's: another run may be writing into the same folder right now. Call it when this run has no other
    save in flight.
    """
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob(f".*.tmp-{owner[:8]}-*") if is_temporary(p) and p != keep]
    for path in found:
        remove(path)
    return found


def write_file(obj: Any, path: Path) -> None:
    """``torch.save`` into ``path`` and flush it to disk (``path`` is a temporary name; see :func:`commit`)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def commit(tmp: Path, dest: Path) -> None:
    """Give ``tmp`` (file or folder) the name ``dest`` in one atomic step, then delete what ``dest`` held before."""
    if not os.path.lexists(dest):
        os.rename(tmp, dest)
    elif tmp.is_file() and dest.is_file() and not dest.is_symlink():
        os.replace(tmp, dest)
    elif _exchange(tmp, dest):
        remove(tmp)  # the previous checkpoint now lives under the temporary name
    else:
        # no atomic exchange (not Linux, or a filesystem without it): a short window with the old one set aside
        aside = temporary_name(dest, "old")
        os.rename(dest, aside)
        os.rename(tmp, dest)
        remove(aside)
    _fsync_dir(dest.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return bool(renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0)


def remove(path: Path) -> None:
    """Delete a file, a link or a folder tree; nothing if it does not exist."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def remove_atomically(path: Path) -> None:
    """Remove the checkpoint at ``path`` (a sharded folder, a full file or a link) in one visible step: rename it to
    ``.NAME.removing-<12 hex digits>`` in the same folder, then delete that; nothing if it does not exist.

    Deleting in place takes a folder apart file by file under its own name, where a reader (an evaluator picking the
    newest checkpoint, an uploader) would find it half gone. Until the rename the name holds the whole checkpoint,
    after it nothing. A removal killed part way leaves the hidden name (never loaded: :func:`is_temporary`).
    """
    if not os.path.lexists(path):
        return
    aside = temporary_name(path, "removing")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # removed meanwhile (Lightning's removal tolerates a missing path too)
    # the rename reaches the disk before any deletion does: after a crash the name holds the whole checkpoint or
    # nothing
    _fsync_dir(path.parent)
    remove(aside)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = ["commit", "is_temporary", "remove", "remove_atomically", "remove_leftovers", "temporary_name",
           "write_file"]
