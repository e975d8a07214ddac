"""The package's exception types: one per kind of mistake, under one base class.

Each also subclasses the built-in type that Lightning's ``FSDPStrategy`` (or torch) raises for the same mistake, so
code written for ``FSDPStrategy`` keeps catching what it caught before.
"""


class LightningSMPError(Exception):
    """Base class of every error ``lightning_smp`` raises on purpose."""


class HybridShardConfigError(LightningSMPError, ValueError):
    """A configuration value that hybrid sharding cannot use.

    Every message names the parameter, the value it got and what would be valid. It subclasses ``ValueError`` so
    that code catching bad arguments the usual way keeps working.
    """


class UnsupportedOptionError(HybridShardConfigError, TypeError, NotImplementedError):
    """An argument of a kind the strategy does not take (e.g. ``storage_options``, a non-FSDP precision plugin,
    ``fabric.load_raw(path, optimizer)``).

    A ``TypeError`` and a ``NotImplementedError`` too: Lightning's ``FSDPStrategy`` raises the one or the other for
    the same calls (``TypeError`` for ``storage_options``, ``NotImplementedError`` for loading an optimizer alone).
    """


class CheckpointError(LightningSMPError, ValueError, RuntimeError):
    """A checkpoint that cannot be written or loaded as asked: another run's files at the path, something that is not
    a checkpoint, a model or optimizer that does not fit it, a save that failed on some rank.

    A ``ValueError`` (what this library raised for these before) and a ``RuntimeError`` (what Lightning and torch
    raise for a state dict or an optimizer count that does not fit).
    """


class CheckpointPathError(CheckpointError, IsADirectoryError):
    """A checkpoint path that is a folder holding something else than a checkpoint of this run; nothing is written
    there. An ``IsADirectoryError`` too, what Lightning's ``FSDPStrategy`` raises when a full save meets a folder."""


class GradientSyncError(LightningSMPError, RuntimeError):
    """An optimizer step about to run on gradients that are not DDP's: never reduced across replicas (gradient
    reduction left turned off by the last backward), missing for a parameter that took part, or (FSDP1 with
    ``use_orig_params=False``) present for a parameter no rank used. The step would silently do nothing, skip or move
    a parameter DDP would not, or let the replicas drift apart."""


class ShardedParameterError(LightningSMPError, RuntimeError):
    """A sharded parameter used where it holds only this rank's shard: read outside the forward of its FSDP unit (a
    penalty over ``self.parameters()`` in ``training_step``), or a scalar parameter FSDP cannot shard. The result
    would not be DDP's (a term over a fraction of the weights, a gradient never reduced), or torch fails deep inside
    without saying what the model did."""


class UnitOrderError(LightningSMPError, RuntimeError):
    """Ranks about to run different FSDP units (a module that only some ranks run is a unit of its own): their
    collectives would not match, and the run would hang or exchange the wrong parameters. Raised on every rank by the
    check that ``LIGHTNING_SMP_CHECK_UNIT_ORDER=1`` turns on."""



class FaultToleranceError(LightningSMPError, RuntimeError):
    """Fault-tolerant replica groups that cannot go on safely: a group that would start from its own initialisation
    while the job has trained before (no live peer to heal from, no checkpoint given), or a peer's state that does not
    fit this group's model. Raised on every rank of the group, before any step."""

__all__ = ["CheckpointError", "CheckpointPathError", "FaultToleranceError", "GradientSyncError", "HybridShardConfigError", "LightningSMPError",
           "ShardedParameterError", "UnitOrderError", "UnsupportedOptionError"]
