"""A Fabric state dict and the checkpoint format: what ``fabric.save(path, state)`` writes of a state under Fabric's
contract (the module and optimizers as sharded or full state dicts, every object with ``state_dict()`` through it,
plain values as they are) and what ``fabric.load(path, state)`` puts back. Explicit inputs (the sharded model, the
format, the run): the Fabric strategy only wires them in."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _move_state_into
from lightning.fabric.utilities.types import _Stateful
from torch.nn import Module
from torch.optim import Optimizer

from lightning_smp.checkpoint.format import FABRIC_KEYS, RUN_KEY, checkpoint_kind, fabric_layout, lightning_version
from lightning_smp.checkpoint.loading import load
from lightning_smp.checkpoint.local import LocalStateCheck, model_state_to_save, optimizer_state_to_save
from lightning_smp.checkpoint.saving import CheckpointRun
from lightning_smp.checkpoint.state_dict import ShardedModel
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.names import FULL, SHARDED, StateDictType

#: Keys a Fabric checkpoint carries for the Trainer only (left out of what ``fabric.load`` returns).
FOR_THE_TRAINER = ("lr_schedulers", "pytorch-lightning_version")


def module_key(state: Mapping[str, Any]) -> str:
    """The key of the one module in a Fabric state dict."""
    keys = [k for k, v in state.items() if isinstance(v, Module)]
    if len(keys) != 1:
        raise HybridShardConfigError(
            f"the state holds {len(keys)} modules ({', '.join(map(repr, keys)) or 'none'}); hybrid sharding saves and"
            " loads exactly one. Fix: put the model set up by fabric.setup_module() under one key, e.g. 'model'."
        )
    return keys[0]


def split_state(state: Mapping[str, Any]) -> tuple[str, Module, list[str], dict[str, Any]]:
    """(the module's key, the module, the optimizers' keys in order, everything else) of a Fabric state dict."""
    key = module_key(state)
    optimizer_keys = [k for k, v in state.items() if isinstance(v, Optimizer)]
    rest = {k: v for k, v in state.items() if not isinstance(v, (Module, Optimizer))}
    return key, state[key], optimizer_keys, rest


def state_of(obj: Any) -> Any:
    """What a checkpoint holds of a non-model entry of the state: ``state_dict()`` of a stateful object (Fabric's
    contract), anything else as it is (and refused when saving if it is not a plain value)."""
    return obj.state_dict() if isinstance(obj, _Stateful) else obj


def fabric_checkpoint(state: Mapping[str, Any], model: ShardedModel, kind: StateDictType,
                      check: LocalStateCheck | None,
                      filter: Mapping[str, Callable[[str, Any], bool]] | None = None) -> dict[str, Any]:
    """What ``fabric.save`` writes of ``state``, whose module ``model`` is: in the Trainer's layout for ``"sharded"``
    (the same folder as the Trainer strategy writes, with what the Trainer needs to resume recorded as added, so
    that consolidating it gives what a full save writes), in the layout of Fabric's ``FSDPStrategy`` for
    ``"full"`` (the model and optimizers under the user's keys). ``check``: a background saver's (the state is then
    described from each rank's shards where the engine can); ``filter``: Fabric's, by state key. Collective."""
    key, _, optimizer_keys, rest = split_state(state)
    checkpoint: dict[str, Any] = {k: state_of(v) for k, v in rest.items()}
    model_state = model_state_to_save(model, kind, check)
    if filter and key in filter:
        keep = filter[key]
        model_state = {k: v for k, v in model_state.items() if keep(k, v)}
    checkpoint["state_dict"] = model_state
    checkpoint["optimizer_states"] = [optimizer_state_to_save(model, state[k], i, kind, check)
                                      for i, k in enumerate(optimizer_keys)]
    if kind == FULL:
        return fabric_layout(checkpoint, key, optimizer_keys)
    added = [k for k in FOR_THE_TRAINER if k not in checkpoint]
    checkpoint.setdefault("lr_schedulers", [])
    checkpoint.setdefault("pytorch-lightning_version", lightning_version())
    checkpoint[FABRIC_KEYS] = {"module": key, "optimizers": optimizer_keys, "for_the_trainer": added}
    return checkpoint


def restore_fabric_state(model: ShardedModel, path: Any, state: dict[str, Any], *, strict: bool,
                         run: CheckpointRun, extra: Mapping[str, Optimizer] | None = None) -> dict[str, Any]:
    """``fabric.load(path, state)``: the checkpoint (either format, of either front end, or a full file of
    Lightning's own Fabric ``FSDPStrategy``) loaded into ``state``, whose module ``model`` is: objects with
    ``load_state_dict()`` restored in place (Fabric's own helper; a data loader resumes its position), other entries
    replaced; ``run`` continues the checkpoint's run; ``extra``: as for :func:`~lightning_smp.checkpoint.load`.
    Returns what ``state`` did not ask for. Collective."""
    key, module, optimizer_keys, rest = split_state(state)
    remainder = load(model, path, optimizers=[state[k] for k in optimizer_keys], strict=strict,
                     model_name=type(module).__name__, state_keys=(key, optimizer_keys), extra=extra)
    for name in ("state_dict", "optimizer_states", FABRIC_KEYS, *FOR_THE_TRAINER):
        if name not in rest:
            remainder.pop(name, None)
    run.continue_from(remainder)
    missing = [name for name in rest if name not in remainder]
    if missing and strict:
        raise HybridShardConfigError(
            f"checkpoint {str(path)!r} has no {missing[0]!r}, which the state to restore asks for. Fix: load with"
            " strict=False, or restore only what the checkpoint holds."
        )
    _move_state_into(source=remainder, destination=state, keys=set(rest))
    remainder.pop(RUN_KEY, None)
    return remainder


def load_raw(path: Path, module: Module, strict: bool, sharded: Callable[[Module], ShardedModel]) -> None:
    """``fabric.load_raw(path, module)``: a plain ``torch.save(model.state_dict())`` file, or a checkpoint of either
    format (loaded into ``sharded(module)``), into ``module``. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if checkpoint_kind(path) == SHARDED or _is_lightning_file(path):
        load(sharded(module), path, strict=strict, model_name=type(module).__name__)
        return
    raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    set_model_state_dict(module, raw, options=StateDictOptions(full_state_dict=True, strict=strict))


def _is_lightning_file(path: Path) -> bool:
    """Whether a full checkpoint file is a Lightning one (has a ``state_dict``), not a raw module state dict."""
    if not path.is_file():
        return False
    content = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return isinstance(content, dict) and "state_dict" in content and isinstance(content["state_dict"], dict)


__all__ = [
    "FOR_THE_TRAINER",
    "fabric_checkpoint",
    "load_raw",
    "module_key",
    "restore_fabric_state",
    "split_state",
    "state_of",
]
