"""Loading either kind of checkpoint into a sharded model, at any degree and world size, whatever wrote it.

Keys and shapes are checked before anything is loaded, naming the first key that does not fit; the optimizer state
is resharded through ``torch.distributed.checkpoint.state_dict`` (Lightning's FSDP loader splits it over the whole
world under hybrid sharding, which is silently wrong).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_smp.checkpoint.format import META_FILENAME, MODEL_KEY, checkpoint_kind, trainer_layout
from lightning_smp.checkpoint.safety import SafeFileSystemReader, SafeLoadPlanner
from lightning_smp.checkpoint.state_dict import ShardedModel
from lightning_smp.errors import CheckpointError
from lightning_smp.names import SHARDED


def load(model: ShardedModel, path: str | os.PathLike, *, optimizers: Sequence[Optimizer] = (), strict: bool = True,
         model_name: str = "the model", state_keys: tuple[str, Sequence[str]] | None = None,
         extra: Mapping[str, Optimizer] | None = None) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizers`` (none: weights only). Collective.

    Returns the rest of the checkpoint (loops, callbacks, schedulers, this library's record, ...). ``strict=False``
    allows missing and unexpected keys; shapes must fit either way. ``model_name`` names the model in errors.
    ``state_keys`` (the module's key, the optimizers' keys) are where a full checkpoint in Fabric's layout that does
    not record them holds the model and optimizers (one written by Lightning's own Fabric ``FSDPStrategy``).
    ``extra``: optimizers whose state an entry of its key holds
    (:func:`~lightning_smp.checkpoint.format.tensor_entries`), each loaded when the checkpoint has its entry (in
    place of its own, for one of ``optimizers``) and left as it is otherwise.

    Raises:
        CheckpointError: ``path`` is not a checkpoint, a key or shape does not fit, or the optimizer count differs.
    """
    path = Path(model.collectives.broadcast(os.fspath(path)))
    if checkpoint_kind(path) == SHARDED:
        return _load_sharded(model, path, list(optimizers), strict, model_name, dict(extra or {}))
    return _load_full(model, path, list(optimizers), strict, model_name, state_keys or (None, ()), dict(extra or {}))


def load_entries(model: ShardedModel, path: str | os.PathLike, entries: Mapping[str, Optimizer]) -> dict[str, Any]:
    """Load the optimizer states a checkpoint at ``path`` holds under ``entries``' keys (a checkpoint of those entries
    alone, without a model: ``replica_sync``'s own inner state of a fault-tolerant group) into their optimizers,
    resharded to ``model``'s layout; an entry the checkpoint lacks leaves its optimizer as it is. Returns the rest of
    the checkpoint (its plain values). Collective over ``model``'s ranks.

    Raises:
        CheckpointError: ``path`` is not a checkpoint."""
    import torch.distributed.checkpoint as dcp

    path = Path(model.collectives.broadcast(os.fspath(path)))
    if checkpoint_kind(path) != SHARDED:
        checkpoint = dict(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
        for key, optimizer in entries.items():
            if key in checkpoint:
                _load_full_optimizer(model, optimizer, checkpoint.pop(key))
        return checkpoint
    reader = SafeFileSystemReader(path)
    keys = reader.read_metadata().state_dict_metadata
    found = {key: optimizer for key, optimizer in entries.items() if any(k.startswith(f"{key}.") for k in keys)}
    state = _optimizer_templates(model, found, keys)
    if state:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    _set_optimizer_states(model, found, state)
    meta = path / META_FILENAME
    return dict(torch.load(meta, map_location="cpu", weights_only=True)) if meta.is_file() else {}


def read_record(path: str | os.PathLike, key: str) -> Any:
    """The plain value a checkpoint at ``path`` (either kind) holds under ``key`` (``None``: none), read without its
    tensors (a sharded checkpoint's ``meta.pt``; a full one's file, mapped)."""
    path = Path(path)
    source = path / META_FILENAME if checkpoint_kind(path) == SHARDED else path
    if not source.is_file():
        return None
    checkpoint = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    return checkpoint.get(key) if isinstance(checkpoint, dict) else None


def _model_shapes(model: ShardedModel) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: tuple(v.shape) for k, v in get_model_state_dict(model.module).items() if isinstance(v, Tensor)}


