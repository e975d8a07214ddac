"""Sharded and full checkpoints for :class:`~lightning_smp.HybridShardFSDPStrategy`.

Two formats, both portable across ``hybrid_shard_degree`` and world sizes, both keeping the optimizer state:

``"sharded"`` (the default)
    A folder written by ``torch.distributed.checkpoint`` (DCP): every rank writes its own shard in parallel and each
    replicated chunk is written once, by the lowest rank holding it (replica group 0; the other replicas write empty
    files). ``meta.pt`` holds everything else (loops, callbacks, schedulers, ...). Loading reshards to whatever
    degree and world size the loading run has.
``"full"``
    One ``torch.save`` file assembled once, on global rank 0, by replica group 0 only. Standard Lightning layout
    (``state_dict`` with the LightningModule's keys, optimizer states keyed by parameter index in the optimizer's
    order), so it also loads on a single device: ``module.load_state_dict(torch.load(f)["state_dict"])``.

Guarantees: writes are atomic (a temporary name in the same folder, then a rename; a save killed part way leaves
the previous checkpoint intact), a path holding another run's checkpoint is never overwritten (each checkpoint
records the id of the run that wrote it; a run resumed from a checkpoint continues that run's id), loading checks
keys and shapes first and names the first mismatching key, and nothing is unpickled beyond tensors and plain
values (``weights_only=True``; DCP's own ``.metadata`` goes through an allow-list).

Convert a sharded checkpoint into a full one (no processes or GPUs needed)::

    python -m lightning_smp.checkpoint consolidate path/to/epoch=0-step=10.ckpt path/to/full.ckpt

or, in Python, :func:`read_full` (the full checkpoint dict of either kind) and :func:`load_from_checkpoint`
(``MyModule.load_from_checkpoint`` for either kind)::

    model = lightning_smp.checkpoint.load_from_checkpoint(MyModule, "path/to/last.ckpt")

Lightning's ``python -m lightning.pytorch.utilities.consolidate_checkpoint FOLDER`` reads the same folders.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import io
import os
import pathlib
import pickle
import shutil
import sys
import uuid
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypeVar, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_smp.errors import HybridShardConfigError
from lightning_smp.mesh import SHARD_AXIS, axis_group, shard_group_of

if TYPE_CHECKING:
    from lightning_smp.strategy import HybridShardFSDPStrategy

#: Name of the file with everything but model and optimizer tensors inside a sharded folder (Lightning's name, so
#: that Lightning's consolidation utility and ``_is_sharded_checkpoint`` recognise our folders).
META_FILENAME = "meta.pt"
#: Key of this library's own record inside every checkpoint dict.
RUN_KEY = "lightning_smp"
FORMAT_VERSION = 1
SHARDED = "sharded"
FULL = "full"
STATE_DICT_TYPES = (SHARDED, FULL)

T = TypeVar("T")

_PathLike = Union[str, os.PathLike]


# ---------------------------------------------------------------------------------------------------- layout helpers


def writer_ranks(strategy: "HybridShardFSDPStrategy") -> list[int]:
    """Global ranks that assemble a full state dict: replica group 0 (the shard group of rank 0).

    The other replicas hold identical shards; letting them gather too would build the full model once per replica
    group (FSDP's ``rank0_only`` means rank 0 *of each shard group* under hybrid sharding).
    """
    if strategy._device_mesh is None:
        return list(range(strategy.world_size))
    # read from the mesh the model was wrapped with: a user's mesh need not hold consecutive ranks per row
    return shard_group_of(strategy._device_mesh, 0)


def _writer_group(strategy: "HybridShardFSDPStrategy") -> Optional[dist.ProcessGroup]:
    if strategy._device_mesh is None:
        return None
    return axis_group(strategy._device_mesh, SHARD_AXIS)


@contextmanager
def full_state_dict_context(model: torch.nn.Module, device: torch.device, rank0_only: bool = True) -> Generator[None, None, None]:
    """FSDP's full state-dict mode, offloading to CPU only from accelerators.

    On a CPU device FSDP's "offload" aliases the storage it frees right afterwards (a segfault), so it is off there.
    """
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.api import FullOptimStateDictConfig

    offload = device.type != "cpu"
    with FSDP.state_dict_type(
        module=model,
        state_dict_type=StateDictType.FULL_STATE_DICT,
        state_dict_config=FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
    ):
        yield


# ---------------------------------------------------------------------------------------------------- state dicts


def full_model_state(strategy: "HybridShardFSDPStrategy") -> dict[str, Any]:
    """The unsharded model state on global rank 0 (CPU tensors); an empty dict elsewhere. Call it on every rank."""
    model = _wrapped_model(strategy)
    if strategy.global_rank not in writer_ranks(strategy):
        return {}
    with full_state_dict_context(model, strategy.root_device):
        state = model.state_dict()
    if strategy.global_rank != 0:
        return {}
    return collections.OrderedDict((k, v.detach().cpu().clone()) for k, v in state.items())


def full_optimizer_state(strategy: "HybridShardFSDPStrategy", optimizer: Optimizer) -> dict[str, Any]:
    """The unsharded optimizer state on global rank 0 in torch's standard layout; empty elsewhere. Collective.

    State and ``param_groups`` are keyed by parameter index in the optimizer's own order, so a plain (unwrapped)
    optimizer of the same model loads it with ``optimizer.load_state_dict``.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    model = _wrapped_model(strategy)
    optimizer = _unwrap(optimizer)
    has_state = _any_rank_has_state(strategy, optimizer)
    if strategy.global_rank not in writer_ranks(strategy):
        return {}
    if not has_state:
        # nothing sharded to gather (plain SGD, or no step yet): the local dict is already the full one
        return optimizer.state_dict() if strategy.global_rank == 0 else {}
    with full_state_dict_context(model, strategy.root_device):
        state = FSDP.optim_state_dict(model, optimizer, group=_writer_group(strategy))
    if strategy.global_rank != 0:
        return {}
    # rekey by the optimizer's own parameter order (FSDP's default is model.parameters() order)
    return FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, model, optim=optimizer)


