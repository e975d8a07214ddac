"""Each strategy class's constructor signature and docstring, from the options' one declaration
(:mod:`lightning_smp.config.options`): :func:`with_options`, applied to both strategies and to a subclass that adds
options."""

from __future__ import annotations

import inspect
import typing
from typing import TYPE_CHECKING, Any, TypeVar

from lightning_smp.config.options import DOC_BEGIN, DOC_END, arguments_doc, option_names, signature_parameters

if TYPE_CHECKING:
    from lightning_smp.frontend.shared import HybridShardFrontEnd

#: The line of a subclass's docstring that :func:`with_options` replaces by the options' documentation (the library's
#: own strategies hold it in their source, between ``DOC_BEGIN`` and ``DOC_END``).
OPTIONS_LINE = "(every option of lightning_smp.config.options, documented here when the class is created)"

_Strategy = TypeVar("_Strategy", bound="type[HybridShardFrontEnd]")


def with_options(cls: _Strategy) -> _Strategy:
    """Give a strategy class's constructor every option of its ``options_type`` as a typed parameter, and its
    docstring their documentation, from their one declaration (:mod:`lightning_smp.config.options`): what IDE help,
    ``help()``, notebooks and LightningCLI (``lightning-smp fit --help``, ``--print_config``) read.

    The library's strategies list Lightning's own arguments, then the options, and document them, as written from
    their declarations by ``python -m lightning_smp.generate`` (what static type checkers and IDEs read; their
    docstring holds the options' entries between ``DOC_BEGIN`` and ``DOC_END``; ``tests/test_how_to_add.py`` holds
    the source equal to what the command writes: nothing here checks it). Options that are positional parameters of
    the Lightning base class (``sharding_strategy``, ``state_dict_type``, ``device_mesh``) keep their place and kind
    there: a drop-in replacement; the others are keyword-only. A subclass that only adds options (its own
    ``options_type``, no constructor) gets them in its runtime signature, taken through ``**kwargs``
    (:meth:`HybridShardFrontEnd._take_options`)."""
    doc = vars(cls).get("__doc__") or ""
    written = "__init__" in vars(cls)
    generated = written and DOC_BEGIN in doc  # (one of the library's own strategies, written by the command)
    if not written:
        # a subclass that only adds options (options_type): its own constructor, so that the parent's keeps its
        # signature
        parent_init = cls.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            parent_init(self, *args, **kwargs)

        __init__.__signature__ = inspect.signature(parent_init)  # type: ignore[attr-defined]
        # resolved where the parent's names are (this function's module has not imported them)
        __init__.__annotations__ = typing.get_type_hints(parent_init)
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        cls.__init__ = __init__  # type: ignore[method-assign]
    init: Any = vars(cls)["__init__"]  # the class's own constructor (a function: its signature is set below)
    every = set(option_names(cls.options_type))
    parameters = [p for p in inspect.signature(init).parameters.values() if p.name not in every]
    own = [p for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    rest = [p for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD]
    lightning = next(base for base in cls.__mro__[1:]
                     if base.__module__.startswith("lightning.") and "__init__" in vars(base))
    theirs = list(inspect.signature(vars(lightning)["__init__"]).parameters.values())[len(own):]
    declared = {p.name: p for p in signature_parameters(cls.options_type)}
    positional = []
    for parameter in theirs:  # Lightning's positional parameters that follow the constructor's own, in order
        if parameter.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or parameter.name not in declared:
            break
        positional.append(declared.pop(parameter.name).replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD))
    init.__signature__ = inspect.Signature([*own, *positional, *declared.values(), *rest], return_annotation=None)
    init.__annotations__ = {**init.__annotations__, **{p.name: p.annotation for p in [*positional, *declared.values()]}}
    if generated:  # the options' entries, at run time the declarations' (without the two lines around them)
        lines = doc.splitlines()
        first = next(i for i, line in enumerate(lines) if line.strip() == DOC_BEGIN)
        last = next(i for i, line in enumerate(lines) if line.strip() == DOC_END)
        indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())]
        cls.__doc__ = "\n".join([*lines[:first], arguments_doc(indent, cls.options_type), *lines[last + 1:]])
        return cls
    line = next((line for line in doc.splitlines() if line.strip() == OPTIONS_LINE), None)
    if line is None:  # (a subclass's own docstring, or none): the options as its arguments section
        cls.__doc__ = f"{doc.rstrip()}\n\n    Arguments:\n{arguments_doc(' ' * 8, cls.options_type)}\n"
    else:
        indent = line[: len(line) - len(line.lstrip())]
        cls.__doc__ = doc.replace(line, arguments_doc(indent, cls.options_type))
    return cls



__all__ = ["OPTIONS_LINE", "with_options"]