def check_model_fits(path: Path, saved: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]],
                     strict: bool, model_name: str) -> None:
    """Raise naming the first key (in the model's order, then the checkpoint's) that does not fit."""
    for key, shape in expected.items():
        if key not in saved:
            if strict:
                raise _mismatch(path, model_name, key, "the model has it, the checkpoint does not")
        elif tuple(saved[key]) != tuple(shape):
            raise _mismatch(path, model_name, key,
                            f"the checkpoint has shape {tuple(saved[key])}, the model expects {tuple(shape)}")
    if strict:
        for key in saved:
            if key not in expected:
                raise _mismatch(path, model_name, key, "the checkpoint has it, the model does not")


def _mismatch(path: Path, model_name: str, key: str, reason: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {str(path)!r} does not fit {model_name}: first mismatching key {key!r}: {reason}. Fix: load it"
        " into the model that wrote it, or set `strict_loading = False` on the LightningModule to skip missing"
        " or unexpected keys (shapes must still match)."
    )


def _check_optimizer_count(path: Path, saved: list[Any] | None, optimizers: list[Optimizer]) -> None:
    if saved is None or len(saved) != len(optimizers):
        have = "no optimizer state" if saved is None else f"{len(saved)} optimizer state(s)"
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds {have} but {len(optimizers)} optimizer(s) are configured, so training"
            " cannot resume exactly. Fix: resume with the same optimizers, or load the weights only"
            " (trainer.validate/test/predict(ckpt_path=...), or a checkpoint saved with weights_only=False)."
        )


@contextmanager
def _keeping_hyperparameter_types(optimizer: Optimizer) -> Iterator[None]:
    """Loading through ``torch.distributed.checkpoint`` can turn a tuple hyperparameter (Adam's ``betas``) into a
    list (for FSDP2 models): give each its type back, so that a resumed optimizer equals the one that was saved."""
    before = [{key: type(value) for key, value in group.items()} for group in optimizer.param_groups]
    yield
    for group, types in zip(optimizer.param_groups, before):
        for key, kind in types.items():
            if kind is tuple and type(group.get(key)) is list:
                group[key] = tuple(group[key])


def _load_param_groups(optimizer: Optimizer, saved_groups: list[dict[str, Any]]) -> None:
    local = optimizer.state_dict()["param_groups"]
    if len(local) != len(saved_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter group(s), this one has {len(local)}."
            " Fix: configure the optimizer as in the run that wrote the checkpoint."
        )
    optimizer.load_state_dict({"state": {}, "param_groups": [{**s, "params": g["params"]} for s, g in zip(saved_groups, local)]})


