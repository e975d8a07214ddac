"""Load safety: checkpoints hold only tensors and plain values, and nothing is unpickled beyond them.

Saving converts containers to plain ones (:func:`plain_checkpoint`) and refuses what ``torch.load(weights_only=True)``
could not load back (:func:`unsafe_entry`); loading DCP folders reads their ``.metadata`` through an allow-list
(:class:`SafeFileSystemReader`) and their non-tensor values with ``weights_only=True`` (:class:`SafeLoadPlanner`).
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner

_PLAIN_LEAVES = (Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)
# what the hyperparameters' type is stored under (Lightning stores the class of OmegaConf hyperparameters there)
_HPARAMS_TYPE_KEYS = ("hparams_type", "datamodule_hparams_type")


def unsafe_entry(obj: Any, where: str = "checkpoint") -> str | None:
    """A message naming the first value that ``torch.load(weights_only=True)`` could not load back, else None.

    Judges the checkpoint as it is written, that is after :func:`plain_checkpoint`.
    """
    if isinstance(obj, _PLAIN_LEAVES):
        return None
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            if not isinstance(key, (str, int, float, bool, type(None), tuple)):
                return _unsafe_message(f"{where} key {key!r}", key)
            problem = unsafe_entry(key, f"{where} key {key!r}") or unsafe_entry(value, f"{where}[{key!r}]")
            if problem:
                return problem
        return None
    # exact types: a namedtuple or a frozenset is pickled by its class, which weights_only loading refuses
    if type(obj) in (list, tuple, set):
        for idx, value in enumerate(obj):
            problem = unsafe_entry(value, f"{where}[{idx}]")
            if problem:
                return problem
        return None
    return _unsafe_message(where, obj)


def _unsafe_message(where: str, obj: Any) -> str:
    return (
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; checkpoints hold only tensors and plain values"
        " so that loading never unpickles code. Fix: store it as plain values (e.g. str, numbers, dict), or leave it"
        " out (save_hyperparameters(ignore=[...]))."
    )


def plain_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` as it is written: plain containers throughout (see :func:`_plain`), and the class of OmegaConf
    hyperparameters stored by name, which Lightning's ``load_from_checkpoint`` reads back as an ``AttributeDict``."""
    out = _plain(checkpoint)
    for key in _HPARAMS_TYPE_KEYS:
        if isinstance(out.get(key), type):
            out[key] = f"{out[key].__module__}.{out[key].__qualname__}"
    return out


def hyperparameters_problem(model: Any, datamodule: Any = None) -> str | None:
    """What the first checkpoint save would refuse among the hyperparameters of ``model`` and ``datamodule``, as
    Lightning's ``dump_checkpoint`` stores them; None when they can be saved. Checked at fit start."""
    part: dict[str, Any] = {}
    for obj in (model, datamodule):
        hparams = getattr(obj, "hparams", None) if obj is not None else None
        if hparams:
            part[obj.CHECKPOINT_HYPER_PARAMS_KEY] = hparams
    return unsafe_entry(plain_checkpoint(part))


def _plain(obj: Any) -> Any:
    """A copy of ``obj`` in which dict and list subclasses (e.g. Lightning's ``AttributeDict``) and OmegaConf
    containers (resolved) are plain dicts and lists. Tensors are not copied."""
    from omegaconf import Container, OmegaConf

    if isinstance(obj, Tensor):
        return obj
    if isinstance(obj, Container):
        return _plain(OmegaConf.to_container(obj, resolve=True))
    if isinstance(obj, collections.OrderedDict):
        out = collections.OrderedDict((k, _plain(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]  # module versions for load_state_dict
        return out
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_plain(v) for v in obj)
    return obj


# ---------------------------------------------------------------------------------------------------- safe DCP reading

def _safe_dcp_classes() -> dict[tuple[str, str], Any]:
    md = dcp_metadata
    allowed: dict[tuple[str, str], Any] = {
        (md.__name__, name): getattr(md, name) for name in dir(md) if isinstance(getattr(md, name), type)
    }
    allowed[(dcp_filesystem.__name__, "_StorageInfo")] = dcp_filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    allowed.update({("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice})
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only its own record types, torch sizes, dtypes and paths."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _MetadataUnpickler._allowed is None:
            _MetadataUnpickler._allowed = _safe_dcp_classes()
        found = _MetadataUnpickler._allowed.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name} from a checkpoint's .metadata: only checkpoint records are allowed"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is read through an allow-list instead of ``pickle.load``."""

    def read_metadata(self) -> Any:
        path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _safe_load_bytes(planner: Any, read_item: Any, value: io.BytesIO) -> None:
    # DCP's own load_bytes uses weights_only=False; the same placement logic, without unpickling code
    obj = torch.load(value, weights_only=True)
    if planner.flatten_state_dict:
        from torch.distributed.checkpoint._traverse import set_element

        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are loaded with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        _safe_load_bytes(self, read_item, value)


class SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner for loading everything into an empty dict (consolidation), with the same safe loading."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        _safe_load_bytes(self, read_item, value)


__all__ = [
    "SafeEmptyLoadPlanner",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "hyperparameters_problem",
    "plain_checkpoint",
    "unsafe_entry",
]