def module_state_dict(strategy: "HybridShardFSDPStrategy") -> dict[str, Any]:
    """What ``lightning_module_state_dict`` returns: full weights on rank 0, or this rank's DTensor shards."""
    if strategy._state_dict_type == FULL:
        return full_model_state(strategy)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(_wrapped_model(strategy))


def optimizer_state(strategy: "HybridShardFSDPStrategy", optimizer: Optimizer) -> dict[str, Any]:
    """What ``optimizer_state`` returns: the full state on rank 0, or this rank's shards keyed by parameter name."""
    if strategy._state_dict_type == FULL:
        return full_optimizer_state(strategy, optimizer)
    optimizer = _unwrap(optimizer)
    if not _any_rank_has_state(strategy, optimizer):
        # DCP's getter would run a zero step to create the state (Adam's step count would become 1): save as is
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(_wrapped_model(strategy), optimizer)


def _any_rank_has_state(strategy: "HybridShardFSDPStrategy", optimizer: Optimizer) -> bool:
    """Whether any rank's optimizer holds state. Decided together: a rank whose shard holds none of the optimizer's
    parameters has no state of its own (e.g. an optimizer over the head only), yet must join the collective."""
    return strategy.reduce_boolean_decision(bool(optimizer.state), all=False)


def _wrapped_model(strategy: "HybridShardFSDPStrategy") -> torch.nn.Module:
    if strategy.model is None:
        raise HybridShardConfigError(
            "HybridShardFSDPStrategy has no model yet: state dicts exist once the Trainer has set up the model"
            " (inside or after fit/validate/test/predict)."
        )
    return strategy.model


def _unwrap(optimizer: Any) -> Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)


# ---------------------------------------------------------------------------------------------------- saving


