"""Sharded and full checkpoints of hybrid-sharded models, for every front end and engine.

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

The package, one concern a module: :mod:`.format` (what is on disk), :mod:`.state_dict` (full and sharded state
dicts of a :class:`ShardedModel`), :mod:`.saving` (atomic, run-owned saving), :mod:`.loading` (checked loading),
:mod:`.atomic` (file operations), :mod:`.safety` (plain values, safe DCP reading) and :mod:`.convert` (one-process
tools and the command line). Every function takes explicit inputs (the model, optimizers, a collectives handle, the
run identity), never a strategy.
"""

from lightning_smp.checkpoint.convert import consolidate, load_from_checkpoint, optimizer_state_by_index, read_full
from lightning_smp.checkpoint.format import (
    FABRIC_KEYS,
    FORMAT_VERSION,
    META_FILENAME,
    RUN_KEY,
    checkpoint_kind,
    fabric_layout,
    trainer_layout,
)
from lightning_smp.checkpoint.loading import check_model_fits, load, load_entries, read_record
from lightning_smp.checkpoint.safety import hyperparameters_problem, plain_checkpoint
from lightning_smp.checkpoint.saving import CheckpointRun, collision, run_id_of, save
from lightning_smp.checkpoint.state_dict import (
    ShardedModel,
    full_model_state,
    full_optimizer_state,
    module_state_dict,
    optimizer_state,
)
from lightning_smp.names import FULL, SHARDED, STATE_DICT_TYPES

__all__ = [
    "FABRIC_KEYS",
    "FORMAT_VERSION",
    "FULL",
    "META_FILENAME",
    "RUN_KEY",
    "SHARDED",
    "STATE_DICT_TYPES",
    "CheckpointRun",
    "ShardedModel",
    "check_model_fits",
    "checkpoint_kind",
    "collision",
    "consolidate",
    "fabric_layout",
    "full_model_state",
    "full_optimizer_state",
    "hyperparameters_problem",
    "load",
    "load_entries",
    "load_from_checkpoint",
    "module_state_dict",
    "optimizer_state",
    "optimizer_state_by_index",
    "plain_checkpoint",
    "read_full",
    "read_record",
    "run_id_of",
    "save",
    "trainer_layout",
]
