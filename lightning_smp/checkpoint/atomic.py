"""Atomic file operations: write under a temporary name in the same folder, then rename into place.

A save killed part way leaves the previous checkpoint intact (and a ``.NAME.tmp-*`` leftover).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import torch


def temporary_name(dest: Path, tag: str = "tmp") -> Path:
    """A hidden, unique sibling of ``dest``: ``.NAME.tmp-<12 hex digits>`` (same folder, so a rename is atomic)."""
    return dest.with_name(f".{dest.name}.{tag}-{uuid.uuid4().hex[:12]}")


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


__all__ = ["commit", "remove", "temporary_name", "write_file"]
