"""FSDP1's sharded model and optimizer state as each rank holds it, without gathering anything.

``torch.distributed.checkpoint.state_dict`` gives FSDP1's sharded state as per-parameter ``Shard(0)`` DTensors, which
FSDP1 builds by all-gathering every flat parameter (and every optimizer state) inside the shard group and cutting it
again: collective work on the training's process groups, seconds per save on gloo. A background save must not
block on that, so this module describes the same state from the flat shards themselves: each rank's range of each
parameter becomes a few rectangular :class:`~lightning_smp.engines.chunks.TensorChunks`, written as they are; the
keys, the ``param_groups`` and every other value are those of ``get_model_state_dict``/``get_optimizer_state_dict``.
Loading reads it at any layout, degree and engine (DCP joins the chunks).

Only layouts it knows are described (``use_orig_params=True``, sharded strategies, no shared parameters, optimizer
states shaped like their parameter or scalar); anything else returns ``None`` and the caller takes torch's state
dicts. The caller also checks the description against torch's once per run before relying on it
(:mod:`lightning_smp.checkpoint.local`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.engines.chunks import TensorChunks


def _fsdp() -> Any:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _clean(name: str) -> str:
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return clean_tensor_name(name)


class _Range(NamedTuple):
    """Where this rank's part of one parameter is: its ``shape``, the ``start`` of the range in its row-major
    elements, and the range's ``offset`` and ``numel`` in the local ``flat`` shard."""

    shape: tuple[int, ...]
    start: int
    flat: torch.Tensor
    offset: int
    numel: int


def _parameter_chunks(root: Module) -> dict[int, _Range] | None:
    """``id(parameter) -> its range`` for every parameter FSDP manages.
    ``None`` for a layout this module does not describe, or FSDP1 internals it does not find (another torch)."""
    try:
        return _read_parameter_chunks(root)
    except AttributeError:
        return None


def _read_parameter_chunks(root: Module) -> dict[int, _Range] | None:
    registered = {id(p) for p in root.parameters()}
    out: dict[int, _Range] = {}
    for unit in _fsdp().fsdp_modules(root):
        handle = unit._handle
        if handle is None:
            continue
        flat = handle.flat_param
        if not handle.uses_sharded_strategy or not handle._use_orig_params or flat._shared_param_infos:
            return None
        for param, shape, info in zip(flat._params, flat._shapes, flat._shard_param_infos, strict=True):
            if id(param) not in registered:
                return None
            if info.in_shard:
                out[id(param)] = _Range(tuple(shape), info.intra_param_start_idx, flat, info.offset_in_shard,
                                        info.numel_in_shard)
            else:
                out[id(param)] = _Range(tuple(shape), 0, flat, 0, 0)
    return out


def _chunks(where: _Range, values: torch.Tensor | None = None) -> TensorChunks:
    """The chunks of one parameter (``values``: a state of it shaped like its local range, e.g. Adam's ``exp_avg``)."""
    local = values.reshape(-1) if values is not None else where.flat.detach()[where.offset:where.offset + where.numel]
    return TensorChunks.of_flat_range(where.shape, where.start, local)


def local_model_state(root: Module) -> dict[str, Any] | None:
    """What ``get_model_state_dict(root)`` holds, each managed parameter as this rank's chunks of it (views of the
    live shards; copy them before the next step), the rest (buffers, parameters FSDP does not manage) as they are."""
    params = _parameter_chunks(root)
    if params is None:
        return None
    state: dict[str, Any] = {}
    for name, param in root.named_parameters():
        where = params.get(id(param))
        state[_clean(name)] = _chunks(where) if where is not None else param.detach()
    for prefix, module in root.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                state[_clean(f"{prefix}.{name}" if prefix else name)] = buffer.detach()
    return state


def local_optimizer_state(root: Module, optimizer: Optimizer) -> dict[str, Any] | None:
    """What ``get_optimizer_state_dict(root, optimizer)`` holds: ``state`` keyed by parameter name (each state shaped
    like the parameter as this rank's chunks, scalars such as ``step`` as they are; a parameter this rank holds
    nothing of is left to the ranks that do) and ``param_groups`` with names for parameters."""
    params = _parameter_chunks(root)
    if params is None:
        return None
    names = {id(p): _clean(n) for n, p in root.named_parameters()}
    state: dict[str, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        if any(id(p) not in names for p in group["params"]):
            return None
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [names[id(p)] for p in group["params"]]})
        for param in group["params"]:
            values = optimizer.state.get(param)
            if not values:
                continue
            entry: dict[str, Any] = {}
            where = params.get(id(param))
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and value.dim() == 0:
                    entry[key] = value
                elif isinstance(value, torch.Tensor) and where is not None and value.shape == param.shape:
                    entry[key] = _chunks(where, value)
                else:
                    return None  # a state of a layout this description does not know
            state[names[id(param)]] = entry
    return {"state": state, "param_groups": groups}


__all__ = ["local_model_state", "local_optimizer_state"]
