"""Every option of the library's strategies, declared once, and the one call both strategies build them with.

An option is one field: of :class:`StrategyOptions` when it configures this run's strategy only, or of
:class:`~lightning_smp.config.keys.SMPConfig` (made by :func:`~lightning_smp.config.keys.smp_key`) when any
configuration source may set it too (the CLI's ``smp:`` section, :func:`lightning_smp.init`, the environment). The
field holds the type, the default, the check and the documentation; from the two dataclasses come:

- :meth:`StrategyOptions.from_arguments`, the one call each strategy's constructor makes: every check that needs no
  world size and no process, the same on every rank;
- the constructors' option parameters as source and the documentation's tables, which ``python -m
  lightning_smp.generate`` writes (:mod:`lightning_smp.generate`: what static type checkers, IDEs and readers of
  ``docs/configuration.md`` read);
- :func:`signature_parameters` and :func:`arguments_doc`: each strategy's constructor signature and the part of its
  docstring that documents the options (what IDE help, ``help()``, notebooks and LightningCLI read; see
  :func:`lightning_smp.frontend.with_options`);
- the configuration sources' rules (:data:`~lightning_smp.config.keys.IMPLEMENTED_KEYS`) and the CLI's ``smp:``
  section (:data:`~lightning_smp.config.keys.SMPSection`).

A new option is one field here (or in ``SMPConfig``), then ``python -m lightning_smp.generate``; the code that acts on
it reads ``strategy.options.<name>`` (the argument) or ``strategy.config.<name>`` (an SMP key, resolved from every
source).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any, get_type_hints

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import ShardingStrategy

from lightning_smp.config.keys import (
    IMPLEMENTED,
    SMPConfig,
    check_boolean,
    check_config,
    checked_check,
    checked_names,
)
from lightning_smp.degree import check_sharding_strategy, reconcile_degree
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.names import (
    ACTS_IN,
    AUTO,
    GRADIENT_ACCUMULATIONS,
    SHARDED,
    START_METHODS,
    STATE_DICT_TYPES,
    ActsIn,
    GradientAccumulation,
    ShardingStrategyName,
    StartMethod,
    StateDictType,
)

#: Where the strategies' arguments come from, in the errors of the SMP keys.
ARGUMENT_SOURCE = "HybridShardFSDPStrategy(...)"


def check_state_dict_type(value: Any, parameter: str = "state_dict_type") -> StateDictType:
    for kind in STATE_DICT_TYPES:  # a loop, not `in`: mypy before 1.20 does not narrow by `in`
        if value == kind:
            return kind
    raise HybridShardConfigError(
        f"{parameter}={value!r} is not supported. Valid values: " + ", ".join(map(repr, STATE_DICT_TYPES)) + "."
    )


def check_gradient_accumulation(value: Any, parameter: str = "gradient_accumulation") -> GradientAccumulation | None:
    if value is None:
        return None
    for mode in GRADIENT_ACCUMULATIONS:
        if value == mode:
            return mode
    raise HybridShardConfigError(
        f"{parameter}={value!r} is not supported. Valid values: "
        + ", ".join(map(repr, GRADIENT_ACCUMULATIONS)) + "."
    )


def check_start_method_name(value: Any, parameter: str = "start_method") -> StartMethod | None:
    """A ``start_method`` argument: ``None`` (automatic) or one of :data:`~lightning_smp.names.START_METHODS`
    (whether the platform can start processes that way is checked when they start: :mod:`lightning_smp.forking`)."""
    if value is None:
        return None
    for method in START_METHODS:
        if value == method:
            return method
    raise HybridShardConfigError(
        f"{parameter}={value!r} is not supported. Valid values: None (automatic), "
        + ", ".join(repr(m) for m in START_METHODS) + "."
    )


def check_device_mesh(device_mesh: Any) -> tuple[DeviceMesh | None, int | None]:
    """Static checks of a ``device_mesh`` argument: returns (the user's mesh or None, the shard degree it implies).

    Accepts ``None``, a tuple ``(replicas, shard_degree)`` or a 2-D ``DeviceMesh`` whose shard groups hold more than
    one rank.
    """
    if device_mesh is None:
        return None, None
    if isinstance(device_mesh, (tuple, list)):
        if len(device_mesh) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in device_mesh):
            raise HybridShardConfigError(
                f"device_mesh={device_mesh!r} must be a tuple (replicas, shard_degree) of two positive integers."
                " Fix: e.g. device_mesh=(2, 4), or pass hybrid_shard_degree=4 instead."
            )
        return None, device_mesh[1]
    if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 2:
        raise HybridShardConfigError(
            f"device_mesh={device_mesh!r} must be a 2-D DeviceMesh (replicate, shard) or a tuple (replicas, shard_degree)."
        )
    if device_mesh.size(1) == 1:
        raise HybridShardConfigError(
            f"device_mesh of shape {tuple(device_mesh.shape)} has shard groups of one rank: FSDP would all-reduce over"
            " size-1 groups and replicas would never synchronise. Fix: pass hybrid_shard_degree=1 instead."
        )
    return device_mesh, device_mesh.size(1)


def process_group_degree(process_group: Any) -> int | None:
    """The shard degree of an FSDP ``process_group`` argument (a group, or a hybrid ``(intra, inter)`` pair)."""
    if process_group is None:
        return None
    intra = process_group[0] if isinstance(process_group, tuple) else process_group
    return intra.size()


def option(default: Any, *, check: Callable[[Any, str], Any], doc: str, acts_in: tuple[ActsIn, ...]) -> Any:
    """A field of :class:`StrategyOptions`: its default, its check (``check(value, name)`` returns the value
    normalised, raises :class:`HybridShardConfigError` naming the option: one check, such as
    :func:`~lightning_smp.config.keys.check_boolean`, serves every option of its kind), its documentation and where
    it acts
    (:data:`~lightning_smp.names.ActsIn`; ``"engines"``: a field of the same name in the engines' ``ShardingPlan``,
    which the core fills from :func:`engine_facing`)."""
    return field(default=default, metadata={"check": checked_check(check), "doc": doc,
                                            "acts_in": checked_names("acts_in", acts_in, ACTS_IN)})


ASYNC_FULL = (
    "async_save=True writes sharded checkpoints in the background, but state_dict_type={state_dict_type!r} assembles"
    " one full file on rank 0. Fix: use state_dict_type='sharded' (convert afterwards with python -m"
    " lightning_smp.checkpoint consolidate), or async_save=False."
)


@dataclass(frozen=True)
class StrategyOptions:
    """The strategies' own options, checked (:meth:`from_arguments`), and the SMP keys given as arguments (``smp``).

    Frozen: what the user asked for, never written to afterwards; what the run resolves from it (the configuration
    from every source, the layout, the engine) are new values (:class:`lightning_smp.core.Settled`).
    """

    sharding_strategy: ShardingStrategy | ShardingStrategyName = option(
        "HYBRID_SHARD", check=check_sharding_strategy, acts_in=("layout",),
        doc="``\"HYBRID_SHARD\"`` (default), ``\"_HYBRID_SHARD_ZERO2\"``, ``\"FULL_SHARD\"``, ``\"SHARD_GRAD_OP\"`` or"
            " ``\"NO_SHARD\"`` (any case), or a ``ShardingStrategy``. With ``hybrid_shard_degree >= 2`` anything but"
            " ``\"_HYBRID_SHARD_ZERO2\"`` becomes ``\"HYBRID_SHARD\"`` (a warning names both). A shard group that"
            " spans the whole world runs ``FULL_SHARD`` (``SHARD_GRAD_OP`` for ZeRO-2), which costs no all-reduce"
            " over size-1 replica groups.")
    state_dict_type: StateDictType = option(
        SHARDED, check=check_state_dict_type, acts_in=("checkpoint",),
        doc="``\"sharded\"`` (default) or ``\"full\"``. ``\"sharded\"``: a folder written by"
            " ``torch.distributed.checkpoint``, every rank writing its shard once (replica group 0 only), nothing"
            " gathered on one rank; the default because resuming is what checkpoints during training are for, and it"
            " resumes exactly at any degree and world size. ``\"full\"``: one file assembled once on rank 0, which"
            " also loads on a single device. Either loads whatever is configured; convert with"
            " ``python -m lightning_smp.checkpoint consolidate SRC DST`` (see :mod:`lightning_smp.checkpoint`).")
    device_mesh: tuple[int, int] | DeviceMesh | None = option(
        None, check=lambda value, _: tuple(value) if isinstance(value, list) else check_device_mesh(value) and value,
        acts_in=("layout",),
        doc="``None`` (default: built from ``hybrid_shard_degree``), a tuple ``(replicas, shard_degree)`` (same as"
            " ``hybrid_shard_degree=shard_degree``), or a 2-D ``DeviceMesh`` you built yourself (used as is; its"
            " second dimension is the shard group). Contradicting ``hybrid_shard_degree`` is an error.")
    start_method: StartMethod | None = option(
        None, check=check_start_method_name, acts_in=("front_ends",),
        doc="how processes are started. ``None`` (default): ``\"fork\"`` in an interactive session (Jupyter,"
            " IPython), else ``\"popen\"`` (re-run the script per rank, like Lightning's FSDP). Also ``\"fork\"``,"
            " ``\"spawn\"`` or ``\"forkserver\"`` (Lightning's multiprocessing launcher). Processes started externally"
            " (``torchrun``, SLURM) are always used as they are. With fork/spawn, the process that calls ``fit`` gets"
            " the trained weights, loop counters, metrics and callback reports back, and its"
            " ``trainer.save_checkpoint`` writes one full checkpoint file; such a Trainer fits once (use a new one)."
            " See :mod:`lightning_smp.launcher`.")
    gradient_accumulation: GradientAccumulation | None = option(
        None, check=check_gradient_accumulation, acts_in=("front_ends", "planner"),
        doc="what the micro-batches before the last of an optimizer step communicate (each mode:"
            " :mod:`lightning_smp.accumulation`): ``None`` (default: the engine's own default), ``\"no_sync\"``"
            " (FSDP1's default, Lightning's behaviour: nothing, but every rank holds the full unsharded gradient),"
            " ``\"every_micro_batch\"`` (full reduction each: sharded gradients, ``k`` times the traffic) or"
            " ``\"defer_all_reduce\"`` (FSDP2's default: reduce-scatter inside the shard group each, the cross-replica"
            " all-reduce once on the last; sharded gradients and one crossing of the replicas per step).")
    broadcast_buffers: bool = option(
        True, check=check_boolean, acts_in=("engines",),
        doc="``True`` (default, DDP's): every rank gets global rank 0's buffers (BatchNorm's running statistics)"
            " before a forward that follows a training forward outside an accumulation window, as DDP's ranks do;"
            " ``False``: each rank keeps its own, as FSDP does. See ``docs/engines.md``.")
    #: the SMP keys given as arguments, checked (those left ``None`` are not set here): the highest configuration
    #: source (:mod:`lightning_smp.config`)
    smp: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], engine_options: Mapping[str, Any]) -> StrategyOptions:
        """Check every option in ``arguments`` (a strategy's keyword arguments: its options and the SMP keys) that
        needs no world size and no process, and how they fit together and with the engine arguments
        (``engine_options``: ``process_group`` fixes the shard group as ``device_mesh`` does); raise
        :class:`HybridShardConfigError` naming the option, the value and the fix, the same on every rank."""
        own = {f.name: f.metadata["check"](arguments.get(f.name, f.default), f.name) for f in option_fields(cls)}
        smp = check_config({key: value for key, value in arguments.items()
                            if key in SMP_ARGUMENTS and value is not None}, ARGUMENT_SOURCE)
        options = cls(**own, smp=smp)
        if smp.get("async_save") and options.state_dict_type != SHARDED:
            raise HybridShardConfigError(ASYNC_FULL.format(state_dict_type=options.state_dict_type))
        _, mesh_degree = check_device_mesh(options.device_mesh)
        process_group = engine_options.get("process_group")
        if options.device_mesh is not None and process_group is not None:
            raise HybridShardConfigError(
                "device_mesh and process_group were both given; they are mutually exclusive. Fix: pass only one."
            )
        fixed = "device_mesh" if options.device_mesh is not None else "process_group" if process_group else None
        degree = smp.get("hybrid_shard_degree")
        if degree == AUTO:
            if fixed:
                raise HybridShardConfigError(
                    f"hybrid_shard_degree='auto' and {fixed} were both given: a {fixed} fixes the shard group, so"
                    f" there is nothing to choose. Fix: drop {fixed}, or pass the degree it implies."
                )
            return options
        implied = reconcile_degree("device_mesh", mesh_degree, degree)
        implied = reconcile_degree("process_group", process_group_degree(process_group), implied)
        if implied is not None and implied != degree:
            # the degree the mesh or the process group fixes is the argument's, above every other source
            options = cls(**own, smp={**smp, "hybrid_shard_degree": implied})
        return options

    @property
    def user_mesh(self) -> DeviceMesh | None:
        """A ``DeviceMesh`` the user passed (used as is)."""
        return self.device_mesh if isinstance(self.device_mesh, DeviceMesh) else None

    @property
    def mesh_shape(self) -> tuple[int, ...] | None:
        """The shape ``device_mesh`` gives: the user's mesh's, or the tuple passed; ``None`` without one."""
        if isinstance(self.device_mesh, DeviceMesh):
            return tuple(self.device_mesh.shape)
        return tuple(self.device_mesh) if self.device_mesh is not None else None

    @property
    def sharding_strategy_name(self) -> ShardingStrategyName:
        """The sharding strategy asked for, by name."""
        return check_sharding_strategy(self.sharding_strategy)


def option_fields(record: type[StrategyOptions] = StrategyOptions) -> tuple[Field, ...]:
    """The fields of ``record`` (:class:`StrategyOptions`, or a subclass that adds options) that are options (all but
    ``smp``)."""
    return tuple(f for f in fields(record) if "check" in f.metadata)


def acting_in(where: ActsIn, record: type[StrategyOptions] = StrategyOptions) -> tuple[str, ...]:
    """The options (the SMP keys and ``record``'s own) declared to act in ``where``."""
    return tuple(f.name for f in (*IMPLEMENTED, *option_fields(record)) if where in f.metadata["acts_in"])


def engine_facing(options: StrategyOptions, config: SMPConfig) -> dict[str, Any]:
    """What the engines receive of the options: every option declared to act in the engines, by name (a field of the
    engines' ``ShardingPlan`` of the same name), as the run resolved it (an SMP key from ``config``)."""
    own = {f.name for f in option_fields(type(options))}
    return {name: getattr(options if name in own else config, name) for name in acting_in("engines", type(options))}


#: The SMP keys a strategy takes as arguments: every key this library implements.
SMP_ARGUMENTS: tuple[str, ...] = tuple(f.name for f in IMPLEMENTED)


def _documented(declared: Field, hints: Mapping[str, Any]) -> tuple[Any, Any, str]:
    """``(type, default, doc)`` of one option as a strategy argument."""
    if declared.name in SMP_ARGUMENTS:
        kind = declared.metadata.get("parsed_as") or hints[declared.name]
        unset = f", else ``{declared.default!r}``" if declared.default is not None else ""
        doc = (f"{declared.metadata['doc']} ``None`` (default): from the configuration sources (the CLI's ``smp:``"
               f" section, ``lightning_smp.init``, ``LIGHTNING_SMP_CONFIG``, ``SM_HP_MP_PARAMETERS``){unset}.")
        return kind | None, None, doc
    return hints[declared.name], declared.default, declared.metadata["doc"]


def declarations(record: type[StrategyOptions] = StrategyOptions) -> list[tuple[str, Any, Any, str]]:
    """Every option of ``record`` as ``(name, type, default, doc)``: the SMP keys first (``hybrid_shard_degree``
    leads), then the strategies' own."""
    smp_hints = get_type_hints(SMPConfig)
    own_hints = get_type_hints(record)
    return ([(f.name, *_documented(f, smp_hints)) for f in IMPLEMENTED]
            + [(f.name, *_documented(f, own_hints)) for f in option_fields(record)])


def signature_parameters(record: type[StrategyOptions] = StrategyOptions) -> list[inspect.Parameter]:
    """Every option of ``record`` as a keyword-only parameter of a strategy's constructor, typed and with its
    default."""
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind)
            for name, kind, default, _ in declarations(record)]


def arguments_doc(indent: str, record: type[StrategyOptions] = StrategyOptions) -> str:
    """The options' entries of a Google-style ``Arguments:`` section, each line indented by ``indent``."""
    import textwrap

    lines = []
    for name, _, _, doc in declarations(record):
        lines.extend(textwrap.wrap(f"{name}: {doc}", width=116 - len(indent), initial_indent=indent,
                                   subsequent_indent=indent + "    ", break_on_hyphens=False))
    return "\n".join(lines)


#: The lines around each strategy constructor's option parameters and around the options' entries in its docstring,
#: which ``python -m lightning_smp.generate`` writes from the declarations (static type checkers and IDEs read the
#: source, not the runtime signature; ``tests/test_how_to_add.py`` holds the text); the runtime docstring drops the
#: two lines around the entries.
GENERATED_BEGIN = "# the options: generated from lightning_smp.config.options (python -m lightning_smp.generate)"
GENERATED_END = "# end of the generated options"
DOC_BEGIN = "(the options, written from their declarations by python -m lightning_smp.generate:)"
DOC_END = "(end of the options)"
#: The modules whose strategy constructors hold the generated option parameters.
GENERATED_IN = ("strategy.py", "fabric.py")


def option_names(record: type[StrategyOptions] = StrategyOptions) -> tuple[str, ...]:
    """The names of every option a strategy takes beyond Lightning's own arguments."""
    return tuple(name for name, *_ in declarations(record))


__all__ = [
    "ARGUMENT_SOURCE",
    "GENERATED_BEGIN",
    "GENERATED_END",
    "GENERATED_IN",
    "DOC_BEGIN",
    "DOC_END",
    "ASYNC_FULL",
    "SMP_ARGUMENTS",
    "acting_in",
    "engine_facing",
    "StrategyOptions",
    "arguments_doc",
    "declarations",
    "check_device_mesh",
    "check_start_method_name",
    "check_state_dict_type",
    "check_gradient_accumulation",
    "option",
    "option_fields",
    "option_names",
    "process_group_degree",
    "signature_parameters",
]