def save(strategy: "HybridShardFSDPStrategy", checkpoint: dict[str, Any], filepath: _PathLike,
         storage_options: Optional[Any] = None, kind: Optional[str] = None) -> None:
    """Write ``checkpoint`` (from Lightning's ``dump_checkpoint``) to ``filepath`` atomically. Call it on every rank.

    ``kind`` is ``"sharded"`` or ``"full"``; by default the strategy's ``state_dict_type``.

    Raises:
        HybridShardConfigError: ``filepath`` holds something else than a checkpoint of this run, or the checkpoint
            holds objects that could only be loaded by unpickling code.
    """
    if storage_options is not None:
        raise HybridShardConfigError(
            f"storage_options={storage_options!r} is not supported by HybridShardFSDPStrategy.save_checkpoint: it"
            " writes with torch.save / torch.distributed.checkpoint, not with a CheckpointIO. Fix: pass None."
        )
    path = Path(strategy.broadcast(os.fspath(filepath)))
    run_id = ensure_run_id(strategy)
    kind = kind or strategy._state_dict_type
    checkpoint = plain_checkpoint(checkpoint)  # what is written, and what the check below judges
    # decide on rank 0, fail on every rank alike, before anything is written
    problem = collision(path, run_id) if strategy.global_rank == 0 else None
    if problem is None and strategy.global_rank == 0:
        problem = _unsafe_entry({k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")})
    problem = strategy.broadcast(problem)
    if problem is not None:
        raise HybridShardConfigError(problem)

    checkpoint[RUN_KEY] = _record(strategy, run_id, kind)
    tmp = Path(strategy.broadcast(str(path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")))

    def write() -> None:
        if strategy.global_rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        strategy.barrier("lightning_smp.checkpoint.mkdir")
        if kind == SHARDED:
            _save_sharded(strategy, checkpoint, tmp)
        elif strategy.global_rank == 0:
            write_file(checkpoint, tmp)

    # every rank's files must be complete before the checkpoint becomes visible under its name
    _on_every_rank(strategy, write, path, tmp)
    _on_every_rank(strategy, lambda: commit(tmp, path) if strategy.global_rank == 0 else None, path, tmp)


def _on_every_rank(strategy: "HybridShardFSDPStrategy", step: Any, path: Path, tmp: Path) -> None:
    """Run ``step`` on every rank; if it failed on any rank (disk full, permissions...), remove the temporary
    files and raise the same error on every rank, instead of leaving the others waiting in the next collective."""
    failure: Optional[str] = None
    try:
        step()
    except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
        failure = f"rank {strategy.global_rank}: {type(err).__name__}: {err}"
    failures: list[Optional[str]] = [failure]
    if dist.is_available() and dist.is_initialized():
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    first = next((f for f in failures if f is not None), None)
    if first is None:
        return
    if strategy.global_rank == 0:
        _remove(tmp)
    raise RuntimeError(
        f"Saving the checkpoint {str(path)!r} failed on {first}. Nothing was written under that name; a previous"
        " checkpoint there is intact."
    )


def _save_sharded(strategy: "HybridShardFSDPStrategy", checkpoint: dict[str, Any], folder: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state: dict[str, Any] = {"model": checkpoint.pop("state_dict")}
    for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{idx}"] = optim_state
    folder.mkdir(parents=True, exist_ok=True)
    # a replicated chunk goes to the lowest rank holding it: replica group 0 writes, the other replicas write no tensor data (an empty file each)
    dcp.save(state, storage_writer=FileSystemWriter(folder, sync_files=True),
             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    if strategy.global_rank == 0:
        write_file(checkpoint, folder / META_FILENAME)


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
        _remove(tmp)  # the previous checkpoint now lives under the temporary name
    else:
        # no atomic exchange (not Linux, or a filesystem without it): a short window with the old one set aside
        aside = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:12]}")
        os.rename(dest, aside)
        os.rename(tmp, dest)
        _remove(aside)
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
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _remove(path: Path) -> None:
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


# ---------------------------------------------------------------------------------------------------- run identity


def ensure_run_id(strategy: "HybridShardFSDPStrategy") -> str:
    """This run's id (made on rank 0 at the first save and shared; taken over from a checkpoint on resume)."""
    run_id = getattr(strategy, "_checkpoint_run_id", None)
    if run_id is None:
        run_id = strategy.broadcast(uuid.uuid4().hex)
        strategy._checkpoint_run_id = run_id
    return run_id


def _record(strategy: "HybridShardFSDPStrategy", run_id: str, kind: str) -> dict[str, Any]:
    layout = strategy._layout
    record: dict[str, Any] = {"format_version": FORMAT_VERSION, "run_id": run_id, "state_dict_type": kind,
                              "world_size": strategy.world_size}
    if layout is not None:
        record.update(hybrid_shard_degree=layout.degree, replicate=layout.replicate, shard=layout.shard,
                      sharding_strategy=layout.sharding_strategy)
    return record


def run_id_of(path: Path) -> Optional[str]:
    """The id of the run that wrote the checkpoint at ``path``; None if it is none of ours or unreadable."""
    try:
        if path.is_dir():
            meta = path / META_FILENAME
            if not meta.is_file():
                return None
            record = torch.load(meta, map_location="cpu", weights_only=True).get(RUN_KEY)
        else:
            record = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get(RUN_KEY)
    except Exception:  # noqa: BLE001 - anything unreadable counts as "not ours"
        return None
    return record.get("run_id") if isinstance(record, dict) else None


def collision(path: Path, run_id: str) -> Optional[str]:
    """Why ``path`` must not be overwritten by run ``run_id``, or None if it is free or this run's own checkpoint."""
    if not os.path.lexists(path):
        return None
    owner = run_id_of(path)
    if owner == run_id:
        return None
    what = f"a checkpoint of another run (run id {owner})" if owner else "something that is not a checkpoint of this run"
    return (
        f"checkpoint path {str(path)!r} already holds {what}; refusing to overwrite it. Fix: save under another"
        " name or dirpath (ModelCheckpoint adds -v1, -v2 ... unless enable_version_counter=False), delete it"
        " yourself, or continue that run with trainer.fit(..., ckpt_path=...)."
    )


# ---------------------------------------------------------------------------------------------------- plain values


_PLAIN_LEAVES = (Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)
# what the hyperparameters' type is stored under (Lightning stores the class of OmegaConf hyperparameters there)
_HPARAMS_TYPE_KEYS = ("hparams_type", "datamodule_hparams_type")


def _unsafe_entry(obj: Any, where: str = "checkpoint") -> Optional[str]:
    """A message naming the first value that ``torch.load(weights_only=True)`` could not load back, else None.

    Judges the checkpoint as it is written, that is after :func:`plain_checkpoint`.
    """
    if isinstance(obj, _PLAIN_LEAVES):
        return None
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            if not isinstance(key, (str, int, float, bool, type(None), tuple)):
                return _unsafe_message(f"{where} key {key!r}", key)
            problem = _unsafe_entry(key, f"{where} key {key!r}") or _unsafe_entry(value, f"{where}[{key!r}]")
            if problem:
                return problem
        return None
    # exact types: a namedtuple or a frozenset is pickled by its class, which weights_only loading refuses
    if type(obj) in (list, tuple, set):
        for idx, value in enumerate(obj):
            problem = _unsafe_entry(value, f"{where}[{idx}]")
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


def hyperparameters_problem(model: Any, datamodule: Any = None) -> Optional[str]:
    """What the first checkpoint save would refuse among the hyperparameters of ``model`` and ``datamodule``, as
    Lightning's ``dump_checkpoint`` stores them; None when they can be saved. Checked at fit start."""
    part: dict[str, Any] = {}
    for obj in (model, datamodule):
        hparams = getattr(obj, "hparams", None) if obj is not None else None
        if hparams:
            part[obj.CHECKPOINT_HYPER_PARAMS_KEY] = hparams
    return _unsafe_entry(plain_checkpoint(part))


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


# ---------------------------------------------------------------------------------------------------- loading


def checkpoint_kind(path: Path) -> str:
    """``"sharded"`` for a DCP folder, ``"full"`` for a file; raises for anything else."""
    if path.is_dir() and ((path / ".metadata").is_file() or (path / META_FILENAME).is_file()):
        return SHARDED
    if path.is_file():
        return FULL
    raise HybridShardConfigError(
        f"ckpt_path={str(path)!r} is not a checkpoint: expected a file (full checkpoint) or a folder with a"
        " torch.distributed.checkpoint '.metadata' (sharded checkpoint). Fix: pass the path ModelCheckpoint or"
        " trainer.save_checkpoint wrote."
    )


def load(strategy: "HybridShardFSDPStrategy", checkpoint_path: _PathLike) -> dict[str, Any]:
    """Load a sharded or full checkpoint into the wrapped model (and its optimizers when fitting). Collective.

    Returns the rest of the checkpoint (loops, callbacks, schedulers, ...) for Lightning to restore. Works at any
    degree and world size, whatever wrote it.
    """
    from lightning.pytorch.trainer.states import TrainerFn

    path = Path(strategy.broadcast(os.fspath(checkpoint_path)))
    module = strategy.lightning_module
    assert strategy.model is not None and module is not None
    fitting = module.trainer.state.fn == TrainerFn.FITTING
    optimizers = [_unwrap(o) for o in strategy.optimizers] if fitting else []
    strict = module.strict_loading
    if checkpoint_kind(path) == SHARDED:
        checkpoint = _load_sharded(strategy, path, optimizers, strict)
    else:
        checkpoint = _load_full(strategy, path, optimizers, strict)
    record = checkpoint.get(RUN_KEY)
    if fitting and isinstance(record, dict) and record.get("run_id"):
        # resuming continues the run that wrote the checkpoint: its own files may be overwritten again
        strategy._checkpoint_run_id = record["run_id"]
    return checkpoint


def _model_shapes(strategy: "HybridShardFSDPStrategy") -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    assert strategy.model is not None
    return {k: tuple(v.shape) for k, v in get_model_state_dict(strategy.model).items() if isinstance(v, Tensor)}


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


def _mismatch(path: Path, model_name: str, key: str, reason: str) -> HybridShardConfigError:
    return HybridShardConfigError(
        f"checkpoint {str(path)!r} does not fit {model_name}: first mismatching key {key!r}: {reason}. Fix: load it"
        " into the model that wrote it, or set `strict_loading = False` on the LightningModule to skip missing"
        " or unexpected keys (shapes must still match)."
    )


def _load_full(strategy: "HybridShardFSDPStrategy", path: Path, optimizers: list[Optimizer], strict: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise HybridShardConfigError(f"ckpt_path={str(path)!r} is not a Lightning checkpoint: it has no 'state_dict'.")
    state = checkpoint.pop("state_dict")
    model = strategy.model
    assert model is not None
    check_model_fits(path, {k: tuple(v.shape) for k, v in state.items() if isinstance(v, Tensor)},
                     _model_shapes(strategy), strict, type(strategy.lightning_module).__name__)
    saved = checkpoint.get("optimizer_states")
    if optimizers:
        _check_optimizer_count(path, saved, optimizers)  # before anything is loaded
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))
    if optimizers:
        for optimizer, optim_state in zip(optimizers, saved or []):
            _load_full_optimizer(strategy, optimizer, optim_state)
    return dict(checkpoint)


def _load_full_optimizer(strategy: "HybridShardFSDPStrategy", optimizer: Optimizer, optim_state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    if not optim_state.get("state"):
        # no per-parameter state (plain SGD, or saved before a step): only the hyperparameters of each group
        _load_param_groups(optimizer, optim_state["param_groups"])
        return
    params = [p for g in optim_state["param_groups"] for p in g["params"]]
    if params and isinstance(params[0], int):
        optim_state = FSDP.rekey_optim_state_dict(optim_state, OptimStateKeyType.PARAM_NAME, strategy.model,
                                                  optim=optimizer)
    set_optimizer_state_dict(strategy.model, optimizer, optim_state,
                             options=StateDictOptions(full_state_dict=True))


def _load_param_groups(optimizer: Optimizer, saved_groups: list[dict[str, Any]]) -> None:
    local = optimizer.state_dict()["param_groups"]
    if len(local) != len(saved_groups):
        raise HybridShardConfigError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter group(s), this one has {len(local)}."
            " Fix: configure the optimizer as in the run that wrote the checkpoint."
        )
    optimizer.load_state_dict({"state": {}, "param_groups": [{**s, "params": g["params"]} for s, g in zip(saved_groups, local)]})


def _check_optimizer_count(path: Path, saved: Optional[list[Any]], optimizers: list[Optimizer]) -> None:
    if saved is None or len(saved) != len(optimizers):
        have = "no optimizer state" if saved is None else f"{len(saved)} optimizer state(s)"
        raise HybridShardConfigError(
            f"checkpoint {str(path)!r} holds {have} but {len(optimizers)} optimizer(s) are configured, so training"
            " cannot resume exactly. Fix: resume with the same optimizers, or load the weights only"
            " (trainer.validate/test/predict(ckpt_path=...), or a checkpoint saved with weights_only=False)."
        )


def _load_sharded(strategy: "HybridShardFSDPStrategy", path: Path, optimizers: list[Optimizer], strict: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = strategy.model
    assert model is not None
    reader = SafeFileSystemReader(path)
    keys = reader.read_metadata().state_dict_metadata
    saved = {k[len("model."):]: tuple(v.size) for k, v in keys.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    model_state = get_model_state_dict(model)
    expected = {k: tuple(v.shape) for k, v in model_state.items() if isinstance(v, Tensor)}
    check_model_fits(path, saved, expected, strict, type(strategy.lightning_module).__name__)
    if not strict:
        model_state = {k: v for k, v in model_state.items() if k in saved}

    state: dict[str, Any] = {"model": model_state}
    if optimizers:
        count = len({k.split(".", 1)[0] for k in keys if k.startswith("optimizer_")})
        _check_optimizer_count(path, [None] * count if count else None, optimizers)
        for idx, optimizer in enumerate(optimizers):
            if any(k.startswith(f"optimizer_{idx}.state.") for k in keys):
                # the template holds this layout's shards; DCP reads whichever saved chunks overlap them
                state[f"optimizer_{idx}"] = get_optimizer_state_dict(model, optimizer)
            else:
                # saved without per-parameter state: DCP needs the same structure to read the groups back into
                state[f"optimizer_{idx}"] = {"param_groups": optimizer.state_dict()["param_groups"]}
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(allow_partial_load=not strict))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
    for idx, optimizer in enumerate(optimizers):
        optim_state = state[f"optimizer_{idx}"]
        if "state" in optim_state:
            set_optimizer_state_dict(model, optimizer, optim_state)
        else:
            _load_param_groups(optimizer, optim_state["param_groups"])

    meta = path / META_FILENAME
    return dict(torch.load(meta, map_location="cpu", weights_only=True)) if meta.is_file() else {}


# ---------------------------------------------------------------------------------------------------- safe DCP reading


def _safe_dcp_classes() -> dict[tuple[str, str], Any]:
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md

    allowed: dict[tuple[str, str], Any] = {
        (md.__name__, name): getattr(md, name) for name in dir(md) if isinstance(getattr(md, name), type)
    }
    allowed[(fs.__name__, "_StorageInfo")] = fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    allowed.update({("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice})
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only its own record types, torch sizes, dtypes and paths."""

    _allowed: Optional[dict[tuple[str, str], Any]] = None

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


def _reader_base() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader


class SafeFileSystemReader(_reader_base()):  # type: ignore[misc]
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


def _planner_bases() -> tuple[type, type]:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner

    return DefaultLoadPlanner, _EmptyStateDictLoadPlanner


class SafeLoadPlanner(_planner_bases()[0]):  # type: ignore[misc]
    """DCP's default load planner, but non-tensor values are loaded with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        _safe_load_bytes(self, read_item, value)


class _SafeEmptyLoadPlanner(_planner_bases()[1]):  # type: ignore[misc]
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        _safe_load_bytes(self, read_item, value)


# ---------------------------------------------------------------------------------------------------- consolidation


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


def read_full(path: _PathLike) -> dict[str, Any]:
    """The full checkpoint at ``path`` as a dict of CPU tensors, in one process: a full file as it is, a sharded
    folder assembled (what ``state_dict_type="full"`` would have written). Loads with ``weights_only=True``."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    if checkpoint_kind(path) == FULL:
        return torch.load(path, map_location="cpu", weights_only=True)
    state: dict[str, Any] = {}
    # the private loader, as Lightning's utility and torch's dcp_to_torch_save use: the public one keeps only the
    # keys of a template, and here the template is empty
    _load_state_dict(state, storage_reader=SafeFileSystemReader(path), planner=_SafeEmptyLoadPlanner(), no_dist=True)
    meta = path / META_FILENAME
    checkpoint: dict[str, Any] = dict(torch.load(meta, map_location="cpu", weights_only=True)) if meta.is_file() else {}
    checkpoint["state_dict"] = collections.OrderedDict(state.pop("model"))
    count = len([k for k in state if k.startswith("optimizer_")])
    if count:
        checkpoint["optimizer_states"] = [optimizer_state_by_index(state[f"optimizer_{i}"]) for i in range(count)]
    record = dict(checkpoint.get(RUN_KEY) or {})
    record["state_dict_type"] = FULL
    checkpoint[RUN_KEY] = record
    return checkpoint


def consolidate(src: _PathLike, dst: _PathLike) -> Path:
    """Turn the sharded checkpoint folder ``src`` into the full checkpoint file ``dst``; runs in one process.

    The result equals what ``state_dict_type="full"`` would have written. ``dst`` must not exist.
    """
    src, dst = Path(src), Path(dst)
    if checkpoint_kind(src) != SHARDED:
        raise HybridShardConfigError(f"src={str(src)!r} is not a sharded checkpoint folder.")
    if os.path.lexists(dst):
        raise HybridShardConfigError(f"dst={str(dst)!r} exists; refusing to overwrite it. Fix: choose a new name.")
    checkpoint = read_full(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:12]}")
    write_file(checkpoint, tmp)
    commit(tmp, dst)
    return dst


def load_from_checkpoint(cls: type[T], path: _PathLike, **kwargs: Any) -> T:
    """``cls.load_from_checkpoint(path, **kwargs)`` for a checkpoint of either kind, in one process (no GPU needed).

    ``cls`` is a ``LightningModule`` or ``LightningDataModule`` class; ``kwargs`` are those of Lightning's
    ``load_from_checkpoint`` (``map_location``, ``strict``, hyperparameter overrides). A sharded folder is assembled
    in memory first, which holds the model twice for a moment; for a large model write one file with
    ``python -m lightning_smp.checkpoint consolidate`` instead.
    """
    path = Path(path)
    if checkpoint_kind(path) == FULL:
        return cls.load_from_checkpoint(path, **kwargs)  # type: ignore[attr-defined]
    buffer = io.BytesIO()
    torch.save(read_full(path), buffer)
    buffer.seek(0)
    kwargs.setdefault("weights_only", True)
    return cls.load_from_checkpoint(buffer, **kwargs)  # type: ignore[attr-defined]


def main(argv: Optional[Iterable[str]] = None) -> int:
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
    except HybridShardConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote full checkpoint {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
