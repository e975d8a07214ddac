"""The value of an SMP config: :class:`SMPConfig` (SMP v2's keys, those implemented here with SMP's defaults), the
rule of every key (its type, when it is an error, the fix) and :func:`check_config`, which applies them to one
source's dict. Where the dicts come from and how they merge: :mod:`lightning_smp.config.sources`.

An implemented key is declared once, as a field of :class:`SMPConfig` made by :func:`smp_key`: its type, its default
when no source sets it, its check and its documentation. Every configuration source reads it from there, and both
strategies take it as an argument (:mod:`lightning_smp.config.options`)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Literal, get_type_hints

from lightning_smp.config.fault_tolerance import FaultTolerance, check_fault_tolerance
from lightning_smp.config.mapping import did_you_mean, keys_in_words
from lightning_smp.config.replica_sync import ReplicaSync, check_replica_sync
from lightning_smp.degree import check_degree_setting
from lightning_smp.errors import HybridShardConfigError, UnsupportedOptionError
from lightning_smp.links import links_for
from lightning_smp.names import ACTS_IN, FRONT_ENDS, FSDP_VERSIONS, ActsIn, FrontEndName
from lightning_smp.sizes import parse_bytes


def check_memory_budget(value: Any, parameter: str = "memory_budget") -> int | None:
    """``value`` in bytes (``None`` stays ``None``: the device's free memory is used)."""
    return None if value is None else parse_bytes(value, parameter)


#: The ``links`` value that measures the links on the running job.
CALIBRATE = "calibrate"


def check_links(value: Any, parameter: str = "links") -> str | None:
    """``value`` if the planner can time on it: ``None``, :data:`CALIBRATE`, a link preset's name or a readable JSON
    file of ``Links``."""
    if value is None or value == CALIBRATE:
        return value
    if not isinstance(value, str):
        raise HybridShardConfigError(
            f"{parameter}={value!r} ({_type_name(value)}) is not a link preset, a JSON file or {CALIBRATE!r}. Fix:"
            f" pass one of those as a string."
        )
    try:
        links_for(value)
    except HybridShardConfigError as err:
        raise HybridShardConfigError(f"{parameter}={value!r}: {err} Or {CALIBRATE!r}.") from None
    return value


#: What each ``fsdp_version`` selects: the library's engines, and those registered
#: (:func:`lightning_smp.engines.register` adds them here, so that every configuration source takes their version).
FSDP_VERSION_ENGINES: dict[int, str] = dict(zip(FSDP_VERSIONS, ("FullyShardedDataParallel", "fully_shard")))


def check_fsdp_version(value: Any, parameter: str = "fsdp_version") -> int:
    """``value`` as an ``int`` if it names an engine (:data:`FSDP_VERSION_ENGINES`): 1 (``FullyShardedDataParallel``),
    2 (``fully_shard``), or a registered engine's."""
    versions = FSDP_VERSION_ENGINES
    if isinstance(value, bool) or not isinstance(value, int) or value not in versions:
        raise HybridShardConfigError(
            f"{parameter}={value!r} is not an FSDP version. Valid values: {', '.join(map(str, versions))}"
            f" ({', '.join(f'{version}: {runs}' for version, runs in versions.items())})."
            f" Fix: pass {' or '.join(map(str, versions))}."
        )
    return int(value)


def check_boolean(value: Any, parameter: str) -> bool:
    """``value`` if it is a boolean (a string such as ``"yes"`` is refused: it would be truthy whatever it says): the
    check of every boolean option, named ``parameter``."""
    if not isinstance(value, bool):
        raise HybridShardConfigError(
            f"{parameter}={value!r} ({_type_name(value)}) is not a boolean. Fix: pass True or False (true or false"
            " in YAML)."
        )
    return value


def checked_check(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    """An option's check, which is called with the value and the option's name (a developer's mistake otherwise,
    found on import)."""
    try:
        inspect.signature(check).bind(None, "name")
    except TypeError:
        raise RuntimeError(f"lightning_smp.config: the check {check!r} must take (value, name).") from None
    return check


def checked_names(parameter: str, names: tuple[str, ...], allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A declaration's ``acts_in`` or ``front_ends``: a tuple of one or more of ``allowed`` (a developer's mistake
    otherwise, found on import)."""
    if not names or isinstance(names, str) or not set(names) <= set(allowed):
        raise RuntimeError(f"lightning_smp.config: {parameter}={names!r} must be a tuple of one or more of {allowed}.")
    return names


def smp_key(default: Any, *, check: Callable[[Any, str], Any], doc: str, acts_in: tuple[ActsIn, ...],
            parsed_as: Any = None, front_ends: tuple[FrontEndName, ...] = FRONT_ENDS) -> Any:
    """A field of :class:`SMPConfig` that this library implements: ``default`` when no source sets it, ``check``
    (returns the value normalised, raises :class:`HybridShardConfigError` naming the key), ``doc`` (what its values
    mean, for the strategies' and the CLI's documentation), ``acts_in`` (where it acts:
    :data:`~lightning_smp.names.ActsIn`), ``parsed_as`` (a narrower type for the command line's parser than the
    field's, which OmegaConf must be able to merge), ``front_ends`` (those that act on it; the others refuse a value
    other than the default: :func:`unacted`)."""
    return field(default=default, metadata={"check": checked_check(check), "doc": doc,
                                            "acts_in": checked_names("acts_in", acts_in, ACTS_IN),
                                            "parsed_as": parsed_as,
                                            "front_ends": checked_names("front_ends", front_ends, FRONT_ENDS)})


@dataclass
class SMPConfig:
    """SMP v2's configuration keys: those this library implements with SMP's defaults, the others ``None`` (not set).

    A key this library does not implement may only hold a value that changes nothing (``tensor_parallel_degree: 1``,
    with a warning); any other value is refused by :func:`check_config`, so a resolved config never holds one. What
    each key means: :data:`KEY_DOCS` (each implemented key's declaration, and the rules of the others).
    """

    hybrid_shard_degree: int | str = smp_key(
        0, check=check_degree_setting, acts_in=("layout", "planner"), parsed_as=int | Literal["auto"],
        doc="``0`` (native FSDP: ``HYBRID_SHARD`` shards inside a node, ``FULL_SHARD`` over all ranks), ``1`` (no"
            " sharding: full replicas kept in sync like DDP), any divisor ``d >= 2`` of the world size (shard groups of"
            " ``d`` consecutive ranks, ``world_size / d`` replicas), or ``\"auto\"``: the planner chooses, when the"
            " model is set up, the degree with the least predicted step time whose per-rank peak fits"
            " ``memory_budget`` (see ``docs/planner.md``; the strategy's ``degree_plan`` holds its table).")
    fsdp_version: int = smp_key(
        1, check=check_fsdp_version, acts_in=("layout",),
        doc="this library's key (SMP has none): ``1`` (``FullyShardedDataParallel``, drop-in for ``FSDPStrategy``)"
            " or ``2`` (``fully_shard``: per-parameter DTensor shards, and gradient accumulation that keeps gradients"
            " sharded). A layout that shards nothing runs on the DDP engine whichever it is. See ``docs/engines.md``.")
    memory_budget: int | str | None = smp_key(
        None, check=check_memory_budget, acts_in=("planner",),
        doc="this library's key: with ``hybrid_shard_degree=\"auto\"``, what one rank's training may use, in bytes"
            " or as a string (``\"40GB\"``, ``\"400MB\"``); unset: the device's free memory (on the CPU the"
            " available RAM divided by the ranks of the node).")
    links: str | None = smp_key(
        None, check=check_links, acts_in=("planner",),
        doc="this library's key: with ``hybrid_shard_degree=\"auto\"``, what the planner times the step on: a link"
            " preset's name (``lightning_smp.planner.LINK_PRESETS``), a JSON file of ``Links``"
            " (``lightning_smp.planner.save_links``), or ``\"calibrate\"``: measured on this job's own process"
            " groups when the model is set up (a few seconds, every rank alike); unset: the default preset.")
    async_save: bool = smp_key(
        False, check=check_boolean, acts_in=("checkpoint",), front_ends=("trainer", "fabric"),
        doc="this library's key: ``True`` writes sharded checkpoints in the background: every ``save_checkpoint``"
            " (``ModelCheckpoint``'s included) returns once the state is copied off the training tensors, the"
            " checkpoint is committed by rename once every rank has written, ``ModelCheckpoint``'s ``last`` link, its"
            " removals and the loggers wait for that commit, and a failed write raises on every rank at the next"
            " training step (see ``docs/checkpoints.md``). Needs ``state_dict_type=\"sharded\"``.")
    fault_tolerance: dict[str, Any] | None = smp_key(
        None, check=check_fault_tolerance, acts_in=("front_ends",), front_ends=("trainer", "fabric"),
        doc="this library's key: replica groups that survive a node (torchft): a mapping with"
            f" {keys_in_words(FaultTolerance)} (:class:`lightning_smp.config.fault_tolerance.FaultTolerance`:"
            " ``lighthouse`` is ``host:port``, ``group`` this group's id, ``groups`` how many); each group of ``hybrid_shard_degree`` ranks is its own job. torchft's"
            " ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID`` and ``NUM_REPLICA_GROUPS`` set it too. Needs the"
            " ``ft`` extra (``pip install lightning-smp[ft]``). See ``docs/fault-tolerance.md``.")
    replica_sync: dict[str, Any] | None = smp_key(
        None, check=check_replica_sync, acts_in=("layout", "front_ends", "checkpoint"), front_ends=("trainer", "fabric"),
        doc="this library's key: semi-synchronous replica groups (DiLoCo): each replica group trains on its own and"
            " the groups sync every ``every`` optimizer steps through an outer optimizer; nothing crosses the groups"
            f" in between. A mapping with {keys_in_words(ReplicaSync)}"
            " (:class:`lightning_smp.config.replica_sync.ReplicaSync`). Runs on FSDP2 where the layout"
            " shards and on the DDP engine for groups of one rank, with at least two replica groups. See"
            " ``docs/replica-sync.md``.")
    tensor_parallel_degree: int | None = None
    context_parallel_degree: int | None = None
    expert_parallel_degree: int | None = None
    sm_activation_offloading: bool | None = None
    activation_loading_horizon: int | None = None
    fsdp_cache_flush_warnings: bool | None = None
    allow_empty_shards: bool | None = None
    random_seed: int | None = None


def _named(check: Callable[[Any, str], Any], name: str) -> Callable[[Any], Any]:
    """``check`` of the key ``name``, taking the value alone (as the configuration sources call it)."""
    return lambda value: check(value, name)


#: The implemented keys (those declared with :func:`smp_key`), in declaration order.
IMPLEMENTED = tuple(f for f in fields(SMPConfig) if "check" in f.metadata)
#: The implemented keys and their checks (return the normalised value; raise ``HybridShardConfigError`` naming the
#: key).
IMPLEMENTED_KEYS: dict[str, Callable[[Any], Any]] = {f.name: _named(f.metadata["check"], f.name) for f in IMPLEMENTED}


def _optional_fields(cls: type, name: str, doc: str) -> type:
    """``cls`` with every field optional and ``None`` by default: a section in which a key left out is not set, each
    field of the type the command line parses (OmegaConf, which merges :class:`SMPConfig`, knows no ``Literal``)."""
    hints = get_type_hints(cls)
    section = make_dataclass(name, [(f.name, (f.metadata.get("parsed_as") or hints[f.name]) | None, None)
                                    for f in fields(cls)])
    section.__doc__ = doc
    section.__module__ = __name__
    return section


#: The type of the LightningCLI ``smp:`` section: :class:`SMPConfig`'s keys and types, each optional, so that
#: jsonargparse checks names and types and a key left out is taken from the lower sources.


@dataclass(frozen=True)
class _Unimplemented:
    """An SMP v2 key this library does not implement: its type, and when a value would change training."""

    kind: type
    changes_training: Callable[[Any], bool]
    why: str
    fix: str
    minimum: int = 0
    #: how to silence the warning for a harmless value
    silence: str = "remove it"


_NO_TP = "this library implements SMP's sharded data parallelism only (no tensor, context or expert parallelism)"

#: Every other key of SMP v2's core-feature config, and what happens when it is given.
UNIMPLEMENTED_KEYS: dict[str, _Unimplemented] = {
    "tensor_parallel_degree": _Unimplemented(
        int, lambda v: v > 1, _NO_TP, "remove it or set it to 1 (use SMP itself for tensor parallelism)", minimum=1
    ),
    "context_parallel_degree": _Unimplemented(
        int, lambda v: v > 1, _NO_TP, "remove it or set it to 1 (use SMP itself for context parallelism)", minimum=1
    ),
    "expert_parallel_degree": _Unimplemented(
        int, lambda v: v > 1, _NO_TP, "remove it or set it to 1 (use SMP itself for expert parallelism)", minimum=1
    ),
    "sm_activation_offloading": _Unimplemented(
        bool,
        lambda v: v,
        "SMP's activation offloading is not implemented, so activations would stay in device memory",
        "remove it, or use activation_checkpointing_policy of HybridShardFSDPStrategy to save activation memory",
    ),
    "activation_loading_horizon": _Unimplemented(
        int, lambda v: False, "it only tunes SMP's activation offloading, which is not implemented", "remove it",
        minimum=1,
    ),
    "fsdp_cache_flush_warnings": _Unimplemented(
        bool, lambda v: False, "SMP's CUDA cache-flush warnings are not implemented", "remove it"
    ),
    "allow_empty_shards": _Unimplemented(
        bool, lambda v: False, "FSDP1 pads flat parameters, so shards are never empty", "remove it"
    ),
    "random_seed": _Unimplemented(
        int,
        lambda v: False,
        "it seeds SMP's tensor/expert-parallel modules, which do not exist here",
        "remove it",
        silence="remove it and seed with lightning.seed_everything() instead",
    ),
}

KNOWN_KEYS = (*IMPLEMENTED_KEYS, *UNIMPLEMENTED_KEYS)


def check_key_lists(implemented: Collection[str], unimplemented: Collection[str], declared: Collection[str]) -> None:
    """One list of keys: every field of ``SMPConfig`` (``declared``) is implemented or has the rule of a key that is
    not, never both (its help would then say "not implemented"), and nothing else has a rule. A developer's mistake,
    found on import."""
    both = sorted(set(implemented) & set(unimplemented))
    if both:
        raise RuntimeError(f"lightning_smp.config: {', '.join(both)} both implemented (smp_key) and in"
                           " UNIMPLEMENTED_KEYS. Fix: remove its UNIMPLEMENTED_KEYS rule.")
    ruled, fields_ = set(implemented) | set(unimplemented), set(declared)
    if ruled != fields_:
        raise RuntimeError(f"lightning_smp.config: SMPConfig's fields and the key rules differ: fields without a rule"
                           f" {sorted(fields_ - ruled)}, rules without a field {sorted(ruled - fields_)}.")


check_key_lists(IMPLEMENTED_KEYS, UNIMPLEMENTED_KEYS, [f.name for f in fields(SMPConfig)])


def _key_docs() -> dict[str, str]:
    docs = {f.name: f"{f.metadata['doc']} Unset: ``{f.default!r}``." for f in IMPLEMENTED}
    for key, rule in UNIMPLEMENTED_KEYS.items():
        docs[key] = (f"SMP's key, not implemented here ({rule.why}): a value that changes nothing is ignored with a"
                     " warning, any other is refused.")
    return docs


#: What every key means, for the CLI's help and the documentation.
KEY_DOCS: dict[str, str] = _key_docs()

#: The type of the LightningCLI ``smp:`` section: :class:`SMPConfig`'s keys and types, each optional, so that
#: jsonargparse checks names and types and a key left out is taken from the lower sources.
SMPSection = _optional_fields(
    SMPConfig, "SMPSection",
    "SMP v2 config keys for the LightningCLI `smp:` section; a key left out is not set here.\n\nAttributes:\n"
    + "".join(f"    {key}: {doc}\n" for key, doc in KEY_DOCS.items()),
)


#: The front ends that act on each implemented key (its declaration's ``front_ends``).
ACTING_FRONT_ENDS: dict[str, tuple[FrontEndName, ...]] = {f.name: f.metadata["front_ends"] for f in IMPLEMENTED}


def unacted(config: SMPConfig, front_end: FrontEndName) -> list[str]:
    """The implemented keys ``config`` sets (other than their default) that ``front_end`` does not act on."""
    return [f.name for f in IMPLEMENTED
            if front_end not in ACTING_FRONT_ENDS[f.name] and getattr(config, f.name) != f.default]


def refuse_unacted(config: SMPConfig, keys: Collection[str], what: str) -> None:
    """Refuse ``keys`` of ``config`` (:func:`unacted`: set, and not acted on by the front end doing ``what``), naming
    each and the front ends that act on it: :class:`~lightning_smp.errors.UnsupportedOptionError`."""
    if not keys:
        return
    acting = {key: " and ".join(FRONT_END_NAMES[end] for end in ACTING_FRONT_ENDS[key]) for key in keys}
    raise UnsupportedOptionError(
        f"{', '.join(f'{key}={getattr(config, key)!r}' for key in keys)} is set in the configuration, but {what}"
        f" cannot act on it: {'; '.join(f'{key} acts in {ends}' for key, ends in acting.items())}. Fix: train with"
        f" one of those, or remove {', '.join(keys)} from the configuration (the arguments, the CLI's smp: section,"
        " init(config), LIGHTNING_SMP_CONFIG, SM_HP_MP_PARAMETERS)."
    )


#: Each front end as messages name it.
FRONT_END_NAMES: dict[FrontEndName, str] = {"trainer": "the Trainer's HybridShardFSDPStrategy",
                                    "fabric": "Fabric's HybridShardFSDPStrategy", "init": "lightning_smp.init()"}


def _type_name(value: Any) -> str:
    return "boolean" if isinstance(value, bool) else type(value).__name__


def _check_unimplemented(key: str, value: Any, where: str) -> None:
    rule = UNIMPLEMENTED_KEYS[key]
    if rule.kind is bool:
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= rule.minimum
    if not ok:
        expected = "true or false" if rule.kind is bool else f"an integer >= {rule.minimum}"
        raise HybridShardConfigError(
            f"{where}: {key}={value!r} ({_type_name(value)}) is not valid; SMP expects {expected}."
        )
    if rule.changes_training(value):
        raise HybridShardConfigError(
            f"{where}: {key}={value!r} is not supported: {rule.why}. Fix: {rule.fix}."
        )
    warnings.warn(f"{where}: {key}={value!r} is ignored: {rule.why}. To silence this warning: {rule.silence}.",
                  UserWarning, stacklevel=3)


def check_config(values: Any, where: str) -> dict[str, Any]:
    """Check an SMP config dict from ``where``; return only the keys this library implements.

    Raises:
        HybridShardConfigError: not a mapping, an unknown key (with a "did you mean"), a wrong type, or an
            SMP feature whose value would change training. Harmless unimplemented keys only warn.
    """
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise HybridShardConfigError(
            f"{where}: the SMP config must be a mapping such as {{\"hybrid_shard_degree\": 2}}, got"
            f" {_type_name(values)} {values!r}."
        )
    checked: dict[str, Any] = {}
    for key, value in values.items():
        if key in IMPLEMENTED_KEYS:
            try:
                checked[key] = IMPLEMENTED_KEYS[key](value)
            except HybridShardConfigError as err:
                raise HybridShardConfigError(f"{where}: {err}") from None
        elif key in UNIMPLEMENTED_KEYS:
            _check_unimplemented(key, value, where)
        else:
            raise HybridShardConfigError(
                f"{where}: unknown SMP config key {key!r}.{did_you_mean(key, KNOWN_KEYS)} Known keys:"
                f" {', '.join(KNOWN_KEYS)}."
            )
    return checked


__all__ = [
    "FSDP_VERSION_ENGINES",
    "CALIBRATE",
    "IMPLEMENTED",
    "IMPLEMENTED_KEYS",
    "KEY_DOCS",
    "KNOWN_KEYS",
    "UNIMPLEMENTED_KEYS",
    "SMPConfig",
    "SMPSection",
    "ACTING_FRONT_ENDS",
    "FRONT_END_NAMES",
    "check_boolean",
    "checked_check",
    "check_config",
    "check_key_lists",
    "checked_names",
    "refuse_unacted",
    "unacted",
    "check_fsdp_version",
    "check_links",
    "check_memory_budget",
    "smp_key",
]