def _load_full(model: ShardedModel, path: Path, optimizers: list[Optimizer], strict: bool,
               model_name: str, state_keys: tuple[str | None, Sequence[str]],
               extra: dict[str, Optimizer]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(checkpoint, dict):
        checkpoint = trainer_layout(checkpoint, *state_keys)
    if not isinstance(checkpoint, dict) or MODEL_KEY not in checkpoint:
        raise CheckpointError(
            f"ckpt_path={str(path)!r} is not a Lightning checkpoint: it has no 'state_dict' (Trainer) and no model"
            " under the key of the state to restore (Fabric)."
        )
    state = checkpoint.pop("state_dict")
    check_model_fits(path, {k: tuple(v.shape) for k, v in state.items() if isinstance(v, Tensor)},
                     _model_shapes(model), strict, model_name)
    saved = checkpoint.get("optimizer_states")
    if optimizers:
        _check_optimizer_count(path, saved, optimizers)  # before anything is loaded
    set_model_state_dict(model.module, state, options=StateDictOptions(full_state_dict=True, strict=strict))
    for optimizer, optim_state in zip(optimizers, saved or []):
        _load_full_optimizer(model, optimizer, optim_state)
    for key, optimizer in extra.items():  # (after the optimizers' own: an entry found replaces it)
        if key in checkpoint:
            _load_full_optimizer(model, optimizer, checkpoint.pop(key))
    return dict(checkpoint)


def _load_full_optimizer(model: ShardedModel, optimizer: Optimizer, optim_state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not optim_state.get("state"):
        # no per-parameter state (plain SGD, or saved before a step): only the hyperparameters of each group
        _load_param_groups(optimizer, optim_state["param_groups"])
        return
    params = [p for g in optim_state["param_groups"] for p in g["params"]]
    if params and isinstance(params[0], int):
        with model.engine.optimizer_state_context(model.module, optimizer):
            optim_state = model.engine.optimizer_state_by_name(model.module, optimizer, optim_state)
    with _keeping_hyperparameter_types(optimizer), model.engine.optimizer_state_context(model.module, optimizer):
        set_optimizer_state_dict(model.module, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))


def _load_sharded(model: ShardedModel, path: Path, optimizers: list[Optimizer], strict: bool,
                  model_name: str, extra: dict[str, Optimizer]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    module = model.module
    reader = SafeFileSystemReader(path)
    keys = reader.read_metadata().state_dict_metadata
    saved = {k[len("model."):]: tuple(v.size) for k, v in keys.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    model_state = get_model_state_dict(module)
    expected = {k: tuple(v.shape) for k, v in model_state.items() if isinstance(v, Tensor)}
    check_model_fits(path, saved, expected, strict, model_name)
    if not strict:
        model_state = {k: v for k, v in model_state.items() if k in saved}

    state: dict[str, Any] = {"model": model_state}
    if optimizers:
        count = len({k.split(".", 1)[0] for k in keys if k.startswith("optimizer_")})
        _check_optimizer_count(path, [None] * count if count else None, optimizers)
    found = {key: optimizer for key, optimizer in extra.items() if any(k.startswith(f"{key}.") for k in keys)}
    # an entry found for one of the optimizers replaces its own (the templates share the optimizer's tensors: DCP
    # would read both into them, in no set order)
    named = {**{f"optimizer_{idx}": optimizer for idx, optimizer in enumerate(optimizers)
                if not any(optimizer is other for other in found.values())}, **found}
    state.update(_optimizer_templates(model, named, keys))
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(allow_partial_load=not strict))
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=strict))
    _set_optimizer_states(model, named, state)

    meta = path / META_FILENAME
    return dict(torch.load(meta, map_location="cpu", weights_only=True)) if meta.is_file() else {}


def _optimizer_templates(model: ShardedModel, named: Mapping[str, Optimizer], keys: Any) -> dict[str, Any]:
    """What DCP reads each of ``named``'s entries into, given the checkpoint's ``keys``."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    templates: dict[str, Any] = {}
    for key, optimizer in named.items():
        if any(k.startswith(f"{key}.state.") for k in keys):
            # the template holds this layout's shards; DCP reads whichever saved chunks overlap them
            with model.engine.optimizer_state_context(model.module, optimizer):
                templates[key] = get_optimizer_state_dict(model.module, optimizer)
        else:
            # saved without per-parameter state: DCP needs the same structure to read the groups back into
            templates[key] = {"param_groups": optimizer.state_dict()["param_groups"]}
    return templates


def _set_optimizer_states(model: ShardedModel, named: Mapping[str, Optimizer], state: Mapping[str, Any]) -> None:
    """Each of ``named``'s optimizers from what DCP read into its template."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    for key, optimizer in named.items():
        optim_state = state[key]
        if "state" in optim_state:
            with _keeping_hyperparameter_types(optimizer), model.engine.optimizer_state_context(model.module, optimizer):
                set_optimizer_state_dict(model.module, optimizer, optim_state)
        else:
            _load_param_groups(optimizer, optim_state["param_groups"])


__all__ = ["check_model_fits", "load", "load_entries", "read_record"]
