"""The sharded state a background save writes: the engine's own description of its shards where it has one.

Building torch's sharded state dicts is collective work for some engines (FSDP1 gathers every flat parameter to cut
it per parameter): a background save would block on it. An engine may describe the same state from what each rank
holds (``StateDicts.local_model_state``/``local_optimizer_state``; FSDP1 does, see
:mod:`lightning_smp.engines.fsdp1.state`). The first background save of a run checks that description against
torch's, key by key and value by value (:func:`differences`); only if every rank agrees is it used from then on,
otherwise the run keeps torch's state dicts and says so once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_smp.checkpoint.state_dict import ShardedModel, module_state_dict, optimizer_state
from lightning_smp.engines.chunks import TensorChunks
from lightning_smp.names import SHARDED, StateDictType


class LocalStateCheck:
    """Whether the engine's description was found equal to torch's state dicts, per part (``None``: not checked)."""

    def __init__(self) -> None:
        self.verdicts: dict[str, bool] = {}


def background_module_state(model: ShardedModel, check: LocalStateCheck) -> dict[str, Any]:
    """The model's sharded state for a background save (see the module docstring). Collective."""
    return _checked(model, check, "model", lambda: model.engine.local_model_state(model.module),
                    lambda: module_state_dict(model, SHARDED))


def background_optimizer_state(model: ShardedModel, optimizer: Optimizer, index: int,
                               check: LocalStateCheck) -> dict[str, Any]:
    """The optimizer's sharded state for a background save (see the module docstring). Collective."""
    if not model.collectives.any(bool(optimizer.state)):
        return optimizer_state(model, optimizer, SHARDED)  # nothing sharded yet: saved as it is
    return _checked(model, check, f"optimizer_{index}",
                    lambda: model.engine.local_optimizer_state(model.module, optimizer),
                    lambda: optimizer_state(model, optimizer, SHARDED))


def model_state_to_save(model: ShardedModel, kind: StateDictType, check: LocalStateCheck | None) -> dict[str, Any]:
    """The model state a save of ``kind`` writes, the one choice of both front ends: under a background saver
    (``check``, its :class:`LocalStateCheck`) a sharded state described from this rank's shards where the engine can
    (nothing gathered), else torch's state dict of ``kind``. Collective."""
    if check is not None and kind == SHARDED:
        return background_module_state(model, check)
    return module_state_dict(model, kind)


def optimizer_state_to_save(model: ShardedModel, optimizer: Optimizer, index: int, kind: StateDictType,
                            check: LocalStateCheck | None) -> dict[str, Any]:
    """The state of ``optimizer`` (the ``index``-th of the run) a save of ``kind`` writes; as
    :func:`model_state_to_save`. Collective."""
    if check is not None and kind == SHARDED:
        return background_optimizer_state(model, optimizer, index, check)
    return optimizer_state(model, optimizer, kind)


def _checked(model: ShardedModel, check: LocalStateCheck, part: str, local_of: Callable[[], dict[str, Any] | None],
             reference_of: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    collectives = model.collectives
    if check.verdicts.get(part) is False:
        return reference_of()
    local = local_of()
    if collectives.any(local is None):  # every rank takes the same path
        check.verdicts[part] = False
        return reference_of()
    if part in check.verdicts:
        return local  # type: ignore[return-value]  # (not None: agreed above)
    reference = reference_of()
    problem = differences(local, reference, collectives.all_gather)
    check.verdicts[part] = problem is None
    if problem is not None:
        warnings.warn(f"lightning_smp: the engine's description of the {part} state differs from torch's ({problem});"
                      " background saves of this run use torch's sharded state dicts (slower to build).", stacklevel=2)
        return reference
    return local  # type: ignore[return-value]


def differences(local: Any, reference: Any, gather: Callable[[Any], list[Any]]) -> str | None:
    """Why ``local`` (an engine's description, on every rank) does not hold the same state as ``reference`` (torch's
    sharded state dict, on every rank), or ``None``: the same keys over all ranks and every value equal, each
    :class:`TensorChunks` piece against the matching block of the full tensor its DTensor stands for. ``gather``
    all-gathers a picklable object over the world. Collective; every rank returns the same answer."""
    from torch.distributed.tensor import DTensor

    mine, theirs = dict(_flatten(local)), dict(_flatten(reference))
    keys: set[str] = set()
    for part in gather(sorted(mine)):
        keys.update(part)
    problem = None if keys == set(theirs) else f"keys differ: {sorted(keys ^ set(theirs))[:3]}"
    for key in sorted(theirs):  # the same order on every rank: full_tensor is collective
        expected = theirs[key]
        full = expected.full_tensor() if isinstance(expected, DTensor) else expected
        if problem is not None or key not in mine:
            continue
        problem = _difference(key, mine[key], full)
    answers = gather(problem)
    return next((a for a in answers if a is not None), None)


def _difference(key: str, mine: Any, full: Any) -> str | None:
    if isinstance(mine, TensorChunks):
        if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(mine.shape):
            return f"{key}: not a tensor of shape {tuple(mine.shape)}"
        for offsets, data in mine.pieces:
            block = full[tuple(slice(o, o + s) for o, s in zip(offsets, data.shape, strict=True))]
            if data.dtype != full.dtype or not torch.equal(block.cpu(), data.cpu()):
                return f"{key}: the values at {offsets}"
        return None
    if isinstance(mine, torch.Tensor) or isinstance(full, torch.Tensor):
        same = isinstance(mine, torch.Tensor) and isinstance(full, torch.Tensor) and mine.dtype == full.dtype \
            and torch.equal(mine.cpu(), full.cpu())
        return None if same else f"{key}: the values"
    return None if mine == full else f"{key}: {mine!r} against {full!r}"


def _flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [item for key, value in obj.items() for item in _flatten(value, f"{prefix}{key}.")]
    if isinstance(obj, list) and any(isinstance(v, (dict, list, torch.Tensor, TensorChunks)) for v in obj):
        return [item for i, value in enumerate(obj) for item in _flatten(value, f"{prefix}{i}.")]
    return [(prefix[:-1], obj)]


__all__ = [
    "LocalStateCheck",
    "background_module_state",
    "background_optimizer_state",
    "differences",
    "model_state_to_save",
    "optimizer_state_to_save",
]
